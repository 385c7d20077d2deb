"""The quantized-weight CPU matmul against dequantize-then-matmul (gguf.quants is the reference
dequantization, bit-identical to transformers'), on random blocks and odd shapes, every format.

Tolerances, per format alike (the weights are used exactly; only the activation is rounded):
- dequantize_rows equals gguf.quants exactly;
- quant_linear equals the float64 product of the dequantized weight with the activation as the
  kernel quantizes it (int8 per element, a scale per 32) within 1e-5 of the output's scale;
- against the unrounded activation, every output's error is under 1% of |x_m| |w_n| (the int8
  activation's rounding is ~0.6% of |x_m| per element, and averages out along the row).
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

FORMATS = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"]
# byte offsets of each format's float16 fields (scales and minimums) inside a block
HALF_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}


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


def q8_rounded(x: torch.Tensor) -> torch.Tensor:
    """The activation as the kernel sees it: int8 per element, amax/127 per 32 (round half even)."""
    blocks = x.double().reshape(x.shape[0], -1, 32)
    d = (blocks.abs().amax(-1, keepdim=True).float() / 127).double()
    inv = torch.where(d > 0, 1 / d.float().double(), torch.zeros_like(d)).float().double()
    return (torch.round((blocks.float() * inv.float()).double()) * d).reshape(x.shape)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_rows_equals_gguf(fmt):
    rng = np.random.default_rng(0)
    cols = 512 if fmt.endswith("_K") else 96
    blocks = random_blocks(fmt, 7, cols, rng)
    got = ops.dequantize_rows(torch.from_numpy(blocks), int(GGMLQuantizationType[fmt]), cols)
    assert torch.equal(got, reference_weight(fmt, blocks, cols))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows, n", [(1, 1), (3, 37), (8, 16), (13, 50)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_matches_dequantized_matmul(fmt, rows, n, dtype):
    rng = np.random.default_rng(rows * 100 + n)
    cols = 768 if fmt.endswith("_K") else 160  # K-quants: 3 blocks of 256; others: 5 blocks of 32
    blocks = random_blocks(fmt, n, cols, rng)
    weight = reference_weight(fmt, blocks, cols).double()
    x = (torch.from_numpy(rng.standard_normal((rows, cols))).float() * 2).to(dtype)
    got = ops.quant_linear(x, [torch.from_numpy(blocks)], [int(GGMLQuantizationType[fmt])])
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    exact = q8_rounded(x.float()) @ weight.T
    scale = exact.abs().max().item() + 1e-30
    assert (got.double() - exact).abs().max().item() <= 1e-5 * scale
    ideal = x.double() @ weight.T
    norms = x.double().norm(dim=1, keepdim=True) * weight.norm(dim=1)  # |x_m| |w_n|: a dot product's scale
    assert ((got.double() - ideal).abs() / norms).max().item() <= 0.01


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
        ops.quant_linear(torch.zeros(1, 32), [blocks], [int(GGMLQuantizationType.Q5_0)])
