"""The bfloat16 pair-interleaved matmul kernel (kernels/cpu/bf16_linear.cpp) and how cpu_linear
picks it: against float32 matmuls of the same bfloat16 values, on row counts around its 6-row
register tiles, column counts around its 16-column groups and 4-group tiles, strided inputs."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_ops
from pagedserve.worker import cpu_linear

ops = cpu_ops.load()
pytestmark = pytest.mark.skipif(ops is None or not ops.bf16_linear_available(),
                                reason="no avx512_bf16 kernel here")


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.float() @ w.float().T


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("n, k", [(16, 2), (40, 34), (100, 576), (576, 1536), (1000, 64)])
def test_bf16_linear_matches_float_matmul(rows, n, k):
    gen = torch.Generator().manual_seed(rows * 7919 + n + k)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    packed = ops.pack_bf16_weight(w)
    assert packed.shape == ((n + 15) // 16, k // 2, 16, 2)
    got = ops.bf16_linear(x, packed, n)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    ref = reference(x, w)
    # float32 accumulation, one rounding to bfloat16 at the end
    assert torch.allclose(got.float(), ref, rtol=1 / 128, atol=1e-3 * k ** 0.5)


def test_bf16_linear_reads_strided_rows_and_writes_only_its_columns():
    """A column slice of a wider activation (row stride > K), and a column count that ends inside
    a 16-column group: the masked last group must not write into the next row."""
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(9, 100, generator=gen).to(torch.bfloat16)
    x = wide[:, 10:74]
    w = torch.randn(37, 64, generator=gen).to(torch.bfloat16)
    got = ops.bf16_linear(x, ops.pack_bf16_weight(w), 37)
    assert torch.allclose(got.float(), reference(x, w), rtol=1 / 128, atol=1e-2)


def test_bf16_linear_rejects_bad_input():
    packed = ops.pack_bf16_weight(torch.zeros(20, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x has 6 columns, the weight 8"):
        ops.bf16_linear(torch.zeros(2, 6, dtype=torch.bfloat16), packed, 20)
    with pytest.raises(RuntimeError, match="does not match the packed groups"):
        ops.bf16_linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed, 40)
    with pytest.raises(RuntimeError, match="K must be even"):
        ops.pack_bf16_weight(torch.zeros(4, 7, dtype=torch.bfloat16))


@pytest.mark.parametrize("shape", [(1, 64), (30, 64), (2, 3, 64)])
def test_packed_linear_picks_a_layout_and_matches_f_linear(shape):
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(48, 64, generator=gen).to(torch.bfloat16)
    bias = torch.randn(48, generator=gen).to(torch.bfloat16)
    x = torch.randn(*shape, generator=gen).to(torch.bfloat16)
    packed = cpu_linear.pack(w)
    assert packed.pairs is not None and packed.out_features == 48
    # without AMX the pair kernel takes every row count and oneDNN's copy is not kept
    assert (packed.onednn is None) == (not cpu_linear._has_amx())
    got = cpu_linear.packed_linear(x, packed, bias)
    ref = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    assert got.shape == (*shape[:-1], 48)
    assert torch.allclose(got.float(), ref, rtol=1 / 64, atol=2e-2)
