"""The lane-packed matmul kernel (kernels/cpu/lane_linear.cpp) and how cpu_linear picks it: against
float64 matmuls of the same float32 / bfloat16 values, on row counts around its 6-row register
tiles, column counts around its 16-column groups and 4-group (AVX2: 2-group) tiles, strided inputs.
AVX-512 CPUs run both dtypes; AVX2-only CPUs float32 (their own variant of the kernel)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_ops
from pagedserve.worker import cpu_linear

ops = cpu_ops.load()
DTYPES = [torch.float32, torch.bfloat16]
pytestmark = pytest.mark.skipif(ops is None or not ops.lane_linear_available(False),
                                reason="no lane kernel here (AVX-512, or AVX2 with FMA)")


def needs(dtype: torch.dtype) -> None:
    if not ops.lane_linear_available(dtype == torch.bfloat16):
        pytest.skip(f"no {dtype} lane kernel on this CPU")


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().T


def close(got: torch.Tensor, ref: torch.Tensor, k: int) -> bool:
    """float32 accumulation; bfloat16 output rounded once at the end."""
    if got.dtype == torch.bfloat16:
        return torch.allclose(got.double(), ref, rtol=1 / 128, atol=1e-3 * k ** 0.5)
    return torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5 * k ** 0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("n, k", [(16, 2), (40, 34), (100, 576), (576, 1536), (1000, 64)])
def test_lane_linear_matches_float64_matmul(dtype, rows, n, k):
    needs(dtype)
    gen = torch.Generator().manual_seed(rows * 7919 + n + k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    packed = ops.pack_lane_weight(w)
    units = k // 2 if dtype == torch.bfloat16 else k
    assert packed.shape == ((n + 15) // 16, units, 16) and packed.dtype == torch.int32
    got = ops.lane_linear(x, packed, n)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert close(got, reference(x, w), k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lane_linear_reads_strided_rows_and_writes_only_its_columns(dtype):
    """A column slice of a wider activation (row stride > K), and a column count that ends inside
    a 16-column group: the masked last group must not write into the next row."""
    needs(dtype)
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(9, 100, generator=gen).to(dtype)
    x = wide[:, 10:74]
    w = torch.randn(37, 64, generator=gen).to(dtype)
    got = ops.lane_linear(x, ops.pack_lane_weight(w), 37)
    assert close(got, reference(x, w), 64)


def test_lane_linear_rejects_bad_input():
    packed = ops.pack_lane_weight(torch.zeros(20, 8))
    with pytest.raises(RuntimeError, match="x has 6 columns, the weight 8"):
        ops.lane_linear(torch.zeros(2, 6), packed, 20)
    with pytest.raises(RuntimeError, match="does not match the packed groups"):
        ops.lane_linear(torch.zeros(2, 8), packed, 40)
    with pytest.raises(RuntimeError, match="K must be even"):
        ops.pack_lane_weight(torch.zeros(4, 7, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.pack_lane_weight(torch.zeros(4, 8, dtype=torch.float16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (30, 64), (2, 3, 64)])
def test_packed_linear_picks_a_layout_and_matches_f_linear(dtype, shape):
    needs(dtype)
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(48, 64, generator=gen).to(dtype)
    bias = torch.randn(48, generator=gen).to(dtype)
    x = torch.randn(*shape, generator=gen).to(dtype)
    packed = cpu_linear.pack(w)
    assert packed.lanes is not None and packed.out_features == 48
    # oneDNN's copy is kept only for bfloat16 on an AMX CPU, where it takes the larger row counts
    assert (packed.onednn is not None) == (dtype == torch.bfloat16 and cpu_linear._has_amx())
    got = cpu_linear.packed_linear(x, packed, bias)
    ref = torch.nn.functional.linear(x.double(), w.double(), bias.double())
    assert got.shape == (*shape[:-1], 48)
    tol = 1 / 64 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(got.double(), ref, rtol=tol, atol=tol * 2)


def test_bfloat16_without_bfloat16_arithmetic_runs_on_float32_lanes():
    """A CPU with the float32 lane kernel but no bfloat16 one and no oneDNN bfloat16 (AVX2 only):
    a bfloat16 weight is widened to float32 lanes at pack time; the output is bfloat16, computed
    with float32 products and sums (rounded once, at the end)."""
    if cpu_linear._lane_kernel(True) is not None or cpu_linear._onednn_bf16():
        pytest.skip("this CPU computes bfloat16 itself")
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(40, 96, generator=gen).bfloat16()
    x = torch.randn(7, 96, generator=gen).bfloat16()
    assert cpu_linear.available(torch.device("cpu"), torch.bfloat16)
    packed = cpu_linear.pack(w)
    assert packed.widened and packed.onednn is None and packed.lanes is not None
    got = cpu_linear.packed_linear(x, packed)
    assert got.dtype == torch.bfloat16 and got.shape == (7, 40)
    assert close(got, reference(x, w), 96)
