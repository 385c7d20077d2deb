"""The grouped LoRA matmuls of a step (Punica's BGMV/SGMV idea), in Triton: every row multiplies by
its own adapter's weights, gathered from the slot stacks by the row's slot, in one launch per
shrink and per expand for the whole batch, whatever mix of adapters it holds.

    sgmv_shrink(x [T, K], a [S, R, K], row_slots [T])          -> v [T, R]   v[t] = a[slot_t] @ x[t]
    sgmv_expand_(out [T, N], v [T, *], b [S, r, n], row_slots, v_start, out_start)
                                      out[t, out_start:+n] += v[t, v_start:+r] @ b[slot_t]

A row whose slot is < 0 (the base model) gets zeros from the shrink and nothing from the expand.
One program handles one row and one block of output columns: it reads its adapter's tile of the
stack (rows of the same adapter read the same tiles, which stay in L2) and its own activations
once; sums in float32, results in the output's dtype. No host sync and no allocation besides
the shrink's output. The torch form of the same contract: worker/lora/layers.LoraLayer.grouped_delta
(the CPU's), and the naive per-row loop of tests/test_triton_lora.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton import next_pow2


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slot_ptr, v_ptr, K, R, stride_x, stride_as, stride_ar, stride_v,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    rs = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if slot >= 0:
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row * stride_x + ks, mask=ks < K, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + slot * stride_as + rs[:, None] * stride_ar + ks[None, :],
                        mask=(rs[:, None] < R) & (ks[None, :] < K), other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(v_ptr + row * stride_v + rs, acc.to(v_ptr.dtype.element_ty), mask=rs < R)


@triton.jit
def _expand_kernel(v_ptr, b_ptr, slot_ptr, out_ptr, N, RANK, v_start, out_start, stride_v, stride_bs, stride_br,
                   stride_o, BLOCK_N: tl.constexpr, BLOCK_RANK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot >= 0:
        js = tl.arange(0, BLOCK_RANK)
        v = tl.load(v_ptr + row * stride_v + v_start + js, mask=js < RANK, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + slot * stride_bs + js[:, None] * stride_br + ns[None, :],
                    mask=(js[:, None] < RANK) & (ns[None, :] < N), other=0.0).to(tl.float32)
        delta = tl.sum(v[:, None] * b, axis=0)
        ptrs = out_ptr + row * stride_o + out_start + ns
        old = tl.load(ptrs, mask=ns < N, other=0.0).to(tl.float32)
        tl.store(ptrs, (old + delta).to(out_ptr.dtype.element_ty), mask=ns < N)


def sgmv_shrink(x: torch.Tensor, a: torch.Tensor, row_slots: torch.Tensor, block_r: int = 16,
                block_k: int = 128) -> torch.Tensor:
    """x [T, K] (unit stride in K), a [S, R, K] contiguous, row_slots [T] int -> v [T, R] in x's dtype."""
    rows, K = x.shape
    R = a.shape[1]
    assert a.shape[2] == K and x.stride(1) == 1 and a.is_contiguous() and row_slots.shape[0] == rows
    v = torch.empty(rows, R, dtype=x.dtype, device=x.device)
    if rows:
        grid = (rows, triton.cdiv(R, block_r))
        _shrink_kernel[grid](x, a, row_slots, v, K, R, x.stride(0), a.stride(0), a.stride(1), v.stride(0),
                             BLOCK_R=block_r, BLOCK_K=block_k)
    return v


def sgmv_expand_(out: torch.Tensor, v: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor, v_start: int,
                 out_start: int, block_n: int = 64) -> torch.Tensor:
    """out[:, out_start:out_start + n] += v[:, v_start:v_start + r] @ b[slot] per row, in place;
    b [S, r, n] contiguous; out and v with unit column stride."""
    rows = out.shape[0]
    _, rank, n = b.shape
    assert out.stride(1) == 1 and v.stride(1) == 1 and b.is_contiguous() and row_slots.shape[0] == rows
    if rows:
        grid = (rows, triton.cdiv(n, block_n))
        _expand_kernel[grid](v, b, row_slots, out, n, rank, v_start, out_start, v.stride(0), b.stride(0),
                             b.stride(1), out.stride(0), BLOCK_N=block_n,
                             BLOCK_RANK=max(16, next_pow2(rank)))
    return out
