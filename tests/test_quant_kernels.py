"""The quantized-weight CPU matmul against dequantize-then-matmul (gguf.quants is the reference
dequantization, bit-identical to transformers'), on random blocks and odd shapes, every format.

Tolerances, the same for every format (the weights are used exactly; only the activation is rounded):
- dequantize_rows equals gguf.quants exactly (float32);
- quant_linear against the float64 product of the dequantized weight and the activation: every
  output's error under 1% of |x_m| |w_n| (the int8 activation's rounding is ~0.6% of |x_m| per
  element and averages out along the row), and under 0.01% with precise=True (two roundings).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from pagedserve.kernels import cpu_ops

ops = cpu_ops.load()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ compiler for the CPU kernels here")

FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]
# |error| / (|x_m| |w_n|) of every output, all formats: one int8 rounding of the activation; two
TOLERANCE = {False: 1e-2, True: 1e-4}
# byte offsets of each format's float16 fields (scales and minimums) inside a block
HALF_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}


def random_blocks(fmt: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes]: random quantized values and scales, the float16 fields kept finite."""
    qtype = GGMLQuantizationType[fmt]
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for offset in HALF_FIELDS[fmt]:
        scale = 0.05 if fmt.endswith("_K") else 0.02
        halves = (rng.standard_normal(len(blocks)) * scale).astype(np.float16)
        blocks[:, offset:offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def reference_weight(fmt: str, blocks: np.ndarray, cols: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(blocks, GGMLQuantizationType[fmt]).reshape(len(blocks), cols).copy())


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_rows_equals_gguf(fmt):
    rng = np.random.default_rng(0)
    cols = 512 if fmt.endswith("_K") else 96
    blocks = random_blocks(fmt, 7, cols, rng)
    got = ops.dequantize_rows(torch.from_numpy(blocks), int(GGMLQuantizationType[fmt]), cols)
    assert torch.equal(got, reference_weight(fmt, blocks, cols))


@pytest.mark.parametrize("fmt", FORMATS)
def test_kept_blocks_dequantize_without_the_kernels_too(fmt):
    """QuantizedTensor.dequantize with no CPU kernels built (a GPU machine without a compiler: MoE experts and
    layers the int4 kernel does not take) gives the kernels' weights."""
    from pagedserve.worker.quantized import QuantizedTensor
    cols = 512 if fmt.endswith("_K") else 96
    blocks = torch.from_numpy(random_blocks(fmt, 5, cols, np.random.default_rng(2)))
    t = QuantizedTensor(blocks, GGMLQuantizationType[fmt], cols)
    assert torch.equal(t.dequantize(None, torch.float32), t.dequantize(ops, torch.float32))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows, n", [(1, 1), (3, 37), (4, 16), (6, 9), (13, 50)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("precise", [False, True])
def test_quant_linear_matches_dequantized_matmul(fmt, rows, n, dtype, precise):
    rng = np.random.default_rng(rows * 100 + n)
    cols = 768 if fmt.endswith("_K") else 160  # K-quants: 3 blocks of 256; others: 5 blocks of 32
    blocks = random_blocks(fmt, n, cols, rng)
    weight = reference_weight(fmt, blocks, cols).double()
    x = (torch.from_numpy(rng.standard_normal((rows, cols))).float() * 2).to(dtype)
    got = ops.quant_linear(x, [torch.from_numpy(blocks)], [int(GGMLQuantizationType[fmt])], precise)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    ideal = x.double() @ weight.T
    norms = x.double().norm(dim=1, keepdim=True) * weight.norm(dim=1)  # |x_m| |w_n|: a dot product's scale
    assert ((got.double() - ideal).abs() / norms).max().item() <= TOLERANCE[precise]


def test_parts_of_mixed_formats_fill_consecutive_columns():
    rng = np.random.default_rng(1)
    cols = 256
    parts = [("Q4_K", 9), ("Q6_K", 5), ("Q8_0", 3)]
    blocks = [random_blocks(fmt, n, cols, rng) for fmt, n in parts]
    x = torch.randn(5, cols)
    qtypes = [int(GGMLQuantizationType[f]) for f, _ in parts]
    got = ops.quant_linear(x, [torch.from_numpy(b) for b in blocks], qtypes)
    each = [ops.quant_linear(x, [torch.from_numpy(b)], [q]) for b, q in zip(blocks, qtypes)]
    assert torch.equal(got, torch.cat(each, dim=1))


def test_bad_shapes_are_named():
    blocks = torch.zeros(4, 18, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="do not hold"):
        ops.quant_linear(torch.zeros(1, 64), [blocks], [int(GGMLQuantizationType.Q4_0)])
    with pytest.raises(RuntimeError, match="unsupported quantization type"):
        ops.quant_linear(torch.zeros(1, 32), [blocks], [int(GGMLQuantizationType.Q5_1)])


lane = pytest.mark.skipif(ops is None or not ops.lane_linear_available(False),
                          reason="no float32 lane kernel here (AVX-512, or AVX2 with FMA)")


@lane
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows, n", [(9, 16), (13, 50), (64, 37), (70, 100)])
def test_dequant_lane_linear_is_the_float32_product_of_the_dequantized_weight(fmt, rows, n):
    """No activation rounding: float32 arithmetic on exactly the dequantized values; row counts
    around the lane kernel's 6-row tiles, column counts around its 16-column groups (short last
    group), a strided activation."""
    rng = np.random.default_rng(rows * 1000 + n)
    cols = 768 if fmt.endswith("_K") else 160
    blocks = random_blocks(fmt, n, cols, rng)
    weight = reference_weight(fmt, blocks, cols).double()
    wide = torch.from_numpy(rng.standard_normal((rows, cols + 32))).float() * 2
    x = wide[:, 16:16 + cols]
    got = ops.dequant_lane_linear(x, [torch.from_numpy(blocks)], [int(GGMLQuantizationType[fmt])])
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    ideal = x.double() @ weight.T
    norms = x.double().norm(dim=1, keepdim=True) * weight.norm(dim=1)
    assert ((got.double() - ideal).abs() / norms).max().item() <= 1e-6


@lane
def test_dequant_lane_linear_fills_parts_in_order_and_names_bad_input():
    rng = np.random.default_rng(2)
    cols = 256
    parts = [("Q4_K", 9), ("Q6_K", 21), ("Q8_0", 3)]
    blocks = [torch.from_numpy(random_blocks(fmt, n, cols, rng)) for fmt, n in parts]
    qtypes = [int(GGMLQuantizationType[f]) for f, _ in parts]
    x = torch.randn(11, cols)
    got = ops.dequant_lane_linear(x, blocks, qtypes)
    each = [ops.dequant_lane_linear(x, [b], [q]) for b, q in zip(blocks, qtypes)]
    assert torch.equal(got, torch.cat(each, dim=1))
    with pytest.raises(RuntimeError, match="float32"):
        ops.dequant_lane_linear(x.bfloat16(), blocks, qtypes)
    with pytest.raises(RuntimeError, match="do not hold"):
        ops.dequant_lane_linear(torch.zeros(2, 64), blocks[:1], qtypes[:1])
