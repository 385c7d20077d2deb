"""Fused mixture of SiLU-gated experts in Triton; the torch reference with the same contract is
pagedserve.kernels.reference.fused_moe.

The T*k (token, slot) pairs are sorted by expert and each expert's group padded to a multiple of
BLOCK_M (moe_align_block_size), so one grouped-GEMM launch covers every expert: a program takes one
M-block (all one expert's) x one N tile and gathers its input rows through the sorted pair ids.
Pipeline: gate/up GEMM -> silu(gate) * up -> down GEMM scaled by the routing weight -> sum over slots.

Expert parallelism: an id outside 0..E-1 (-1, or >= E for an expert owned by another rank) is left
out of the sort, so its pair computes nothing and adds zero; the ranks' outputs are summed later."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton import dot_precision, is_interpreted, next_pow2
from pagedserve.kernels.triton.tuning import dtype_name, resolve


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """Group the flattened (token, slot) pairs of topk_ids [T, k] by expert, in torch ops (no host sync).

    Returns:
      sorted_token_ids int32 [P]: flat pair ids (t * k + j), each expert's run padded to a multiple of
        block_m with the sentinel T * k; P = the upper bound T*k + E*(block_m - 1) rounded up to block_m,
        tail beyond the real total also sentinel.
      expert_ids int32 [P // block_m]: the expert of each M-block, -1 past the real total.
      num_tokens_post_padded int32 [1]: the real padded total (a multiple of block_m).
    Pairs whose id is outside 0..num_experts-1 appear nowhere."""
    flat = topk_ids.reshape(-1).long()
    num_pairs, device = flat.numel(), flat.device
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts)  # invalid pairs sort last and are dropped
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    unpadded_start = torch.cumsum(counts, 0) - counts
    # the i-th sorted pair of expert e lands at padded_start[e] + (i - unpadded_start[e])
    sorted_key = key[order]
    e = sorted_key.clamp(max=num_experts - 1)
    dest = padded_start[e] + torch.arange(num_pairs, device=device) - unpadded_start[e]
    dest = torch.where(sorted_key < num_experts, dest, -1)
    capacity = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((capacity + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[dest.masked_fill(dest < 0, capacity)] = order.to(torch.int32)  # dropped pairs hit the spare slot
    block_start = torch.arange(0, capacity, block_m, device=device)
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    total = padded_end[-1:].to(torch.int32) if num_experts else torch.zeros(1, dtype=torch.int32, device=device)
    return sorted_ids[:capacity], expert_ids, total


@triton.jit(do_not_specialize=["num_pairs", "capacity"])
def _align_plan_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, total_ptr, cursor_ptr, num_pairs, num_experts, capacity,
                       BLOCK_M: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr, EBLOCK: tl.constexpr):
    """One program: count each expert's pairs, pad each count to a multiple of BLOCK_M, and from their running
    sum write the padded total, each M-block's expert (-1 past the total), each expert's first place into
    cursor_ptr (where _align_scatter_kernel starts), and the sentinel num_pairs over all of sorted_ptr.
    Ids outside 0..num_experts-1 (and lanes past the pairs) count in bin BINS - 1, which is no expert's."""
    bins = tl.arange(0, BINS)
    counts = tl.zeros([BINS], tl.int32)
    for start in range(0, num_pairs, CHUNK):
        i = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + i, mask=i < num_pairs, other=-1)
        counts += tl.histogram(tl.where((e >= 0) & (e < num_experts), e, BINS - 1), BINS)
    counts = tl.where(bins < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    total = tl.sum(padded, 0)
    tl.store(total_ptr, total)
    tl.store(cursor_ptr + bins, ends - padded)
    for b0 in range(0, capacity // BLOCK_M, EBLOCK):
        b = b0 + tl.arange(0, EBLOCK)
        first = b * BLOCK_M  # the block's expert: how many experts' padded runs end at or before its first row
        expert = tl.sum(((ends[None, :] <= first[:, None]) & (bins[None, :] < num_experts)).to(tl.int32), 1)
        tl.store(expert_ids_ptr + b, tl.where(first < total, expert, -1), mask=b < capacity // BLOCK_M)
    for c0 in range(0, capacity, CHUNK):
        c = c0 + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + c, tl.full([CHUNK], 0, tl.int32) + num_pairs, mask=c < capacity)


@triton.jit(do_not_specialize=["num_pairs"])
def _align_scatter_kernel(ids_ptr, sorted_ptr, cursor_ptr, num_pairs, num_experts, CHUNK: tl.constexpr):
    """Program per CHUNK pairs: each valid pair takes the next place of its expert's padded run (an atomic
    add on the expert's cursor) and writes its flat id there. The order of pairs within an expert's run
    depends on timing; nothing downstream depends on it (every row of a grouped GEMM is computed alone,
    and each pair's result goes back to its own row)."""
    i = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + i, mask=i < num_pairs, other=-1)
    valid = (i < num_pairs) & (e >= 0) & (e < num_experts)
    place = tl.atomic_add(cursor_ptr + tl.where(valid, e, 0), 1, mask=valid)
    tl.store(sorted_ptr + place, i, mask=valid)


def moe_align_launches(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """moe_align_block_size's result in two launches (vLLM and SGLang align in one CUDA kernel of their
    own for the same reason: the torch ops are ~30 small launches a MoE layer). The same total and
    expert of each block, and each expert's run holds the same pairs and padding; within a run the
    pairs' order may differ from the torch version's ascending one."""
    ids = topk_ids.reshape(-1).to(torch.int32)
    num_pairs, device = ids.numel(), ids.device
    if num_pairs == 0:
        return moe_align_block_size(topk_ids, block_m, num_experts)
    capacity = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    sorted_ids = torch.empty(capacity, dtype=torch.int32, device=device)
    expert_ids = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    total = torch.empty(1, dtype=torch.int32, device=device)
    bins = next_pow2(num_experts + 1)
    cursor = torch.empty(bins, dtype=torch.int32, device=device)
    _align_plan_kernel[(1,)](ids, sorted_ids, expert_ids, total, cursor, num_pairs, num_experts, capacity,
                             BLOCK_M=block_m, BINS=bins, CHUNK=1024, EBLOCK=max(16, 4096 // bins))
    _align_scatter_kernel[(triton.cdiv(num_pairs, 1024),)](ids, sorted_ids, cursor, num_pairs, num_experts,
                                                           CHUNK=1024)
    return sorted_ids, expert_ids, total


@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr,
                         N, K, num_pairs, stride_am, stride_be, stride_bn, stride_cm,
                         A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """C[pair, n] = sum_k A[pair // A_ROW_DIV, k] * B[expert, n, k] (* weights[pair] if MUL_WEIGHT) for
    the BLOCK_M pairs of M-block program_id(0) and the N tile program_id(1). B holds torch Linear
    weights [E, N, K] (y = x @ w.T). Sentinel pairs (>= num_pairs) are masked out of loads and stores."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = pair < num_pairs
    a_rows = (pair // A_ROW_DIV).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    b_base = b_ptr + expert * stride_be + n.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        b = tl.load(b_base + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pair, mask=m_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + pair.to(tl.int64)[:, None] * stride_cm + n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_rows"])
def _silu_and_mul_kernel(x_ptr, o_ptr, rows_ptr, num_rows, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    """o[row, i] = silu(x[row, i]) * x[row, inter + i] in float32, for row = rows[program_id(0)]; rows
    >= num_rows (sentinels) are skipped, so rows no GEMM wrote are never read."""
    row = tl.load(rows_ptr + tl.program_id(0))
    if row >= num_rows:
        return
    row = row.to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * stride_o + cols, (gate * tl.sigmoid(gate) * up).to(o_ptr.dtype.element_ty), mask=mask)


def _grouped_gemm(a, b, c, weights, align, a_row_div: int, p: dict):
    """Launch _grouped_gemm_kernel once over all experts: c [P, N] from a and b [E, N, K]."""
    sorted_ids, expert_ids, total = align
    num_experts, n, k = b.shape
    grid = (expert_ids.shape[0], triton.cdiv(n, p["block_n"]))
    _grouped_gemm_kernel[grid](
        a, b, c, weights if weights is not None else c, sorted_ids, expert_ids, total,
        n, k, c.shape[0], a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        A_ROW_DIV=a_row_div, MUL_WEIGHT=weights is not None, BLOCK_M=p["block_m"], BLOCK_N=p["block_n"],
        BLOCK_K=p["block_k"], PRECISION=dot_precision(a.dtype), num_warps=p["num_warps"], num_stages=p["num_stages"])


def silu_and_mul(x: torch.Tensor, rows: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [P, 2I] -> silu(x[:, :I]) * x[:, I:] as [P, I] in x's dtype (float32 math). With rows (int32
    row ids, entries >= P ignored) only those rows are computed; the others of the result are undefined."""
    num_rows, inter = x.shape[0], x.shape[1] // 2
    assert x.stride(-1) == 1
    out = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device) if out is None else out
    if rows is None:
        rows = torch.arange(num_rows, dtype=torch.int32, device=x.device)
    if rows.numel():
        block = min(1024, next_pow2(inter))
        _silu_and_mul_kernel[(rows.numel(), triton.cdiv(inter, block))](
            x, out, rows, num_rows, inter, x.stride(0), out.stride(0), BLOCK=block)
    return out


def moe_key(hidden, w13, top_k: int) -> str:
    """What the grouped GEMMs' tiles depend on besides the token count (tuning.py's shape key; the table
    keys token counts as "<key> M=<n>")."""
    return f"{dtype_name(hidden.dtype)} E={w13.shape[0]} N={w13.shape[1]} K={w13.shape[2]} k={top_k}"


def launch_params(hidden, w13, top_k: int, **given) -> dict:
    """Both grouped GEMMs' tiles, warps and stages: the caller's > the device's table > defaults."""
    small = is_interpreted(hidden)
    block = 16 if small else 64
    default = dict(block_m=16 if small or hidden.shape[0] * top_k <= 1024 else 64, block_n=block, block_k=block,
                   num_warps=4, num_stages=1 if small else 3)
    return resolve("fused moe", moe_key(hidden, w13, top_k), hidden.device, default, given, size=hidden.shape[0])


def fused_moe(hidden, w13, w2, topk_weights, topk_ids, out=None, *, block_m: int | None = None,
              block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
              num_stages: int | None = None):
    """Mixture of SiLU-gated experts; contract in pagedserve.kernels.reference.fused_moe.

    hidden [T, Hd]; w13 [E, 2I, Hd]; w2 [E, Hd, I]; topk_weights [T, k] float; topk_ids [T, k] int, where an
    id outside 0..E-1 (-1 or >= E: not on this expert-parallel rank) is skipped. Returns [T, Hd] in
    hidden's dtype; the slot sum is float32."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    assert w13.shape[2] == hidden_size and w2.shape == (num_experts, hidden_size, two_inter // 2)
    assert hidden.stride(-1) == w13.stride(-1) == w2.stride(-1) == 1
    top_k = topk_ids.shape[1]
    p = launch_params(hidden, w13, top_k, block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps,
                      num_stages=num_stages)
    align = moe_align_launches(topk_ids, p["block_m"], num_experts)
    num_pairs = num_tokens * top_k
    gate_up = torch.empty(num_pairs, two_inter, dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(hidden, w13, gate_up, None, align, top_k, p)
    act = silu_and_mul(gate_up, rows=align[0])  # only the pairs some expert computed
    # skipped pairs are never written: start from zero so they add nothing
    down = torch.zeros(num_pairs, hidden_size, dtype=torch.float32, device=hidden.device)
    weights = topk_weights.reshape(-1).contiguous()
    _grouped_gemm(act, w2, down, weights, align, 1, p)
    result = down.view(num_tokens, top_k, hidden_size).sum(1)
    if out is None:
        return result.to(hidden.dtype)
    return out.copy_(result)
