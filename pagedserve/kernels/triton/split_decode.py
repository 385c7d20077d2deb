"""Decode attention split over the KV length (flash-decoding), in Triton, over the paged cache; the contract
is pagedserve.kernels.reference.paged_attention for a pure decode step (one new token per sequence).

paged_attention's decode kernel runs one program per (sequence, kv head): at batch 1 with a long context
that is a handful of programs on a GPU with over a hundred SMs. Here each (sequence, kv head) is split
into `num_splits` runs of `chunk` consecutive key positions; a program computes its run's unnormalized
output and its softmax max and sum (float32, log2 domain) into scratch buffers, and a second kernel
combines a sequence's runs per head: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.

The split is decided from shapes alone (the block table's width bounds every sequence's length, a sliding
window every layer's reach): no host sync, so a decode graph can capture it. Runs past a sequence's end do
no work and store max = -1e30, sum = 0, which the combine weighs by 0. paged_attention chooses it by the
rule in attention_choice.py; where it pays is for a GPU to measure (kernels.bench)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton import next_pow2, pow2_tile
from pagedserve.kernels.triton.paged_attention import (
    NEG_BIG,
    _check,
    _common_args,
    _constexprs,
    launch_params,
    layer_args,
    layer_constexprs,
    log2_scores,
    online_softmax_step,
    paged_offsets,
)


@triton.jit(do_not_specialize=["stride_table", "chunk"])
def _split_kernel(q_ptr, k_ptr, v_ptr, acc_ptr, ml_ptr, tables_ptr, seq_lens_ptr, qsl_ptr, qk_scale, softcap, window,
                  stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                  stride_ot, stride_oh, stride_table, chunk, num_splits, num_heads,
                  GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  PRECISION: tl.constexpr, SOFTCAP: tl.constexpr, WINDOWED: tl.constexpr):
    """Program (sequence, kv head, split): the GROUP query heads of that kv head against key positions
    [split * chunk, min(seq_len, (split + 1) * chunk)); with a window the runs start at the window's first
    key (seq_len - window), so the splits share the window alone (decode_span). Writes acc [S, splits, H, DV]
    and (max, sum) [S, splits, H, 2] rows of its heads."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = split * chunk
    if WINDOWED:
        lo += tl.maximum(seq_len - window, 0)
    hi = tl.minimum(seq_len, lo + chunk)
    row = tl.load(qsl_ptr + seq).to(tl.int64)
    hh = tl.arange(0, BLOCK_H)
    h_mask = hh < GROUP
    heads = kv_head * GROUP + tl.where(h_mask, hh, 0)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=h_mask[:, None] & (d[None, :] < D), other=0.0)
    table_row = tables_ptr + seq.to(tl.int64) * stride_table
    m_i = tl.full([BLOCK_H], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        n_mask = pos < hi
        k_off = paged_offsets(table_row, pos, n_mask, PAGE, stride_kb, stride_ks) + kv_head * stride_kh
        k = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=n_mask[:, None] & (d[None, :] < D), other=0.0)
        s = log2_scores(tl.dot(q, tl.trans(k), input_precision=PRECISION), qk_scale, softcap, SOFTCAP)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
        v_off = paged_offsets(table_row, pos, n_mask, PAGE, stride_vb, stride_vs) + kv_head * stride_vh
        v = tl.load(v_ptr + v_off[:, None] + dv[None, :], mask=n_mask[:, None] & (dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    part = (seq.to(tl.int64) * num_splits + split) * num_heads + heads  # [BLOCK_H] row of acc / ml
    tl.store(acc_ptr + part[:, None] * DV + dv[None, :], acc, mask=h_mask[:, None] & (dv[None, :] < DV))
    tl.store(ml_ptr + part * 2, m_i, mask=h_mask)
    tl.store(ml_ptr + part * 2 + 1, l_i, mask=h_mask)


@triton.jit
def _combine_kernel(acc_ptr, ml_ptr, o_ptr, qsl_ptr, num_splits, num_heads, stride_ot, stride_oh,
                    DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Program (sequence, head): its splits' partial outputs, weighed by their softmax max and sum."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    s_mask = sp < num_splits
    dv = tl.arange(0, BLOCK_DV)
    part = (seq.to(tl.int64) * num_splits + tl.where(s_mask, sp, 0)) * num_heads + head
    m = tl.load(ml_ptr + part * 2, mask=s_mask, other=NEG_BIG)
    l_s = tl.load(ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    acc = tl.load(acc_ptr + part[:, None] * DV + dv[None, :], mask=s_mask[:, None] & (dv[None, :] < DV), other=0.0)
    w = tl.exp2(m - tl.max(m, 0))
    total = tl.sum(w * l_s, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    row = tl.load(qsl_ptr + seq).to(tl.int64)
    tl.store(o_ptr + row * stride_ot + head * stride_oh + dv, out.to(o_ptr.dtype.element_ty), mask=dv < DV)


def decode_span(block_tables: torch.Tensor, page: int, window: int = 0) -> int:
    """The most key positions one sequence's decode reads: its table's span, or under a window the window
    (the split kernel's runs start at the window's first key)."""
    span = block_tables.shape[1] * page
    return min(span, window) if window else span


def split_plan(max_len: int, block_n: int, num_splits: int | None = None, target: int = 512) -> tuple[int, int]:
    """(num_splits, chunk): runs of `target` positions by default (at most 32 of them), each a multiple of
    block_n; chunk * num_splits covers max_len."""
    if num_splits is None:
        num_splits = min(32, max(1, triton.cdiv(max_len, target)))
    chunk = triton.cdiv(triton.cdiv(max(max_len, 1), num_splits), block_n) * block_n
    return triton.cdiv(max(max_len, 1), chunk), chunk


def paged_split_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                 out=None, *, num_splits: int | None = None, block_n: int | None = None,
                                 num_warps: int | None = None, num_stages: int | None = None, window: int = 0,
                                 softcap: float = 0.0):
    """paged_attention for a pure decode step (T == S), the KV length split across programs; arguments and
    result as pagedserve.kernels.triton.paged_attention.paged_decode_attention."""
    out = _check(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    num_seqs, heads = seq_lens.shape[0], query.shape[1]
    assert query.shape[0] == num_seqs, "decode: one new token per sequence"
    if num_seqs == 0:
        return out
    consts = _constexprs(query, k_cache, v_cache)
    p = launch_params("split decode", query, k_cache, v_cache, block_n=block_n, num_warps=num_warps,
                      num_stages=num_stages)
    splits, chunk = split_plan(decode_span(block_tables, k_cache.shape[1], window), p["block_n"], num_splits)
    dv = v_cache.shape[-1]
    acc = torch.empty(num_seqs, splits, heads, dv, dtype=torch.float32, device=query.device)
    ml = torch.empty(num_seqs, splits, heads, 2, dtype=torch.float32, device=query.device)
    _split_kernel[(num_seqs, k_cache.shape[2], splits)](
        query, k_cache, v_cache, acc, ml, block_tables, seq_lens, query_start_loc, *layer_args(scale, window, softcap),
        *_common_args(query, k_cache, v_cache, out, block_tables), chunk, splits, heads,
        BLOCK_H=pow2_tile(consts["GROUP"]), BLOCK_N=p["block_n"], num_warps=p["num_warps"],
        num_stages=p["num_stages"], **consts, **layer_constexprs(window, softcap))
    _combine_kernel[(num_seqs, heads)](acc, ml, out, query_start_loc, splits, heads, out.stride(0), out.stride(1),
                                       DV=dv, BLOCK_S=max(2, next_pow2(splits)),
                                       BLOCK_DV=consts["BLOCK_DV"])
    return out
