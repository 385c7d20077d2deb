"""Fused elementwise kernels for the CUDA ops bundle, in Triton: RMSNorm with the residual add before it,
rotary embedding in place on q and k, SiLU/GELU-and-mul, and the paged KV-cache write (also MLA's
latent + rope-key rows). The torch references with the same contracts are in pagedserve.kernels.reference
(rms_norm, rotary, act_and_mul, write_kv_cache) and pagedserve.worker.mla_attention (write_latent_cache).

Each replaces a chain of small torch kernels (RMSNorm alone is pow / mean / add / rsqrt / mul / cast /
mul) with one launch per call, and none reads or writes a tensor more than once. One program handles
one token row (norm, activation, KV write) or one token's heads (rotary); math is float32 and results
are cast to the inputs' dtype, rounding where the torch models round (the residual sum is stored in the
activation dtype before it is normalized; the normalized row is cast before the weight multiplies it,
except for Gemma's (1 + w), which multiplies in float32 as transformers does).

No host sync and no allocation besides the outputs: every launch can be captured in a CUDA graph.
A slot id < 0 in the KV write skips that row (padding rows of a captured batch write nowhere)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton import next_pow2


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, o_ptr, n_cols, stride_x, stride_r, stride_o, eps,
                     HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        out = xf * inv * (1.0 + w)
    else:
        out = (xf * inv).to(o_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(o_ptr + row * stride_o + cols, out.to(o_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             *, gemma: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, N] -> x / rms(x) * w ([T, N], x's dtype). With residual [T, N]: residual += x first (in place,
    in residual's dtype) and the sum is what is normalized, vLLM's fused_add_rms_norm. gemma: * (1 + w)."""
    assert x.stride(-1) == 1 and x.dim() == 2
    rows, cols = x.shape
    out = torch.empty_like(x) if out is None else out
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1
    if rows:
        res = residual if residual is not None else x
        _rms_norm_kernel[(rows,)](x, res, weight, out, cols, x.stride(0), res.stride(0), out.stride(0), eps,
                                  HAS_RESIDUAL=residual is not None, GEMMA=gemma,
                                  BLOCK=next_pow2(cols), num_warps=4 if cols <= 4096 else 8)
    return out


@triton.jit
def _rotate_heads(base, tok, stride_t, stride_h, heads, c, s, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    ptr = base + tok * stride_t + h[:, None] * stride_h + i[None, :]
    mask = (h[:, None] < heads) & (i[None, :] < HALF)
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr, (x1 * c[None, :] - x2 * s[None, :]).to(base.dtype.element_ty), mask=mask)
    tl.store(ptr + HALF, (x2 * c[None, :] + x1 * s[None, :]).to(base.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_table, num_q_heads, num_k_heads,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Program (token): every q and k head of the token rotated in place, NeoX halves: for i < HALF,
    (x_i, x_{i+HALF}) -> (x_i c - x_{i+HALF} s, x_{i+HALF} c + x_i s) with c, s the table's row at the
    token's position (the tables repeat each angle for both halves, as the models build them)."""
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    c = tl.load(cos_ptr + pos * stride_table + i, mask=i < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_table + i, mask=i < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, tok, stride_qt, stride_qh, num_q_heads, c, s, HALF, BLOCK_H, BLOCK_HALF)
    _rotate_heads(k_ptr, tok, stride_kt, stride_kh, num_k_heads, c, s, HALF, BLOCK_H, BLOCK_HALF)


def rotary_inplace(q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                   positions: torch.Tensor, rotary_dim: int | None = None) -> None:
    """q [T, Hq, D], k [T, Hk, D] (views into the fused projection are fine) rotated in place over their
    first rotary_dim (default D) values; cos/sin tables [max_positions, >= rotary_dim] (float32), positions [T]."""
    tokens = q.shape[0]
    rot = rotary_dim or q.shape[-1]
    assert q.stride(-1) == k.stride(-1) == cos_table.stride(-1) == sin_table.stride(-1) == 1 and rot % 2 == 0
    assert cos_table.stride(0) == sin_table.stride(0)
    if tokens:
        heads = max(q.shape[1], k.shape[1])
        _rotary_kernel[(tokens,)](q, k, cos_table, sin_table, positions, q.stride(0), q.stride(1), k.stride(0),
                                  k.stride(1), cos_table.stride(0), q.shape[1], k.shape[1], HALF=rot // 2,
                                  BLOCK_H=next_pow2(heads), BLOCK_HALF=next_pow2(rot // 2))


@triton.jit
def _act_and_mul_kernel(x_ptr, o_ptr, inter, stride_x, stride_o, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # tanh approximation: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), tanh(u) = 2 sigmoid(2u) - 1
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate * tl.sigmoid(2.0 * u)
    else:
        act = gate * tl.sigmoid(gate)
    tl.store(o_ptr + row * stride_o + cols, (act * up).to(o_ptr.dtype.element_ty), mask=mask)


def act_and_mul(x: torch.Tensor, activation: str = "silu", out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2I] (gate then up) -> act(gate) * up [T, I]; activation "silu" or "gelu_tanh"."""
    if activation not in ("silu", "gelu_tanh"):
        raise ValueError(f"activation must be silu or gelu_tanh, got {activation!r}")
    assert x.stride(-1) == 1 and x.dim() == 2
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, inter, dtype=x.dtype, device=x.device) if out is None else out
    if rows:
        block = min(1024, next_pow2(inter))
        _act_and_mul_kernel[(rows, triton.cdiv(inter, block))](x, out, inter, x.stride(0), out.stride(0),
                                                               GELU=activation == "gelu_tanh", BLOCK=block)
    return out


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_vt, stride_kc, stride_vc,
                     K_WIDTH: tl.constexpr, V_WIDTH: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    kc = tl.arange(0, BLOCK_K)
    tl.store(kc_ptr + slot * stride_kc + kc, tl.load(k_ptr + tok * stride_kt + kc, mask=kc < K_WIDTH),
             mask=kc < K_WIDTH)
    vc = tl.arange(0, BLOCK_V)
    tl.store(vc_ptr + slot * stride_vc + vc, tl.load(v_ptr + tok * stride_vt + vc, mask=vc < V_WIDTH),
             mask=vc < V_WIDTH)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """key [T, KVH, D], value [T, KVH, Dv] into k_cache [blocks, page, KVH, D] / v_cache [.., Dv] at flat slot
    slot_mapping[t] = block * page + offset; a slot < 0 writes nothing. Each token's heads must be
    contiguous (the projection's views are: heads, then dims)."""
    tokens = key.shape[0]
    k_width, v_width = key.shape[1] * key.shape[2], value.shape[1] * value.shape[2]
    assert key.stride(2) == 1 and key.stride(1) == key.shape[2] and value.stride(2) == 1
    assert value.stride(1) == value.shape[2] and k_cache.is_contiguous() and v_cache.is_contiguous()
    if tokens:
        _kv_write_kernel[(tokens,)](key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0),
                                    k_width, v_width, K_WIDTH=k_width, V_WIDTH=v_width,
                                    BLOCK_K=next_pow2(k_width), BLOCK_V=next_pow2(v_width))


def write_latent_cache(latent: torch.Tensor, rope: torch.Tensor, latent_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """MLA's cache write: latent [T, L] and rope [T, R] (rows contiguous) into latent_cache
    [blocks, page, 1, L + R] at flat slot slot_mapping[t], the latent first; a slot < 0 writes nothing.
    The KV write kernel with the rope half as its "value" cache, one launch for both halves."""
    tokens, rank = latent.shape
    width = latent_cache.shape[-1]
    assert rank + rope.shape[1] == width and latent_cache.shape[2] == 1 and latent_cache.is_contiguous()
    assert latent.stride(1) == 1 and rope.stride(1) == 1
    if tokens:
        _kv_write_kernel[(tokens,)](latent, rope, latent_cache, latent_cache[..., rank:], slot_mapping,
                                    latent.stride(0), rope.stride(0), width, width, K_WIDTH=rank,
                                    V_WIDTH=rope.shape[1], BLOCK_K=next_pow2(rank),
                                    BLOCK_V=next_pow2(rope.shape[1]))
