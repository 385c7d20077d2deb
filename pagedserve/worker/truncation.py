"""top_k, then top_p, then min_p: the tokens a sampled row may draw (the rest masked to -inf), each filter
renormalising over what the one before kept, as vLLM does.

top_k and top_p keep a prefix of the row's tokens sorted by probability, so they need the row's order only
as far as that prefix reaches. Sorting the whole vocabulary cost 90 ms a step for 64 rows of 49k logits on a
2-core Xeon (the step itself ~120 ms; torch.topk of 64 candidates: 2.6 ms, of 8,192: ~24 ms), so:
- a row with top_k (up to TOP_K_CANDIDATES) takes its top_k candidates from torch.topk: its top_p prefix lies
  among them, renormalised over them (exact);
- on the CPU a row with top_p alone first tries its NUCLEUS_GUESSES[0] most likely tokens: when their mass
  reaches top_p its prefix lies among them (probabilities over the whole row: exact); the rows whose nucleus
  is wider try the next guess, then the sort. Deciding that reads a device value, which a GPU step must not
  do (the sampler never waits for the device);
- on a GPU those rows go to one Triton launch instead (kernels/triton/nucleus.py: each row's nucleus as a
  threshold on its probabilities, found by bisection over their float bits, no sort and no host read);
- the rest (top_k past TOP_K_CANDIDATES) sort.
Tokens of equal probability at a prefix's edge may be kept in another order than the sort's (the kernel
keeps them together). On the CPU the sampler sends its unseeded rows elsewhere: one compiled pass a row
finds top_k's and top_p's edges and min_p's floor as thresholds (ties at an edge kept together, as the GPU
kernel keeps them) and draws among what they keep (sampler.Sampler._sample_rows, kernels/cpu/logits_ops.cpp
nucleus_draw_rows); the seeded rows come here.

Threads: the worker's torch thread only.
"""

from __future__ import annotations

import torch

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.worker.device_rows import put_rows, row_index, take_rows, to_device

_NEG_INF = float("-inf")
TOP_K_CANDIDATES = 1024  # the largest top_k taken by torch.topk (past it the row sorts)
NUCLEUS_GUESSES = (64, 1024, 8192)  # a top_p-only row's candidates on the CPU, one guess after the other, then the sort


def truncate(x: torch.Tensor, params: list[SamplingParams], nucleus_guesses: tuple[int, ...] = NUCLEUS_GUESSES,
             nucleus_kernel: bool | None = None) -> torch.Tensor:
    """Masks to -inf, in place, each row's tokens outside top_k, then top_p, then min_p. x is [R, V]
    temperature-scaled logits, one row per params; returns x. nucleus_guesses: () sorts every top_p-only row
    that the kernel does not take. nucleus_kernel: whether top_p-only rows go to the Triton kernel (None: on
    CUDA; True on the CPU runs it under TRITON_INTERPRET=1, as the tests do)."""
    vocab = x.shape[1]
    with_k = [i for i, p in enumerate(params) if 0 < p.top_k < vocab and p.top_k <= TOP_K_CANDIDATES]
    taken = set(with_k)
    sort_rows = [i for i, p in enumerate(params) if i not in taken and (0 < p.top_k < vocab or p.top_p < 1.0)]
    if with_k:
        _truncate_candidates(x, with_k, params, max(params[i].top_k for i in with_k), whole_row=False)
    top_p_only = [i for i in sort_rows if not 0 < params[i].top_k < vocab]
    if top_p_only and (x.device.type == "cuda" if nucleus_kernel is None else nucleus_kernel):
        _truncate_kernel(x, top_p_only, params)
        sort_rows = [i for i in sort_rows if 0 < params[i].top_k < vocab]
    guesses = [g for g in nucleus_guesses if 0 < g < vocab] if x.device.type == "cpu" else []
    guess = [i for i in sort_rows if not 0 < params[i].top_k < vocab] if guesses else []  # top_p alone
    if guess:
        wide = guess
        for width in guesses:
            wide = _truncate_candidates(x, wide, params, width, whole_row=True) if wide else []
        sort_rows = sorted(set(sort_rows) - set(guess) | set(wide))
    if sort_rows:
        _truncate_sorted(x, sort_rows, params)
    mp_rows = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if mp_rows:
        dev = x.device
        index = row_index(mp_rows, x.shape[0], dev)
        sub = take_rows(x, index)
        probs = sub.softmax(-1)
        min_p = to_device([params[i].min_p for i in mp_rows], torch.float32, dev)[:, None]
        put_rows(x, index, sub.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), _NEG_INF))
    return x


def _keep_prefix(probs: torch.Tensor, drop: torch.Tensor, top_p: torch.Tensor) -> None:
    """drop |= the tokens after the smallest prefix reaching top_p (in place): a token goes once the mass
    strictly before it reaches top_p, so the top token always stays (the mass before it is 0 < top_p)."""
    drop |= (probs.cumsum(-1) - probs) >= top_p[:, None]


def _top_p_values(ps: list[SamplingParams], dev: torch.device) -> torch.Tensor:
    # A threshold above 1 can never be reached, so rounding in cumsum cannot trim rows with top_p off.
    return to_device([p.top_p if p.top_p < 1.0 else 2.0 for p in ps], torch.float32, dev)


def _truncate_candidates(x: torch.Tensor, rows: list[int], params: list[SamplingParams], width: int,
                         whole_row: bool) -> list[int]:
    """top_k and top_p of `rows` from each row's `width` most likely tokens (torch.topk, sorted). whole_row:
    rows with top_p alone, their probabilities over the whole row; a row whose candidates hold less than its
    top_p is left as it is and returned (a host read: the CPU only). Otherwise rows with top_k <= width,
    renormalised over their top_k."""
    dev = x.device
    index = row_index(rows, x.shape[0], dev)
    sub = take_rows(x, index)
    ps = [params[i] for i in rows]
    vals, ids = sub.topk(width, dim=-1)
    if whole_row:
        drop = torch.zeros_like(vals, dtype=torch.bool)
        probs = (vals - sub.logsumexp(-1, keepdim=True)).exp()
    else:
        k = to_device([p.top_k for p in ps], torch.long, dev)
        drop = torch.arange(width, device=dev) >= k[:, None]
        probs = vals.masked_fill(drop, _NEG_INF).softmax(-1)
    top_p = _top_p_values(ps, dev)
    _keep_prefix(probs, drop, top_p)
    kept = torch.full_like(sub, _NEG_INF).scatter_(1, ids, vals.masked_fill(drop, _NEG_INF))
    if not whole_row:
        put_rows(x, index, kept)
        return []
    reached = (probs.sum(-1) >= top_p).tolist()  # the CPU's own values: no device to wait for
    done = [j for j, ok in enumerate(reached) if ok]
    if done:
        put_rows(x, to_device([rows[j] for j in done], torch.long, dev), kept[done])
    return [rows[j] for j, ok in enumerate(reached) if not ok]


def _truncate_kernel(x: torch.Tensor, rows: list[int], params: list[SamplingParams]) -> None:
    """top_p of `rows` (top_p alone) in one Triton launch over x's rows in place: no sort, no host read."""
    from pagedserve.kernels.triton.nucleus import nucleus_  # triton loads only where a row needs it

    nucleus_(x, to_device(rows, torch.long, x.device), _top_p_values([params[i] for i in rows], x.device))


def _truncate_sorted(x: torch.Tensor, rows: list[int], params: list[SamplingParams]) -> None:
    """top_k and top_p of `rows` over each row sorted whole."""
    dev, vocab = x.device, x.shape[1]
    index = row_index(rows, x.shape[0], dev)
    sub = take_rows(x, index)
    ps = [params[i] for i in rows]
    sorted_x, order = sub.sort(dim=-1, descending=True)
    k = to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in ps], torch.long, dev)
    drop = torch.arange(vocab, device=dev) >= k[:, None]
    sorted_x.masked_fill_(drop, _NEG_INF)
    probs = sorted_x.softmax(-1)
    _keep_prefix(probs, drop, _top_p_values(ps, dev))
    put_rows(x, index, sub.masked_fill(drop.scatter(1, order, drop), _NEG_INF))
