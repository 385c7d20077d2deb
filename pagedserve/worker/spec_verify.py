"""Verifying a row's proposals (speculative decoding), on the worker: which hidden rows give
logits, and which of the sampled tokens are kept.

A row with k proposals ran k + 1 query tokens (its last known token, then the proposals, like a
small prefill chunk); position j's logits predict output position num_outputs + j. Each position
is sampled exactly as a plain step would sample it there — the same sampler, with the history of
outputs that position would have if the proposals before it are kept (penalties, min_tokens),
and the request's seeded stream key for that output position (step_sampling.sample_key).
Then `accept` keeps the longest prefix of proposals equal to those samples, plus the sample that
follows it.

Exactness: greedy, the samples are the argmaxes (vLLM's greedy verification). Sampling, with a
one-hot draft (n-gram), keeping proposal d when the position's sample equals d is vLLM's
rejection sampler: d is kept with probability p(d) = min(1, p(d) / q(d)), and otherwise the
token emitted is a sample of p conditioned on not being d, i.e. the residual max(p - q, 0)
renormalised. Every emitted token is distributed as the target's; and a seeded request draws
the same tokens with speculation as without (its draws depend on seed, sample and position only).

Threads: the worker's torch thread only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagedserve.common.messages import SampledToken


def logit_rows(ends: np.ndarray, samplers: Sequence[int], states: Sequence) -> np.ndarray:
    """The hidden rows to compute logits at: the last row of each sampling row, and for a row
    with k proposals its last k + 1 rows (states[i]: the step's states in batch order)."""
    parts = []
    for i in samplers:
        k = len(states[i].spec_token_ids)
        parts.append(np.arange(ends[i] - k, ends[i] + 1))
    return np.concatenate(parts)


def accept(samples: list[SampledToken], proposals: Sequence[int]) -> list[SampledToken]:
    """The new tokens of a verified row: samples[0 .. a], where proposals[0 .. a - 1] equal
    samples[0 .. a - 1] and proposals[a] does not (or a = k: every proposal kept, and the bonus)."""
    kept = 0
    while kept < len(proposals) and samples[kept].token_id == proposals[kept]:
        kept += 1
    return samples[:kept + 1]
