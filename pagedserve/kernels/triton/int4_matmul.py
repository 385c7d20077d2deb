"""A matmul on 4-bit weights kept 4-bit in GPU memory (W4A16): y = x @ W.T with W [N, K] stored as
  qweight int32 [K / 8, N]: each word holds 8 consecutive inputs of one output column, input k at bits
      4 * (k % 8) (GPTQ's layout: a row of words is read along N, coalesced);
  scales, offsets [K / GROUP, N] (float16): W[n, k] = q * scales[k // GROUP, n] + offsets[k // GROUP, n].
ggml's Q4_0 (offset -8 d) and Q4_1 (offset m) blocks, and so the 4-bit GPTQ, AWQ, compressed-tensors and
AutoRound weights the loader keeps as those blocks, are this with GROUP 32 (worker/int4_weight.py
converts them). Its torch reference is kernels/reference.int4_linear.

One program computes a BLOCK_M x BLOCK_N tile of y, walking K in BLOCK_K steps: it loads x's tile, the
BLOCK_K / 8 rows of words covering its inputs and the scales and offsets of the groups they fall in,
unpacks and scales in registers (float32), and multiplies in x's dtype with float32 accumulation. The
weight is read once per BLOCK_M rows of x: a decode step (M <= 16) reads it once, at a quarter of
bfloat16's bytes. No host sync, no allocation but the output: capturable in a CUDA graph."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton import dot_precision, is_interpreted, pow2_tile, tuning

GROUP = 32


@triton.jit(do_not_specialize=["M"])
def _int4_matmul_kernel(x_ptr, q_ptr, s_ptr, o_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                        GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Each tile's words, scales and offsets are loaded once ([BLOCK_K / 8, BLOCK_N] words, a row of scales
    per group the tile covers) and expanded in registers: the pipelined loads' shared memory stays small."""
    G_ROWS: tl.constexpr = BLOCK_K // GROUP_K if BLOCK_K >= GROUP_K else 1
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rw = tl.arange(0, BLOCK_K // 8)
    rg = tl.arange(0, G_ROWS)
    shifts = tl.arange(0, 8) * 4
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + kk[None, :],
                    mask=m_mask[:, None] & (kk[None, :] < K), other=0.0)
        w_rows = k0 // 8 + rw
        words = tl.load(q_ptr + w_rows[:, None].to(tl.int64) * N + rn[None, :],
                        mask=(w_rows[:, None] < K // 8) & n_mask[None, :], other=0)
        q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        g_rows = k0 // GROUP_K + rg
        g = g_rows[:, None].to(tl.int64) * N + rn[None, :]
        g_mask = (g_rows[:, None] < K // GROUP_K) & n_mask[None, :]
        scale = tl.load(s_ptr + g, mask=g_mask, other=0.0).to(tl.float32)
        offset = tl.load(o_ptr + g, mask=g_mask, other=0.0).to(tl.float32)
        scale = tl.reshape(tl.broadcast_to(scale[:, None, :], (G_ROWS, BLOCK_K // G_ROWS, BLOCK_N)), (BLOCK_K, BLOCK_N))
        offset = tl.reshape(tl.broadcast_to(offset[:, None, :], (G_ROWS, BLOCK_K // G_ROWS, BLOCK_N)),
                            (BLOCK_K, BLOCK_N))
        w = (q.to(tl.float32) * scale + offset).to(x_ptr.dtype.element_ty)
        acc += tl.dot(x, w, input_precision=PRECISION)
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def int4_key(x: torch.Tensor, qweight: torch.Tensor) -> str:
    """The tuning table's shape key (the batch M is keyed apart: " M=<n>")."""
    return f"{tuning.dtype_name(x.dtype)} N={qweight.shape[1]} K={qweight.shape[0] * 8}"


def launch_params(x: torch.Tensor, qweight: torch.Tensor, **given) -> dict:
    """Tiles, warps and stages: the caller's > the device's table (by M) > defaults."""
    m = x.shape[0]
    if is_interpreted(x):
        default = {"block_m": pow2_tile(min(m, 16)), "block_n": 16, "block_k": 32, "num_warps": 4, "num_stages": 1}
    elif x.dtype == torch.float32:  # no 16-bit tensor cores: small tiles keep the registers from spilling
        default = {"block_m": 16 if m <= 16 else 32, "block_n": 32, "block_k": 64, "num_warps": 4, "num_stages": 2}
    else:
        default = {"block_m": 16 if m <= 16 else 32 if m <= 64 else 64, "block_n": 64 if m <= 16 else 128,
                   "block_k": 128 if m <= 16 else 64, "num_warps": 4, "num_stages": 3}
    return tuning.resolve("int4_linear", int4_key(x, qweight), x.device, default, given, size=m)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                out_dtype: torch.dtype | None = None, block_m: int | None = None, block_n: int | None = None,
                block_k: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None) -> torch.Tensor:
    """x [M, K] (float32, float16 or bfloat16) @ W.T -> [M, N] in out_dtype (default x's). K a multiple of
    the group (K / scales.shape[0]) and of 8."""
    assert x.dim() == 2 and qweight.dtype == torch.int32
    m, k = x.shape
    n = qweight.shape[1]
    assert qweight.shape[0] * 8 == k and scales.shape == offsets.shape and scales.shape[1] == n
    group = k // scales.shape[0]
    assert group * scales.shape[0] == k and group % 8 == 0
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    p = launch_params(x, qweight, block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps,
                      num_stages=num_stages)
    bk = p["block_k"]
    assert bk % 32 == 0 and (bk % group == 0 or group % bk == 0), (bk, group)
    grid = (triton.cdiv(m, p["block_m"]), triton.cdiv(n, p["block_n"]))
    _int4_matmul_kernel[grid](x, qweight, scales, offsets, y, m, n, k, x.stride(0), y.stride(0),
                              GROUP_K=group, BLOCK_M=p["block_m"], BLOCK_N=p["block_n"], BLOCK_K=bk,
                              PRECISION=dot_precision(x.dtype), num_warps=p["num_warps"],
                              num_stages=p["num_stages"])
    return y
