"""Paged attention in Triton: a decode kernel (one new token per sequence) and a prefill/mixed kernel
(any number of new tokens per sequence, causal), behind paged_attention(). The torch reference with the
same contract is pagedserve.kernels.reference.paged_attention.

Both kernels walk a sequence's keys in tiles of BLOCK_N positions; each position is looked up through
the block table on its own, so BLOCK_N and the cache's block size are independent. Keys load as
[BLOCK_N, BLOCK_D] rows (contiguous along the head dim) and enter tl.dot through tl.trans, as the MLA
kernel and FlashAttention's Triton kernels do: the earlier load of K transposed through its pointers
gave wrong float16 results on an H200 at head dim 40 with GQA, where the MLA kernel, loading as here,
was right. Every address a kernel forms stays inside its tensor even in masked-off lanes (rows past a
sequence's queries, key positions past its length), so a mask the compiler mishandles cannot fault. Softmax is online
(running max and sum, rescaling the accumulator), in the log2 domain, in float32.

Two options of the layers that have them, each a compile-time switch (no cost where off): a sliding window of
`window` keys (a query at position p sees keys p - window + 1 .. p, Gemma's and Cohere 2's local layers; the loops
start at the window's first key, so blocks wholly before it, which the block manager may have released, are never
read) and Gemma 2's soft-capping of the scaled scores (cap * tanh(score / cap), before the mask)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton import dot_precision, is_interpreted, pow2_tile, step_tiles
from pagedserve.kernels.triton.tuning import dtype_name, resolve

LOG2E = 1.4426950408889634
# Running max of a row that has seen only masked keys: finite, so exp2(m_old - m_new) never
# computes -inf - -inf = NaN, and far below any real score.
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def paged_offsets(table_row_ptr, pos, mask, PAGE: tl.constexpr, stride_block, stride_slot):
    """Element offsets (int64) of cache positions `pos` of one sequence, through its block table row."""
    pos = tl.where(mask, pos, 0)  # masked positions read slot 0 of block 0: in range whatever the mask
    block = tl.load(table_row_ptr + pos // PAGE, mask=mask, other=0).to(tl.int64)
    return block * stride_block + (pos % PAGE).to(tl.int64) * stride_slot


@triton.jit
def log2_scores(qk, qk_scale, softcap, SOFTCAP: tl.constexpr):
    """Scores in the log2 domain from the raw dot products qk: qk * qk_scale, or soft-capped, where score_args
    made qk_scale = scale / cap and softcap = cap * log2(e): cap * tanh(qk * scale / cap) * log2(e), with
    tanh(x) = 1 - 2 / (e^2x + 1) (exact at both ends: e^2x overflows to inf, or reaches 0)."""
    s = qk * qk_scale
    if SOFTCAP:
        s = softcap * (1.0 - 2.0 / (tl.exp2(s * 2.8853900817779268) + 1.0))
    return s


def score_args(scale: float, softcap: float) -> tuple[float, float]:
    """(qk_scale, softcap) as the kernels take them (log2_scores)."""
    if softcap:
        return scale / softcap, softcap * LOG2E
    return scale * LOG2E, 0.0


@triton.jit
def online_softmax_step(s, m_i, l_i):
    """One tile of online softmax over log2-domain scores s [M, N] (masked keys at -inf): returns the
    tile's unnormalized probabilities, the factor to rescale the accumulator by, and the new max/sum."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit(do_not_specialize=["stride_table"])
def _decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, seq_lens_ptr, qsl_ptr, qk_scale, softcap, window,
                   stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                   stride_ot, stride_oh, stride_table,
                   GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   PRECISION: tl.constexpr, SINGLES_ONLY: tl.constexpr, SOFTCAP: tl.constexpr,
                   WINDOWED: tl.constexpr):
    """Program (sequence, kv head): the GROUP query heads sharing that kv head, as the M rows of one
    tile padded to BLOCK_H >= 16, attend to the whole sequence (a decode token sees every cached key; with
    a window, the last `window` of them).
    SINGLES_ONLY (a mixed step: paged_mixed_attention): a sequence whose step has other than exactly one
    query is left to the prefill kernel."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    row = tl.load(qsl_ptr + seq).to(tl.int64)
    if SINGLES_ONLY:
        if tl.load(qsl_ptr + seq + 1) - row != 1:
            return
    hh = tl.arange(0, BLOCK_H)
    h_mask = hh < GROUP
    heads = kv_head * GROUP + hh
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=h_mask[:, None] & (d[None, :] < D), other=0.0)
    table_row = tables_ptr + seq.to(tl.int64) * stride_table
    m_i = tl.full([BLOCK_H], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    lo = 0
    if WINDOWED:  # the decoded token sits at seq_len - 1
        lo = tl.maximum(seq_len - window, 0)
    for start in range(lo, seq_len, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        n_mask = pos < seq_len
        k_off = paged_offsets(table_row, pos, n_mask, PAGE, stride_kb, stride_ks) + kv_head * stride_kh
        k = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=n_mask[:, None] & (d[None, :] < D), other=0.0)
        s = log2_scores(tl.dot(q, tl.trans(k), input_precision=PRECISION), qk_scale, softcap, SOFTCAP)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
        v_off = paged_offsets(table_row, pos, n_mask, PAGE, stride_vb, stride_vs) + kv_head * stride_vh
        v = tl.load(v_ptr + v_off[:, None] + dv[None, :], mask=n_mask[:, None] & (dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + row * stride_ot + heads[:, None] * stride_oh + dv[None, :],
             acc.to(o_ptr.dtype.element_ty), mask=h_mask[:, None] & (dv[None, :] < DV))


@triton.jit(do_not_specialize=["stride_table"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, seq_lens_ptr, qsl_ptr, tile_seq_ptr, tile_start_ptr,
                    limits_ptr, qk_scale, softcap, window, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                    stride_vb, stride_vs, stride_vh,
                    stride_ot, stride_oh, stride_table,
                    GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                    PRECISION: tl.constexpr, CAUSAL_SPLIT: tl.constexpr, SOFTCAP: tl.constexpr,
                    WINDOWED: tl.constexpr, KEY_LIMITS: tl.constexpr):
    """Program (head, query tile): BLOCK_M consecutive new tokens of one sequence attend causally.
    Query i of a sequence with q_len new tokens sits at position seq_len - q_len + i. CAUSAL_SPLIT: the key
    tiles every row sees whole run in a loop without masks first (a launch parameter: the tuner says
    whether it pays on a GPU; float32 spills with it on Hopper; never with a window, where no tile is whole).
    WINDOWED: query p also sees no key before p - window + 1; the keys start at the tile's first row's first.
    KEY_LIMITS (bidirectional blocks, Gemma 3's images): query row t sees keys up to position limits[t] (its
    own, or past it to its block's last, which this step computes) instead of its own; a window still counts
    from the query's position."""
    head = tl.program_id(0)
    tile = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    if seq < 0:  # surplus tile of the upper-bound grid
        return
    m0 = tl.load(tile_start_ptr + tile)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len
    rows = m0 + tl.arange(0, BLOCK_M)
    r_mask = rows < q_len
    # rows past the sequence's queries point at its first row: every address stays inside the
    # tensors even where a mask is off (a decode step gives a 64-row tile one real row)
    q_rows = (q_start + tl.where(r_mask, rows, 0)).to(tl.int64)
    q_pos = context + rows
    kv_head = head // GROUP
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=r_mask[:, None] & (d[None, :] < D), other=0.0)
    table_row = tables_ptr + seq.to(tl.int64) * stride_table
    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # the tile's last query sees keys up to context + m0 + BLOCK_M - 1 (or its rows' furthest limit): stop there
    end = tl.minimum(seq_len, context + m0 + BLOCK_M)
    last = q_pos
    if KEY_LIMITS:
        last = tl.maximum(tl.load(limits_ptr + q_rows, mask=r_mask, other=0).to(tl.int32), q_pos)
        end = tl.minimum(seq_len, tl.maximum(end, tl.max(tl.where(r_mask, last, 0), 0) + 1))
    first = 0
    if WINDOWED:
        first = tl.maximum(context + m0 - window + 1, 0)
    if CAUSAL_SPLIT and not WINDOWED:
        # FlashAttention-2's split: every row of the tile sees every key before context + m0 + 1 (its first
        # row's own position; rows past the queries are never stored), so whole key tiles there need no
        # mask at all; the masked loop below starts where they end
        first = (context + m0 + 1) // BLOCK_N * BLOCK_N
        for start in range(0, first, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            block = tl.load(table_row + pos // PAGE).to(tl.int64)
            slot = (pos % PAGE).to(tl.int64)
            k = tl.load(k_ptr + (block * stride_kb + slot * stride_ks + kv_head * stride_kh)[:, None] + d[None, :],
                        mask=d[None, :] < D, other=0.0)
            s = log2_scores(tl.dot(q, tl.trans(k), input_precision=PRECISION), qk_scale, softcap, SOFTCAP)
            p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
            v = tl.load(v_ptr + (block * stride_vb + slot * stride_vs + kv_head * stride_vh)[:, None] + dv[None, :],
                        mask=dv[None, :] < DV, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    for start in range(first, end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        n_mask = pos < end
        k_off = paged_offsets(table_row, pos, n_mask, PAGE, stride_kb, stride_ks) + kv_head * stride_kh
        k = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=n_mask[:, None] & (d[None, :] < D), other=0.0)
        s = log2_scores(tl.dot(q, tl.trans(k), input_precision=PRECISION), qk_scale, softcap, SOFTCAP)
        seen = n_mask[None, :] & (pos[None, :] <= last[:, None])
        if WINDOWED:
            seen = seen & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
        v_off = paged_offsets(table_row, pos, n_mask, PAGE, stride_vb, stride_vs) + kv_head * stride_vh
        v = tl.load(v_ptr + v_off[:, None] + dv[None, :], mask=n_mask[:, None] & (dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + q_rows[:, None] * stride_ot + head * stride_oh + dv[None, :],
             acc.to(o_ptr.dtype.element_ty), mask=r_mask[:, None] & (dv[None, :] < DV))


def _check(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out):
    """Validate the shared contract; returns the output buffer [T, H, Dv]."""
    num_tokens, heads, dim = query.shape
    assert k_cache.shape[:3] == v_cache.shape[:3] and k_cache.shape[-1] == dim
    assert heads % k_cache.shape[2] == 0, "query heads must be a multiple of kv heads"
    assert query.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1, "head dim must be contiguous"
    assert block_tables.stride(-1) == 1 and seq_lens.shape[0] == block_tables.shape[0] == query_start_loc.shape[0] - 1
    if out is None:
        out = torch.empty(num_tokens, heads, v_cache.shape[-1], dtype=query.dtype, device=query.device)
    assert out.shape == (num_tokens, heads, v_cache.shape[-1]) and out.stride(-1) == 1
    return out


def _tiles(query: torch.Tensor) -> int:
    """Default BLOCK_M = BLOCK_N: 16 under the interpreter (speed), 64 for 16-bit inputs on a GPU, and 32
    for float32 there (64 x 64 float32 tiles with head dim 128 spill registers on Hopper)."""
    if is_interpreted(query):
        return 16
    return 64 if query.element_size() <= 2 else 32


def attention_key(query, k_cache, v_cache) -> str:
    """What a paged attention kernel's tiles depend on besides the batch (tuning.py's shape key)."""
    return (f"{dtype_name(query.dtype)} G={query.shape[1] // k_cache.shape[2]} D={query.shape[2]} "
            f"DV={v_cache.shape[-1]} page={k_cache.shape[1]}")


def launch_params(kernel, query, k_cache, v_cache, **given) -> dict:
    """A paged attention kernel's tiles, warps and stages: the caller's > the device's table > defaults."""
    tile = _tiles(query)
    default = dict(block_m=tile, block_n=tile, num_warps=4, num_stages=3)
    if kernel == "prefill":
        default["causal_split"] = 0
    return resolve(kernel, attention_key(query, k_cache, v_cache), query.device, default, given)


def _common_args(query, k_cache, v_cache, out, block_tables):
    return (query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
            block_tables.stride(0))


def layer_args(scale: float, window: int, softcap: float) -> tuple[float, float, int]:
    """(qk_scale, softcap, window): the kernels' runtime arguments for a layer's scale and options."""
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: none), got {window}")
    return (*score_args(scale, softcap), int(window))


def layer_constexprs(window: int, softcap: float) -> dict:
    """The kernels' switches for a layer's options (each compiled in only where on)."""
    return dict(SOFTCAP=bool(softcap), WINDOWED=bool(window))


def _constexprs(query, k_cache, v_cache):
    heads, dim = query.shape[1:]
    dv = v_cache.shape[-1]
    return dict(GROUP=heads // k_cache.shape[2], D=dim, DV=dv, PAGE=k_cache.shape[1],
                BLOCK_D=pow2_tile(dim), BLOCK_DV=pow2_tile(dv), PRECISION=dot_precision(query.dtype))


def paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=None,
                           *, block_n: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, window: int = 0, softcap: float = 0.0):
    """paged_attention (see pagedserve.kernels.reference) for a pure decode step: every sequence has exactly one
    new token, so T == S. Grid (S, KVH); each program handles the kv head's whole GQA group."""
    out = _check(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    num_seqs, kv_heads = seq_lens.shape[0], k_cache.shape[2]
    assert query.shape[0] == num_seqs, "decode: one new token per sequence"
    if num_seqs == 0:
        return out
    consts = _constexprs(query, k_cache, v_cache)
    p = launch_params("decode", query, k_cache, v_cache, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    _decode_kernel[(num_seqs, kv_heads)](
        query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, *layer_args(scale, window, softcap),
        *_common_args(query, k_cache, v_cache, out, block_tables),
        BLOCK_H=pow2_tile(consts["GROUP"]), BLOCK_N=p["block_n"], num_warps=p["num_warps"],
        num_stages=p["num_stages"], SINGLES_ONLY=False, **consts, **layer_constexprs(window, softcap))
    return out


def paged_prefill_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=None,
                            *, block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                            num_stages: int | None = None, causal_split: int | None = None,
                            step_cache: dict | None = None, skip_singles: bool = False, window: int = 0,
                            softcap: float = 0.0, key_limits: torch.Tensor | None = None):
    """paged_attention (see pagedserve.kernels.reference) for any step, decode and prefill tokens mixed, causal.
    Grid (H, query tiles): tiles of block_m rows never straddle two sequences (tile_map, once a step given
    the step's `step_cache`: step_tiles). skip_singles: sequences with exactly one query get no tile (the
    decode kernel takes them: paged_mixed_attention). A window turns the causal split off. key_limits (int64
    [T], None: causal): the last key position each query row sees (AttentionMetadata.key_limits)."""
    out = _check(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    num_tokens, heads = query.shape[:2]
    if num_tokens == 0:
        return out
    p = launch_params("prefill", query, k_cache, v_cache, block_m=block_m, block_n=block_n, num_warps=num_warps,
                      num_stages=num_stages, causal_split=causal_split)
    tile_seq, tile_start, num_tiles = step_tiles(step_cache, query_start_loc, num_tokens, p["block_m"], skip_singles)
    _prefill_kernel[(heads, num_tiles)](
        query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, tile_seq, tile_start,
        seq_lens if key_limits is None else key_limits,
        *layer_args(scale, window, softcap), *_common_args(query, k_cache, v_cache, out, block_tables),
        BLOCK_M=p["block_m"], BLOCK_N=p["block_n"], num_warps=p["num_warps"], num_stages=p["num_stages"],
        CAUSAL_SPLIT=bool(p["causal_split"]) and not window, **_constexprs(query, k_cache, v_cache),
        **layer_constexprs(window, softcap), KEY_LIMITS=key_limits is not None)
    return out


def paged_mixed_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=None, *,
                          step_cache: dict | None = None, window: int = 0, softcap: float = 0.0,
                          key_limits: torch.Tensor | None = None):
    """paged_attention (see pagedserve.kernels.reference) for a step of decodes beside prefill chunks, in two
    launches that split its sequences by their number of queries on the device: the decode kernel over every
    sequence (grid (S, KVH); a program whose sequence has other than one query returns at once) and the
    prefill kernel over the tiles of the others. A decode row then costs what it costs in a pure decode
    step (the kv head's GROUP query heads in one program: its keys read once), where the prefill kernel
    alone gives it a block_m-row tile per query head, one row of it real. Shapes alone decide both
    launches: a mixed-step graph captures them whatever the step's split. key_limits go to the prefill
    kernel (a one-query sequence never sees past itself)."""
    out = _check(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    num_seqs, kv_heads = seq_lens.shape[0], k_cache.shape[2]
    if query.shape[0] == 0:
        return out
    consts = _constexprs(query, k_cache, v_cache)
    p = launch_params("decode", query, k_cache, v_cache)
    _decode_kernel[(num_seqs, kv_heads)](
        query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, *layer_args(scale, window, softcap),
        *_common_args(query, k_cache, v_cache, out, block_tables),
        BLOCK_H=pow2_tile(consts["GROUP"]), BLOCK_N=p["block_n"], num_warps=p["num_warps"],
        num_stages=p["num_stages"], SINGLES_ONLY=True, **consts, **layer_constexprs(window, softcap))
    return paged_prefill_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
                                   step_cache=step_cache, skip_singles=True, window=window, softcap=softcap,
                                   key_limits=key_limits)


def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=None, *,
                    step_cache: dict | None = None, window: int = 0, softcap: float = 0.0):
    """Causal attention of a step's tokens over the paged KV cache; contract in
    pagedserve.kernels.reference.paged_attention.

    Every sequence must have at least one new token; then T == S means a pure decode step, which takes
    the decode kernel (decided from shapes alone: no device sync)."""
    if query.shape[0] == seq_lens.shape[0]:
        return paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
                                      window=window, softcap=softcap)
    return paged_prefill_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
                                   step_cache=step_cache, window=window, softcap=softcap)
