"""The kernel benchmark's cases (kernels/bench.py's rows; kernels/tune.py and kernels/host_cost.py take
them too): each Case is one Triton kernel and its torch reference (kernels/reference.py) at one shape,
on inputs built here (paged block tables over shuffled block ids, random queries, caches and weights),
with the minimum HBM traffic and FLOPs it implies (the roofline floor's terms) and how its error is
measured. gpu_cases: the GPU shapes (bfloat16, the 1B Llama's heads, W1024's mixed step, the MoE and
MLA models'); tiny_cases: float32 shapes small enough for the Triton interpreter on the CPU.

TritonKernels imports the Triton entry points late: TRITON_INTERPRET must be settled before triton
loads them. Threads: the caller's. Inputs come from torch's global generator (the caller seeds it);
nothing is kept between calls.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch

from pagedserve.kernels import reference


@dataclass
class Case:
    """One benchmark row: inputs plus the two implementations and the traffic/work they imply."""
    kernel: str
    shape: str
    args: tuple
    triton_fn: Callable
    torch_fn: Callable
    bytes: float   # minimum HBM traffic: every input read once, the output written once
    flops: float
    error: Callable | None = None  # (got, want) -> error; None: max_rel_err


# ------------------------------------------------------------------------------------------- inputs


def paged_layout(seq_lens: list[int], page: int, device) -> tuple[torch.Tensor, int]:
    """Block tables [S, max_blocks] int32 over shuffled block ids; returns (tables, num_blocks)."""
    counts = [math.ceil(n / page) for n in seq_lens]
    num_blocks = sum(counts)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(counts), dtype=torch.int32, device=device)
    start = 0
    for s, n in enumerate(counts):
        tables[s, :n] = perm[start:start + n]
        start += n
    return tables, num_blocks


def step(ctx_lens: list[int], q_lens: list[int], device):
    seq_lens = torch.tensor([c + q for c, q in zip(ctx_lens, q_lens)], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return seq_lens, qsl


def attended_keys(ctx_lens: list[int], q_lens: list[int], window: int = 0) -> int:
    """Sum over the step's queries of the keys each attends to (causal; with a window, at most that many)."""
    if not window:
        return sum(q * c + q * (q + 1) // 2 for c, q in zip(ctx_lens, q_lens))
    return sum(min(pos + 1, window) for c, q in zip(ctx_lens, q_lens) for pos in range(c, c + q))


def read_keys(ctx_lens: list[int], q_lens: list[int], window: int = 0) -> int:
    """Cached positions the step must read: every sequence's, or with a window those its first query sees on."""
    if not window:
        return sum(c + q for c, q in zip(ctx_lens, q_lens))
    return sum(c + q - max(0, c - window + 1) for c, q in zip(ctx_lens, q_lens))


def attention_case(name, ctx_lens, q_lens, heads, kv_heads, dim, page, dtype, device, tk, window=0, softcap=0.0):
    """A paged attention row; window / softcap: a local layer's (Gemma's), passed to both implementations."""
    seq_lens, qsl = step(ctx_lens, q_lens, device)
    tables, num_blocks = paged_layout(seq_lens.tolist(), page, device)
    query = torch.randn(sum(q_lens), heads, dim, dtype=dtype, device=device)
    k_cache = torch.randn(num_blocks, page, kv_heads, dim, dtype=dtype, device=device)
    v_cache = torch.randn(num_blocks, page, kv_heads, dim, dtype=dtype, device=device)
    size = dtype.itemsize
    traffic = (read_keys(ctx_lens, q_lens, window) * kv_heads * 2 * dim * size + 2 * query.numel() * size
               + tables.numel() * 4)
    fn = {"decode": tk.paged_decode_attention, "split": tk.paged_split_decode_attention}.get(
        name.split()[0], tk.paged_prefill_attention)
    ref = reference.paged_attention
    shape = (f"S={len(q_lens)} q={max(q_lens)} ctx={max(ctx_lens)} H={heads} KVH={kv_heads} D={dim} "
             f"page={page} {str(dtype).removeprefix('torch.')}")
    if window or softcap:
        fn, ref = (functools.partial(f, window=window, softcap=softcap) for f in (fn, ref))
        shape += f" window={window} cap={softcap:g}"
    return Case(name, shape, (query, k_cache, v_cache, tables, seq_lens, qsl, dim ** -0.5), fn,
                ref, traffic, 2 * heads * attended_keys(ctx_lens, q_lens, window) * 2 * dim)


def mla_case(batch, context, heads, rank, rope, page, dtype, device, tk, q_len=1):
    ctx_lens, q_lens = [context] * batch, [q_len] * batch
    seq_lens, qsl = step(ctx_lens, q_lens, device)
    tables, num_blocks = paged_layout(seq_lens.tolist(), page, device)
    q_latent = torch.randn(batch * q_len, heads, rank, dtype=dtype, device=device)
    q_rope = torch.randn(batch * q_len, heads, rope, dtype=dtype, device=device)
    cache = torch.randn(num_blocks, page, 1, rank + rope, dtype=dtype, device=device)
    size = dtype.itemsize
    traffic = (batch * (context + q_len) * (rank + rope) + batch * q_len * heads * (2 * rank + rope)) * size
    flops = 2 * heads * attended_keys(ctx_lens, q_lens) * (2 * rank + rope)
    shape = (f"S={batch} q={q_len} ctx={context} H={heads} L={rank} R={rope} page={page} "
             f"{str(dtype).removeprefix('torch.')}")
    args = (q_latent, q_rope, cache, tables, seq_lens, qsl, (rank + rope) ** -0.5, rank)
    return Case("mla decode" if q_len == 1 else "mla mixed", shape, args,
                tk.paged_mla_attention, reference.paged_mla_attention, traffic, flops)


def moe_case(tokens, experts, top_k, hidden, inter, dtype, device, tk):
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=device) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device=device) / inter ** 0.5).to(dtype)
    logits = torch.randn(tokens, experts, device=device)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    used = ids.unique().numel()
    traffic = used * 3 * inter * hidden * dtype.itemsize + 2 * x.numel() * dtype.itemsize
    shape = f"T={tokens} E={experts} k={top_k} H={hidden} I={inter} {str(dtype).removeprefix('torch.')}"
    return Case("fused moe", shape, (x, w13, w2, weights, ids.to(torch.int32)), tk.fused_moe, reference.fused_moe,
                traffic, 2 * tokens * top_k * 3 * inter * hidden)


def nucleus_case(rows, vocab, device, tk):
    """top_p 0.95 over float32 logits (random normals x 3, a nucleus of ~thousands): the kernel (bisection
    over each row's float bits) against the sort every top_p row takes without it; both on a copy, the
    inputs untouched. The error is the share of tokens kept by one and not the other."""
    x = torch.randn(rows, vocab, device=device) * 3
    index = torch.arange(rows, device=device)
    top_p = torch.full((rows,), 0.95, device=device)
    return Case("top_p nucleus", f"R={rows} V={vocab} float32", (x, index, top_p),
                lambda x, index, top_p: tk.nucleus_(x.clone(), index, top_p), reference.top_p_nucleus,
                2 * x.numel() * 4, 0, error=kept_differ)


def int4_case(m, n, k, dtype, device, tk, scale_dtype=torch.float16):
    """y = x @ W.T with W [N, K] kept 4-bit (worker/int4_weight.py's layout: groups of 32, float16 scales and
    offsets; float32 for a GGUF's Q4_K) against the torch path a 4-bit weight takes without the kernel:
    dequantized, then a matmul."""
    x = torch.randn(m, k, dtype=dtype, device=device)
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 8, n), dtype=torch.int32, device=device)
    scales = (torch.rand(k // 32, n, device=device) * 0.02 + 0.001).to(scale_dtype)
    offsets = (torch.randn(k // 32, n, device=device) * 0.1).to(scale_dtype)
    traffic = words.numel() * 4 + 2 * scales.numel() * scales.element_size() + (m * k + m * n) * dtype.itemsize
    label = f"M={m} N={n} K={k} {str(dtype).removeprefix('torch.')}" + (
        " float32 scales (Q4_K)" if scale_dtype == torch.float32 else "")
    return Case("int4 linear", label, (x, words, scales, offsets), tk.int4_linear, reference.int4_linear, traffic,
                2 * m * n * k)


def kept_differ(got: torch.Tensor, want: torch.Tensor) -> float:
    """The share of tokens kept (not -inf) by one of two masked logits and not by the other."""
    return ((got > -math.inf) != (want > -math.inf)).float().mean().item()


class TritonKernels:
    """The Triton entry points, imported late: TRITON_INTERPRET must be settled before triton loads them."""

    def __init__(self):
        from pagedserve.kernels.triton import (fused_moe, int4_matmul, mla_attention, nucleus, paged_attention,
                                               split_decode)
        self.paged_decode_attention = paged_attention.paged_decode_attention
        self.paged_split_decode_attention = split_decode.paged_split_decode_attention
        self.paged_prefill_attention = paged_attention.paged_prefill_attention
        self.paged_mixed_attention = paged_attention.paged_mixed_attention
        self.paged_mla_attention = mla_attention.paged_mla_attention
        self.fused_moe = fused_moe.fused_moe
        self.nucleus_ = nucleus.nucleus_
        self.int4_linear = int4_matmul.int4_linear


def gpu_cases(device, tk, moe_tokens=(16, 256, 2048), batch=64, context=2048, experts=64):
    dt = torch.bfloat16
    yield attention_case("decode attention", [context] * batch, [1] * batch, 32, 8, 128, 16, dt, device, tk)
    # one long sequence: what the split over the KV length is for (flash-decoding), beside the plain kernel
    yield attention_case("decode attention", [16 * context], [1], 32, 8, 128, 16, dt, device, tk)
    yield attention_case("split decode attention", [16 * context], [1], 32, 8, 128, 16, dt, device, tk)
    # the first batch split over the KV length: whether filling whole waves of multiprocessors beats the
    # combine's extra pass (attention_choice.py splits only below one program per multiprocessor)
    yield attention_case("split decode attention", [context] * batch, [1] * batch, 32, 8, 128, 16, dt, device, tk)
    yield attention_case("prefill attention", [1024] * 4, [512] * 4, 32, 8, 128, 16, dt, device, tk)
    # the same with FlashAttention-2's causal split (off by default): whether the unmasked loop pays here
    causal_split = attention_case("prefill causal split", [1024] * 4, [512] * 4, 32, 8, 128, 16, dt, device, tk)
    causal_split.triton_fn = functools.partial(tk.paged_prefill_attention, causal_split=1)
    yield causal_split
    yield from mixed_cases(dict(ctx=[200] * 190 + [100] * 4, q=[1] * 190 + [150] * 4, heads=32, kv_heads=8,
                                dim=64, page=16, dtype=dt), device, tk)
    # a local layer of Gemma 3 1B (4 heads, 1 kv head of 256, a window of 512) over contexts past its window:
    # the kernels read the window's keys only; and Gemma 2 2B's capped scores (8 heads, 4 kv heads of 256)
    yield attention_case("decode attention", [context] * batch, [1] * batch, 4, 1, 256, 16, dt, device, tk, 512)
    yield attention_case("prefill attention", [1024] * 4, [512] * 4, 4, 1, 256, 16, dt, device, tk, 512)
    yield attention_case("decode attention", [context] * batch, [1] * batch, 8, 4, 256, 16, dt, device, tk, 0, 50.0)
    yield mla_case(batch, context, 128, 512, 64, 16, dt, device, tk)
    # a small batch over a long context: too few (head block, sequence) programs, so the keys split into runs
    yield mla_case(4, 4 * context, 128, 512, 64, 16, dt, device, tk)
    for tokens in moe_tokens:
        yield moe_case(tokens, experts, 8, 2048, 1408, dt, device, tk)
    yield nucleus_case(4 * batch, 49152, device, tk)  # W1024's sampled step: 256 rows of the 1B's vocabulary
    # the 1B Llama's gate/up projection kept 4-bit: a decode step of one and of 64 rows, a prefill chunk
    for rows in (1, 64, 512):
        yield int4_case(rows, 16384, 2048, dt, device, tk)
    yield int4_case(1, 16384, 2048, dt, device, tk, torch.float32)  # a GGUF's Q4_K: its exact float32 scales


def mixed_cases(shape: dict, device, tk):
    """A mixed step (W1024's kind on the GPU shape: ~190 decodes beside 4 prefill chunks, the 1B Llama's heads)
    through the prefill kernel alone, and split by the number of queries (decodes to the decode kernel:
    paged_mixed_attention, what the worker runs)."""
    args = (shape["ctx"], shape["q"], shape["heads"], shape["kv_heads"], shape["dim"], shape["page"], shape["dtype"])
    yield attention_case("mixed attention", *args, device, tk)
    split = attention_case("mixed split attention", *args, device, tk)
    split.triton_fn = tk.paged_mixed_attention
    yield split


def tiny_cases(device, tk):
    dt = torch.float32
    yield attention_case("decode attention", [40, 7, 0], [1, 1, 1], 8, 2, 32, 16, dt, device, tk)
    yield attention_case("split decode attention", [40, 7, 0], [1, 1, 1], 8, 2, 32, 16, dt, device, tk)
    yield attention_case("prefill attention", [16, 0], [20, 5], 4, 2, 32, 16, dt, device, tk)
    causal_split = attention_case("prefill causal split", [16, 0], [20, 5], 4, 2, 32, 16, dt, device, tk)
    causal_split.triton_fn = functools.partial(tk.paged_prefill_attention, causal_split=1)
    yield causal_split
    yield from mixed_cases(dict(ctx=[40, 7, 16, 3], q=[1, 1, 20, 1], heads=8, kv_heads=2, dim=32, page=16, dtype=dt),
                           device, tk)
    yield attention_case("decode attention", [40, 7, 0], [1, 1, 1], 8, 2, 32, 16, dt, device, tk, 8, 2.0)
    yield attention_case("prefill attention", [16, 0], [20, 5], 4, 2, 32, 16, dt, device, tk, 8, 2.0)
    yield mla_case(2, 40, 4, 32, 16, 16, dt, device, tk)
    yield moe_case(5, 4, 2, 32, 24, dt, device, tk)
    yield nucleus_case(3, 300, device, tk)
    yield int4_case(5, 48, 64, dt, device, tk)
