"""The repacked decode kernel (kernels/cpu/quant_repack.cpp) against dequantize-then-matmul
(gguf.quants' dequantization, the reference of tests/test_quant_kernels.py), on random blocks and
odd shapes: row counts that are not multiples of the 16-row tile, 1..21 activation rows, mixed
parts. Tolerances as there: every output's error under 1% of |x_m| |w_n| with one int8 rounding
of the activation, under 0.01% with two (precise). Repacking is lossless: unpack_rows gives the
original blocks back, and QuantizedWeight over repacked parts agrees with the unrepacked one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from test_quant_kernels import TOLERANCE, random_blocks, reference_weight

from pagedserve.kernels import cpu_ops
from pagedserve.worker import quantized
from pagedserve.worker.quantized import QuantizedTensor, QuantizedWeight

ops = cpu_ops.load()
pytestmark = pytest.mark.skipif(ops is None or not ops.repacked_kernel_available(),
                                reason="no C++ compiler or no AVX-512 VNNI here")

FORMATS = ["Q4_0", "Q4_1", "Q8_0"]


def qtype(fmt: str) -> int:
    return int(GGMLQuantizationType[fmt])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 53])
def test_unpack_gives_back_the_original_blocks(fmt, n):
    rng = np.random.default_rng(n)
    blocks = torch.from_numpy(random_blocks(fmt, n, 224, rng))
    packed = ops.repack_rows(blocks, qtype(fmt))
    assert packed.shape[0] == (n + 15) // 16 and packed.shape[1] == 16 * blocks.shape[1]  # the same bytes per row
    assert torch.equal(ops.unpack_rows(packed, qtype(fmt), 224, torch.arange(n)), blocks)
    ids = torch.from_numpy(rng.integers(0, n, 9))
    assert torch.equal(ops.unpack_rows(packed, qtype(fmt), 224, ids), blocks[ids])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows, n", [(1, 1), (1, 37), (2, 16), (3, 50), (5, 9), (8, 33), (13, 17), (21, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("precise", [False, True])
def test_repacked_linear_matches_dequantized_matmul(fmt, rows, n, dtype, precise):
    rng = np.random.default_rng(rows * 100 + n)
    cols = 160  # 5 blocks of 32: an odd count (the kernel alternates two accumulators)
    blocks = random_blocks(fmt, n, cols, rng)
    weight = reference_weight(fmt, blocks, cols).double()
    x = (torch.from_numpy(rng.standard_normal((rows, cols))).float() * 2).to(dtype)
    packed = ops.repack_rows(torch.from_numpy(blocks), qtype(fmt))
    got = ops.repacked_linear(x, [packed], [qtype(fmt)], [n], precise)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    ideal = x.double() @ weight.T
    norms = x.double().norm(dim=1, keepdim=True) * weight.norm(dim=1)
    assert ((got.double() - ideal).abs() / norms).max().item() <= TOLERANCE[precise]
    # the block-at-a-time kernel rounds the activation the same way: the same sums to float rounding
    old = ops.quant_linear(x, [torch.from_numpy(blocks)], [qtype(fmt)], precise)
    assert torch.allclose(got, old, rtol=1e-4, atol=1e-4 * norms.max().item())


def test_parts_of_mixed_formats_fill_consecutive_columns():
    rng = np.random.default_rng(2)
    cols = 96
    parts = [("Q4_1", 21), ("Q8_0", 5), ("Q4_0", 16), ("Q4_1", 3)]
    blocks = [torch.from_numpy(random_blocks(fmt, n, cols, rng)) for fmt, n in parts]
    packed = [ops.repack_rows(b, qtype(fmt)) for b, (fmt, _) in zip(blocks, parts)]
    x = torch.randn(4, cols)
    got = ops.repacked_linear(x, packed, [qtype(f) for f, _ in parts], [n for _, n in parts], True)
    each = [ops.repacked_linear(x, [p], [qtype(f)], [n], True) for p, (f, n) in zip(packed, parts)]
    assert torch.equal(got, torch.cat(each, dim=1))


def test_bad_shapes_are_named():
    blocks = torch.zeros(20, 20, dtype=torch.uint8)
    packed = ops.repack_rows(blocks, qtype("Q4_1"))
    with pytest.raises(RuntimeError, match="does not hold"):
        ops.repacked_linear(torch.zeros(1, 64), [packed], [qtype("Q4_1")], [20])
    with pytest.raises(RuntimeError, match="no repacked kernel"):
        ops.repack_rows(blocks, qtype("Q4_K"))


def packed_and_plain(formats: list[tuple[str, int]], cols: int, rng, monkeypatch):
    """Parts of random blocks (format, rows), as a repacked QuantizedWeight and as a plain one
    (REPACK is off from here on)."""
    parts = [QuantizedTensor(torch.from_numpy(random_blocks(f, n, cols, rng)), GGMLQuantizationType[f], cols)
             for f, n in formats]
    packed = QuantizedWeight(parts, ops)
    monkeypatch.setattr(quantized, "REPACK", False)
    return parts, packed, QuantizedWeight(parts, ops)


@pytest.mark.parametrize("rows", [1, 8, 12])  # repacked at every row count; plain: dequantized above 8
def test_quantized_weight_repacked_equals_unrepacked(rows, monkeypatch):
    cols = 128
    parts, packed, plain = packed_and_plain([("Q4_1", 19), ("Q8_0", 7)], cols, np.random.default_rng(rows), monkeypatch)
    assert packed.repacked and not plain.repacked and packed.nbytes == plain.nbytes
    x = torch.randn(rows, cols)
    ref = plain.linear(x)
    assert torch.allclose(packed.linear(x), ref, rtol=1e-4, atol=1e-3 * ref.abs().max().item())
    assert torch.equal(packed.dense(torch.float32), plain.dense(torch.float32))
    head = QuantizedWeight(parts[:1], ops)  # one part: an embedding's row lookup
    ids = torch.tensor([[3, 0], [18, 7]])
    monkeypatch.setattr(quantized, "REPACK", True)
    assert QuantizedWeight(parts[:1], ops).repacked
    assert torch.equal(QuantizedWeight(parts[:1], ops).rows(ids, torch.float32), head.rows(ids, torch.float32))


def test_bfloat16_prefill_rows_of_repacked_weights_take_the_dequantized_matmul(monkeypatch):
    """From DEQUANTIZE_PACKED_FROM bfloat16 rows the tiles are dequantized (chunk by chunk) for a float
    matmul: the same product as the plain weight's dequantized path, with float32 rows and fewer rows
    still on the repacked kernel."""
    cols = 128
    parts, packed, plain = packed_and_plain([("Q4_1", 40), ("Q8_0", 24)], cols, np.random.default_rng(5), monkeypatch)
    monkeypatch.setattr(quantized, "DEQUANTIZE_CHUNK", 16)  # several chunks per part, a short last one
    monkeypatch.setattr(quantized, "_native_bfloat16", lambda: True)  # what this test's CPU has aside
    assert packed.repacked
    x = torch.randn(quantized.DEQUANTIZE_PACKED_FROM, cols).to(torch.bfloat16)
    dense = torch.cat([p.dequantize(ops, torch.float32) for p in parts])
    got = packed.linear(x)
    assert got.dtype == torch.bfloat16 and got.shape == (x.shape[0], 64)
    assert torch.equal(got, plain.linear(x))  # plain bfloat16 rows above 8 dequantize the same way
    ref = x.float() @ dense.T
    assert torch.allclose(got.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    kernel = packed.linear(x[:-1])  # one row fewer: the repacked kernel (the activation in int8)
    assert not torch.equal(kernel, got[:-1])
    assert torch.allclose(kernel.float(), ref[:-1], rtol=5e-2, atol=5e-2 * ref.abs().max().item())
    rows32 = x.float()  # float32 rows: the kernel too, not the plain weight's float32 path
    assert not torch.equal(packed.linear(rows32), plain.linear(rows32))
    monkeypatch.setattr(quantized, "_native_bfloat16", lambda: False)  # bfloat16 emulated: the kernel
    assert not torch.equal(packed.linear(x), got)


def test_whole_tiles_are_repacked_in_the_blocks_own_storage():
    rng = np.random.default_rng(3)
    cols = 64
    blocks = torch.from_numpy(random_blocks("Q4_1", 32, cols, rng).copy())
    original = blocks.clone()
    weight = QuantizedWeight([QuantizedTensor(blocks, GGMLQuantizationType.Q4_1, cols)], ops)
    assert weight.repacked and weight._packed[0].data_ptr() == blocks.data_ptr()  # no second copy
    assert torch.equal(weight.part_blocks(0), original)
    view = torch.from_numpy(random_blocks("Q4_1", 48, cols, rng).copy())[16:]  # a view: left alone
    kept = view.clone()
    QuantizedWeight([QuantizedTensor(view, GGMLQuantizationType.Q4_1, cols)], ops)
    assert torch.equal(view, kept)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bfloat16_output_is_the_float_output_rounded(dtype):
    rng = np.random.default_rng(4)
    blocks = torch.from_numpy(random_blocks("Q4_1", 45, 96, rng))
    packed = ops.repack_rows(blocks, qtype("Q4_1"))
    x = torch.randn(3, 96).to(dtype)
    full = ops.repacked_linear(x, [packed], [qtype("Q4_1")], [45], True)
    half = ops.repacked_linear(x, [packed], [qtype("Q4_1")], [45], True, True)
    assert half.dtype == torch.bfloat16 and torch.equal(half, full.to(torch.bfloat16))


@pytest.mark.parametrize("fmt", FORMATS)
def test_in_place_repack_equals_the_copy(fmt):
    blocks = torch.from_numpy(random_blocks(fmt, 48, 96, np.random.default_rng(5)))
    packed = ops.repack_rows(blocks, qtype(fmt))
    ops.repack_rows_(blocks, qtype(fmt))
    assert torch.equal(blocks.view(packed.shape), packed)
