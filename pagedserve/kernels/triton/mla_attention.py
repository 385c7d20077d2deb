"""Multi-head latent attention (MLA, DeepSeek-V2/V3) in its absorbed form, in Triton, over the paged
compressed cache. The torch reference with the same contract is pagedserve.kernels.reference.paged_mla_attention.

Every query head reads the same single latent "kv head", so one program serves several heads at once:
its tile's M rows are (query token, head) pairs, TOKENS tokens of one sequence x HEADS heads, and each
latent tile it loads feeds both the score and the output product. Decode steps use TOKENS = 1.

A decode step with too few programs to fill half the GPU (a small batch: sequences x head blocks below half
the multiprocessor count) over tables spanning SPLIT_MIN_LEN positions or more splits each sequence's keys
into runs, as flash-decoding and FlashMLA do: a program per (head block, sequence, run) writes its
run's unnormalized output and softmax max and sum, and split_decode's combine kernel weighs the runs
(the same rule, split plan and combine as paged attention's split kernel; attention_choice.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton import dot_precision, is_interpreted, next_pow2, pow2_tile, step_tiles
from pagedserve.kernels.triton.attention_choice import multiprocessors, use_split_decode
from pagedserve.kernels.triton.paged_attention import LOG2E, NEG_BIG, online_softmax_step, paged_offsets
from pagedserve.kernels.triton.split_decode import _combine_kernel, split_plan
from pagedserve.kernels.triton.tuning import dtype_name, resolve


@triton.jit(do_not_specialize=["stride_table", "chunk", "num_splits"])
def _mla_kernel(ql_ptr, qr_ptr, cache_ptr, o_ptr, tables_ptr, seq_lens_ptr, qsl_ptr, tile_seq_ptr, tile_start_ptr,
                qk_scale, num_heads, stride_qlt, stride_qlh, stride_qrt, stride_qrh, stride_cb, stride_cs,
                stride_ot, stride_oh, stride_table, ml_ptr, chunk, num_splits,
                L: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr, TOKENS: tl.constexpr, HEADS: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
                SPLIT: tl.constexpr):
    """Program (head block, query tile[, run]). Row r of the tile is token m0 + r // HEADS of the tile's
    sequence and head hb * HEADS + r % HEADS. The latent part (L) and the rope part (R) of each cached
    token are loaded and multiplied separately, so each pads to its own power of two. With SPLIT (decode
    steps: a tile is a sequence's one token) the program covers key positions [run * chunk, + chunk) and
    writes its unnormalized output to o_ptr as [S, splits, H, L] float32 and (max, sum) to ml_ptr."""
    head_block = tl.program_id(0)
    tile = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    if seq < 0:  # surplus tile of the upper-bound grid
        return
    m0 = tl.load(tile_start_ptr + tile)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len
    r = tl.arange(0, TOKENS * HEADS)
    tok = m0 + r // HEADS
    head = head_block * HEADS + r % HEADS
    r_mask = (tok < q_len) & (head < num_heads)
    # masked rows (past the sequence's queries, or past the last head) address its first row and head 0:
    # every address stays inside the tensors even where a mask is off, as in the paged attention kernels
    head = tl.where(r_mask, head, 0)
    q_rows = (q_start + tl.where(r_mask, tok, 0)).to(tl.int64)
    q_pos = context + tok
    lat = tl.arange(0, BLOCK_L)
    rope = tl.arange(0, BLOCK_R)
    q_lat = tl.load(ql_ptr + q_rows[:, None] * stride_qlt + head[:, None] * stride_qlh + lat[None, :],
                    mask=r_mask[:, None] & (lat[None, :] < L), other=0.0)
    q_pe = tl.load(qr_ptr + q_rows[:, None] * stride_qrt + head[:, None] * stride_qrh + rope[None, :],
                   mask=r_mask[:, None] & (rope[None, :] < R), other=0.0)
    table_row = tables_ptr + seq.to(tl.int64) * stride_table
    m_i = tl.full([TOKENS * HEADS], NEG_BIG, tl.float32)
    l_i = tl.zeros([TOKENS * HEADS], tl.float32)
    acc = tl.zeros([TOKENS * HEADS, BLOCK_L], tl.float32)
    end = tl.minimum(seq_len, context + m0 + TOKENS)  # the tile's last token sees no further
    lo = 0
    if SPLIT:
        lo = tl.program_id(2) * chunk
        end = tl.minimum(end, lo + chunk)
    for start in range(lo, end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        n_mask = pos < end
        off = paged_offsets(table_row, pos, n_mask, PAGE, stride_cb, stride_cs)
        c_kv = tl.load(cache_ptr + off[:, None] + lat[None, :], mask=n_mask[:, None] & (lat[None, :] < L), other=0.0)
        k_pe = tl.load(cache_ptr + off[:, None] + L + rope[None, :],
                       mask=n_mask[:, None] & (rope[None, :] < R), other=0.0)
        s = tl.dot(q_lat, tl.trans(c_kv), input_precision=PRECISION)
        s = (s + tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION)) * qk_scale
        s = tl.where(n_mask[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(c_kv.dtype), c_kv, input_precision=PRECISION)
    if SPLIT:
        part = (seq.to(tl.int64) * num_splits + tl.program_id(2)) * num_heads + head  # [rows] of acc / ml
        tl.store(o_ptr + part[:, None] * L + lat[None, :], acc, mask=r_mask[:, None] & (lat[None, :] < L))
        tl.store(ml_ptr + part * 2, m_i, mask=r_mask)
        tl.store(ml_ptr + part * 2 + 1, l_i, mask=r_mask)
    else:
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(o_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + lat[None, :],
                 acc.to(o_ptr.dtype.element_ty), mask=r_mask[:, None] & (lat[None, :] < L))


def _tile_tokens(heads: int, decode: bool, q_latent: torch.Tensor) -> int:
    """TOKENS of a program's tile given its HEADS (powers of two): TOKENS * HEADS rows must be >= 16 for
    tl.dot; on a GPU the [rows, L] float32 accumulator (L = 512 in DeepSeek) bounds them to 16 by default,
    or 32 for a mixed step with 16-bit inputs, unless HEADS alone is more."""
    wide = not decode and not is_interpreted(q_latent) and q_latent.element_size() <= 2
    return max(1, (32 if wide else 16) // heads)


def mla_key(q_latent, q_rope, latent_cache, decode: bool) -> str:
    """What the MLA kernel's tiles depend on besides the batch (tuning.py's shape key)."""
    return (f"{dtype_name(q_latent.dtype)} H={q_latent.shape[1]} L={q_latent.shape[2]} R={q_rope.shape[-1]} "
            f"page={latent_cache.shape[1]} {'decode' if decode else 'mixed'}")


def launch_params(q_latent, q_rope, latent_cache, decode: bool, **given) -> dict:
    """The MLA kernel's heads per program, key tile, warps and stages: the caller's > the device's table >
    defaults. On a GPU a 16-bit decode step with 64 heads or more takes 64 heads a program (FlashMLA's
    tile): compiled for sm_90 its products are warpgroup MMAs (wgmma) with q in shared memory, where 16
    heads give per-warp mma.sync, and each latent tile loaded serves 4x the heads (kernels.bench
    --compile-only: 255 registers, 8 bytes spilled, 110 KB shared at 16 keys a tile and 2 stages).
    Otherwise 16 heads and 32 keys (16 under the interpreter)."""
    small = is_interpreted(q_latent)
    num_heads, rank = q_latent.shape[1], q_latent.shape[2]
    if decode and not small and q_latent.element_size() <= 2 and num_heads >= 64:
        default = dict(heads=64, block_n=16, num_warps=8, num_stages=2)
    else:
        default = dict(heads=min(16, next_pow2(num_heads)), block_n=16 if small else 32,
                       num_warps=4 if small or rank <= 128 else 8, num_stages=3)
    return resolve("mla", mla_key(q_latent, q_rope, latent_cache, decode), q_latent.device, default, given)


def paged_mla_attention(q_latent, q_rope, latent_cache, block_tables, seq_lens, query_start_loc, scale,
                        kv_lora_rank, out=None, *, block_n: int | None = None, num_warps: int | None = None,
                        num_stages: int | None = None, heads: int | None = None, num_splits: int | None = None,
                        sms: int | None = None, step_cache: dict | None = None):
    """Absorbed MLA over a paged latent cache; contract in pagedserve.kernels.reference.paged_mla_attention.

    q_latent [T, H, L], q_rope [T, H, R], latent_cache [num_blocks, block_size, 1, L + R] (c_kv then k_pe),
    block_tables [S, max_blocks] int32, seq_lens [S] int32, query_start_loc [S+1] int32. Every sequence has
    at least one new token; T == S is a decode step. Returns [T, H, L] in q_latent's dtype. `heads` (a power
    of two) query heads share each program's latent tiles. A decode step splits its keys into runs when
    num_splits says so, or by the rule in the module's docstring (`sms` standing in for the device's
    multiprocessor count; 0 off CUDA: no split unless asked). `step_cache`: the step's layers share what is
    built once a step (kernels/triton's step_tiles)."""
    num_tokens, num_heads, rank = q_latent.shape
    rope_dim = q_rope.shape[-1]
    assert rank == kv_lora_rank and latent_cache.shape[2] == 1 and latent_cache.shape[-1] == rank + rope_dim
    assert q_latent.stride(-1) == q_rope.stride(-1) == latent_cache.stride(-1) == block_tables.stride(-1) == 1
    if out is None:
        out = torch.empty(num_tokens, num_heads, rank, dtype=q_latent.dtype, device=q_latent.device)
    assert out.shape == (num_tokens, num_heads, rank) and out.stride(-1) == 1
    if num_tokens == 0:
        return out
    decode = num_tokens == seq_lens.shape[0]
    p = launch_params(q_latent, q_rope, latent_cache, decode, heads=heads, block_n=block_n, num_warps=num_warps,
                      num_stages=num_stages)
    heads = p["heads"]
    head_blocks = triton.cdiv(num_heads, heads)
    span = block_tables.shape[1] * latent_cache.shape[1]
    if decode and num_splits is None:
        sms = multiprocessors(q_latent.device) if sms is None else sms
        # only where half the multiprocessors or more would idle: a run's partial output is L = 512 floats a
        # head, written and read again, which a batch that nearly fills the GPU does not win back
        num_splits = None if use_split_decode(num_tokens, head_blocks, span, sms // 2) else 1
    splits, chunk = split_plan(span, p["block_n"], num_splits) if decode else (1, 0)
    tokens = _tile_tokens(heads, decode, q_latent)
    tile_seq, tile_start, num_tiles = step_tiles(step_cache, query_start_loc, num_tokens, tokens)
    split = splits > 1
    target, ml = out, out  # ml is not read unless split
    if split:
        target = torch.empty(num_tokens, splits, num_heads, rank, dtype=torch.float32, device=q_latent.device)
        ml = torch.empty(num_tokens, splits, num_heads, 2, dtype=torch.float32, device=q_latent.device)
    _mla_kernel[(head_blocks, num_tiles, splits)](
        q_latent, q_rope, latent_cache, target, block_tables, seq_lens, query_start_loc, tile_seq, tile_start,
        scale * LOG2E, num_heads, q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        ml, chunk, splits,
        L=rank, R=rope_dim, PAGE=latent_cache.shape[1], TOKENS=tokens, HEADS=heads, BLOCK_N=p["block_n"],
        BLOCK_L=pow2_tile(rank), BLOCK_R=pow2_tile(rope_dim), PRECISION=dot_precision(q_latent.dtype),
        SPLIT=split, num_warps=p["num_warps"], num_stages=p["num_stages"])
    if split:
        _combine_kernel[(num_tokens, num_heads)](target, ml, out, query_start_loc, splits, num_heads, out.stride(0),
                                                 out.stride(1), DV=rank, BLOCK_S=max(2, next_pow2(splits)),
                                                 BLOCK_DV=pow2_tile(rank))
    return out
