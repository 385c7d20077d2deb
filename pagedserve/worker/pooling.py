"""Embeddings (vLLM's pooling runner): an embedding request's prompt hidden states, after the
model's final norm (transformers' last_hidden_state), pooled into one vector on the step that
completes its prompt.

A prompt may run in several chunks (chunked prefill): "mean" adds each chunk's rows into the
request's running sum (RequestState.pooled, float32), "cls" keeps position 0's row from the
first chunk, "last" reads the final chunk's last row. Mean and cls requests take no prefix-cache
hits (SamplingParams.takes_prefix_hits), so every position they read is computed here; a
recompute preemption re-sends the request, whose new state starts the sum again.

Thread: the model runner's step, before the step's tokens are counted as computed (a state's
num_computed_tokens is its chunk's first position). Under tensor parallelism every rank holds
the full hidden rows; only rank 0 builds the result.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def compute(hidden: torch.Tensor, order: Sequence, counts: Sequence[int], build: bool) -> dict[str, bytes]:
    """order/counts: the step's states in batch order and their scheduled token counts (hidden's
    rows follow them). Returns req_id -> the pooled vector as float32 little-endian bytes, for
    the pooling requests whose prompt this step completed."""
    out: dict[str, bytes] = {}
    offset = 0
    for state, n in zip(order, counts):
        spec = state.params.pooling
        start, offset = offset, offset + n
        if spec is None or not build:
            continue
        rows = hidden[start:start + n]
        first = state.num_computed_tokens
        if spec.type == "mean":
            chunk = rows.float().sum(dim=0)
            state.pooled = chunk if state.pooled is None else state.pooled + chunk
        elif spec.type == "cls" and first == 0:
            state.pooled = rows[0].float()
        if first + n < len(state.token_ids):
            continue  # more of the prompt to come
        if spec.type == "last":
            vector = rows[-1].float()
        elif spec.type == "mean":
            vector = state.pooled / len(state.token_ids)
        else:
            vector = state.pooled
        if spec.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        out[state.req_id] = vector.cpu().numpy().astype("<f4", copy=False).tobytes()
    return out


def as_floats(data: bytes) -> list[float]:
    """A pooled vector's bytes as Python floats."""
    return np.frombuffer(data, dtype="<f4").tolist()
