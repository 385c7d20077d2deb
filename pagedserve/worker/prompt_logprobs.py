"""Prompt logprobs (vLLM's `prompt_logprobs`, completions' `echo` + `logprobs`), computed in the
prefill from the hidden rows the step already has.

A scheduled chunk of a request covers positions [c, c + n); the row at position p predicts the
prompt token at p + 1, so the chunk yields the logprobs of prompt positions c + 1 .. min(c + n,
P - 1) (P: prompt length). The last row of a chunk predicts the first token of the next chunk:
the worker holds the whole prompt, so no row is lost between chunks, and position 0 has none.

Rows of every asking request go through the model's head together, in slices of at most
ROWS_PER_SLICE rows (bounds the [rows, vocab] float32 block); then one log_softmax, gather, rank
count and top-k per slice, all vectorised over the vocabulary. A step in which no scheduled
request asks pays one pass over the scheduled states. Under tensor parallelism the head gathers
the vocabulary across ranks, so every rank runs the matmul; only rank 0 builds the result.

Thread: the model runner's step. Positions are delivered once by the scheduler (a recompute
re-runs the prompt and recomputes them; the scheduler keeps the first copy).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagedserve.common.messages import PromptLogprobs, SampledToken

ROWS_PER_SLICE = 256  # 256 rows x 152k vocabulary x 4 bytes: about 150 MiB at a time


def compute(model, hidden: torch.Tensor, order: Sequence, counts: Sequence[int],
            build: bool) -> dict[str, PromptLogprobs]:
    """order/counts: the step's states in batch order and their scheduled token counts (hidden's
    rows follow them); each state's num_computed_tokens is the chunk's first position. build:
    False on ranks other than 0 (they take part in the head's collective only)."""
    offsets = np.cumsum([0, *counts[:-1]])
    rows, targets, spans = [], [], []  # spans: (state, start position, number of rows)
    for state, n, offset in zip(order, counts, offsets):
        if state.params.prompt_logprobs is None:
            continue
        first = state.num_computed_tokens
        m = min(first + n, state.num_prompt_tokens - 1) - first
        if m <= 0:
            continue
        rows.append(np.arange(offset, offset + m))
        targets.append(state.token_ids[first + 1:first + 1 + m])
        spans.append((state, first + 1, m))
    if not spans:
        return {}
    device = hidden.device
    rows_t = torch.from_numpy(np.concatenate(rows)).to(device)
    targets_t = torch.tensor([t for part in targets for t in part], dtype=torch.long, device=device)
    k = max(s.params.prompt_logprobs for s, _, _ in spans)
    logprobs, ranks, top_ids, top_lps = [], [], [], []
    for lo in range(0, len(rows_t), ROWS_PER_SLICE):
        logits = model.compute_logits(hidden.index_select(0, rows_t[lo:lo + ROWS_PER_SLICE]))
        if not build:
            continue
        lp = logits.float().log_softmax(-1)
        target_lp = lp.gather(1, targets_t[lo:lo + ROWS_PER_SLICE, None])
        logprobs.append(target_lp.squeeze(1))
        ranks.append((lp >= target_lp).sum(-1))  # vLLM's rank: tokens at least as likely, itself included
        if k:
            vals, ids = lp.topk(min(k, lp.shape[1]), dim=-1)
            top_lps.append(vals)
            top_ids.append(ids)
    if not build:
        return {}
    lp_list = torch.cat(logprobs).tolist()
    rank_list = torch.cat(ranks).tolist()
    top_id_list = torch.cat(top_ids).tolist() if k else None
    top_lp_list = torch.cat(top_lps).tolist() if k else None
    out, row = {}, 0
    for (state, start, m), part in zip(spans, targets):
        want = state.params.prompt_logprobs
        tokens = []
        for j in range(m):
            r = row + j
            top = list(zip(top_id_list[r][:want], top_lp_list[r][:want])) if want else []
            tokens.append(SampledToken(part[j], lp_list[r], top, rank_list[r]))
        out[state.req_id] = PromptLogprobs(start, tokens)
        row += m
    return out
