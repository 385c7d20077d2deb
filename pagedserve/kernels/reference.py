"""Plain torch references of the Triton kernels in pagedserve/kernels/triton: the same signatures, written for
clarity rather than speed (Python loops over sequences and experts are fine here). They define what
the kernels must compute; tests compare the kernels against them and them against naive dense code.

Imports only torch, so the references run wherever torch does."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _gather_paged(cache: torch.Tensor, block_table: torch.Tensor, length: int, first: int = 0) -> torch.Tensor:
    """Tokens first..length - 1 of one sequence from a paged cache [num_blocks, block_size, KVH, D]
    through its block table row: [length - first, KVH, D]."""
    block_size = cache.shape[1]
    pos = torch.arange(first, length, device=cache.device)
    return cache[block_table[pos // block_size].long(), pos % block_size]


def _causal_allowed(seq_len: int, q_len: int, device, window: int = 0, first: int = 0) -> torch.Tensor:
    """[q_len, seq_len - first] bool over keys first..seq_len - 1: the step's i-th new token sits at
    seq_len - q_len + i and sees 0..itself, or with a window only its last `window` keys."""
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
    keys = torch.arange(first, seq_len, device=device)[None, :]
    allowed = keys <= q_pos[:, None]
    if window:
        allowed &= keys > q_pos[:, None] - window
    return allowed


def _sequences(seq_lens: torch.Tensor, query_start_loc: torch.Tensor):
    """Yield (s, first query row, q_len, seq_len) for each sequence with at least one new token."""
    lens, starts = seq_lens.tolist(), query_start_loc.tolist()
    for s, seq_len in enumerate(lens):
        q_len = starts[s + 1] - starts[s]
        if q_len > 0:
            yield s, starts[s], q_len, seq_len


def _out_buffer(out, shape, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    assert tuple(out.shape) == tuple(shape), (out.shape, shape)
    return out


def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=None, *,
                    window: int = 0, softcap: float = 0.0):
    """Causal attention of the step's tokens over a paged KV cache.

    query [T, H, D]; k_cache [num_blocks, block_size, KVH, D]; v_cache [num_blocks, block_size, KVH, Dv];
    block_tables [S, max_blocks] int32; seq_lens [S] int32 (cached tokens after this step, the step's
    own K/V already written); query_start_loc [S+1] int32 (sequence s owns query rows
    query_start_loc[s]:query_start_loc[s+1]); H % KVH == 0 and head h reads kv head h // (H // KVH).
    Returns [T, H, Dv] in query's dtype (written into `out` when given); softmax in float32.
    window > 0: the token at position p sees keys p - window + 1 .. p only (table entries before the step's
    first query's window are never read); softcap > 0: scaled scores become softcap * tanh(score / softcap).
    """
    num_tokens, heads, _ = query.shape
    group = heads // k_cache.shape[2]
    out = _out_buffer(out, (num_tokens, heads, v_cache.shape[-1]), query)
    for s, start, q_len, seq_len in _sequences(seq_lens, query_start_loc):
        first = max(0, seq_len - q_len - window + 1) if window else 0
        k = _gather_paged(k_cache, block_tables[s], seq_len, first).float().repeat_interleave(group, dim=1)
        v = _gather_paged(v_cache, block_tables[s], seq_len, first).float().repeat_interleave(group, dim=1)
        q = query[start:start + q_len].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~_causal_allowed(seq_len, q_len, query.device, window, first), float("-inf"))
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(out.dtype)
    return out


def paged_mla_attention(q_latent, q_rope, latent_cache, block_tables, seq_lens, query_start_loc, scale,
                        kv_lora_rank, out=None):
    """Multi-head latent attention, absorbed form, over a paged compressed cache.

    q_latent [T, H, L] (the query already projected into the latent space), q_rope [T, H, R];
    latent_cache [num_blocks, block_size, 1, L + R]: per token the latent c_kv (first L = kv_lora_rank
    values) then the rotated k_pe (last R). score = (q_latent . c_kv + q_rope . k_pe) * scale, causal
    as in paged_attention; the values are c_kv itself. Returns [T, H, L] in q_latent's dtype.
    """
    num_tokens, heads, rank = q_latent.shape
    assert rank == kv_lora_rank
    out = _out_buffer(out, (num_tokens, heads, rank), q_latent)
    for s, start, q_len, seq_len in _sequences(seq_lens, query_start_loc):
        latent = _gather_paged(latent_cache, block_tables[s], seq_len)[:, 0].float()
        c_kv, k_pe = latent[:, :rank], latent[:, rank:]
        q_lat, q_pe = q_latent[start:start + q_len].float(), q_rope[start:start + q_len].float()
        scores = (torch.einsum("qhl,kl->hqk", q_lat, c_kv) + torch.einsum("qhr,kr->hqk", q_pe, k_pe)) * scale
        scores = scores.masked_fill(~_causal_allowed(seq_len, q_len, q_latent.device), float("-inf"))
        out[start:start + q_len] = torch.einsum("hqk,kl->qhl", scores.softmax(-1), c_kv).to(out.dtype)
    return out


def fused_moe(hidden, w13, w2, topk_weights, topk_ids, out=None):
    """Mixture of SiLU-gated experts.

    hidden [T, Hd]; w13 [E, 2I, Hd] (rows 0:I gate, I:2I up; y = x @ w.T); w2 [E, Hd, I];
    topk_weights [T, k] float; topk_ids [T, k] int. An id outside 0..E-1 (-1, or >= E: an expert that
    lives on another expert-parallel rank) contributes nothing. out[t] = sum_j topk_weights[t, j] *
    w2[e] @ (silu(w13[e, :I] @ x) * (w13[e, I:] @ x)) with e = topk_ids[t, j]; float32 accumulation,
    returns [T, Hd] in hidden's dtype.
    """
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    acc = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    x = hidden.float()
    for e in range(num_experts):
        tokens, slots = (topk_ids == e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up = x[tokens] @ w13[e].float().T
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = (act @ w2[e].float().T) * topk_weights[tokens, slots].float()[:, None]
        acc.index_add_(0, tokens, y)
    out = _out_buffer(out, hidden.shape, hidden)
    return out.copy_(acc)


# ---- the fused elementwise ops (pagedserve/kernels/triton/fused_ops.py) -----------------------------
def rms_norm(x, weight, eps, residual=None, *, gemma=False):
    """As the models compute it: with residual, residual += x (in place, its dtype) and the sum is
    normalized; x / rms(x) in float32, cast, times the weight (gemma: times (1 + w) in float32, then cast)."""
    if residual is not None:
        residual.add_(x)
        x = residual
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def rotary_inplace(q, k, cos_table, sin_table, positions, rotary_dim=None):
    """NeoX rotary on the first rotary_dim values of each head of q [T, Hq, D] and k [T, Hk, D], in place,
    from float32 tables [max_positions, rotary_dim] indexed by positions [T]."""
    rot = rotary_dim or q.shape[-1]
    half = rot // 2
    cos, sin = cos_table[positions, :half].unsqueeze(1), sin_table[positions, :half].unsqueeze(1)
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half:rot].float()
        x[..., :half], x[..., half:rot] = (x1 * cos - x2 * sin).to(x.dtype), (x2 * cos + x1 * sin).to(x.dtype)


def act_and_mul(x, activation="silu"):
    """x [T, 2I] -> act(x[:, :I]) * x[:, I:] in float32, cast to x's dtype; act silu or gelu (tanh)."""
    gate, up = x.float().chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return (act * up).to(x.dtype)


def write_kv_cache(key, value, k_cache, v_cache, slot_mapping):
    """key [T, KVH, D] / value [T, KVH, Dv] into the paged caches at flat slots; slots < 0 write nothing."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *key.shape[1:]).index_copy_(0, slots, key[keep].to(k_cache.dtype))
    v_cache.view(-1, *value.shape[1:]).index_copy_(0, slots, value[keep].to(v_cache.dtype))


# ---- top_p's nucleus (pagedserve/kernels/triton/nucleus.py) -----------------------------------------
def top_p_nucleus(x, rows, top_p):
    """A copy of x whose rows `rows` keep their smallest most-likely prefix reaching top_p (by a sort of
    each row, as worker/truncation.py's sort does), the other tokens -inf."""
    out = x.clone()
    sub = out[rows]
    ordered, order = sub.sort(dim=-1, descending=True)
    probs = ordered.float().softmax(-1)
    gone_sorted = probs.cumsum(-1) - probs >= top_p[:, None]
    out[rows] = sub.masked_fill(torch.zeros_like(gone_sorted).scatter(1, order, gone_sorted), float("-inf"))
    return out


def int4_weight(qweight, scales, offsets):
    """The [N, K] float32 weight of int4_linear's layout: qweight int32 [K / 8, N] (input k at bits 4 * (k % 8)
    of word k // 8), W[n, k] = q * scales[k // group, n] + offsets[k // group, n]."""
    shifts = torch.arange(8, device=qweight.device, dtype=torch.int32) * 4
    q = ((qweight.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF).reshape(-1, qweight.shape[1])  # [K, N]
    group = q.shape[0] // scales.shape[0]
    scale = scales.float().repeat_interleave(group, 0)
    offset = offsets.float().repeat_interleave(group, 0)
    return (q.float() * scale + offset).t()


def int4_linear(x, qweight, scales, offsets, out_dtype=None):
    """x [M, K] @ W.T, W as int4_weight reads it, cast to x's dtype, products summed in float32."""
    w = int4_weight(qweight, scales, offsets).to(x.dtype)
    return (x.float() @ w.float().t()).to(out_dtype or x.dtype)
