"""What one step's results make of a request, without the Scheduler's queues (Scheduler.update,
scheduler.py, takes a step's results in and applies these): a sampled token appended and the stop
rules applied to it (stop ids, eos, max_tokens, max_model_len: common/stop_rules.py), the samples
of a request of n > 1 forked from its first (they share its blocks copy-on-write: the Scheduler
registers them), the request's prompt logprobs, handed out once, and an embedding request's
pooled vector (params.pooling: prompt-only, it finishes on the step that completes its prompt).

Threads: the Scheduler's (one thread: the step loop, or the in-process engine's caller). Each
function changes only the requests it is given.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagedserve.common.messages import ModelRunnerOutput, SampledToken
from pagedserve.common.stop_rules import at_length, stops_on
from pagedserve.scheduler.core.request import Request, RequestStatus


@dataclass(slots=True)
class RequestUpdate:
    """What one step did for one request: its new tokens, and whether it is done."""
    request: Request
    new_tokens: list[SampledToken]
    finished: bool
    # With prompt_logprobs, on the request's first update (sample 0's first token, or the finish of
    # a max_tokens 0 request): the prompt's logprobs, positions 1 .. P-1. Once per request.
    prompt_logprobs: list[SampledToken] | None = None
    # An embedding request (params.pooling), on its finish: the pooled vector, float32 little-endian.
    embedding: bytes | None = None


def append_sample(req: Request, sample: SampledToken | None,
                  max_model_len: int) -> tuple[RequestUpdate, RequestStatus | None]:
    """Add a sampled token (None: already added at fork) and apply the stop rules: the update and
    the status that ends the request (None: it goes on). The caller finishes it."""
    if sample is not None:
        req.token_ids.append(sample.token_id)
        if sample.logprob is not None:
            req.logprobs.append(sample)
    if req.first_token_time is None:
        req.first_token_time = time.monotonic()
    token = req.token_ids[-1]
    if sample is None:  # a forked sample: its first token (and logprob) came in at the fork
        sample = req.logprobs[-1] if req.logprobs else SampledToken(token)
    params = req.params
    stop = None
    if stops_on(token, req.num_output_tokens, params, req.eos_token_ids):
        stop = RequestStatus.FINISHED_STOPPED
    elif at_length(req.num_output_tokens, req.num_prompt_tokens, params, max_model_len):
        stop = RequestStatus.FINISHED_LENGTH
    first = first_prompt_logprobs(req) if req.num_output_tokens == 1 else None
    return RequestUpdate(req, [sample], stop is not None, first), stop


def fork_children(parent: Request, child_samples: list[SampledToken]) -> list[Request]:
    """The samples 1 .. n-1 of a request at its first token: each starts from the prompt and its
    own first token, and shares the parent's progress (the caller registers them, then clears the
    parent's child_req_ids)."""
    children = []
    for index, (child_id, sample) in enumerate(zip(parent.child_req_ids, child_samples), start=1):
        child = Request(child_id, parent.token_ids[:parent.num_prompt_tokens] + [sample.token_id],
                        parent.num_prompt_tokens, parent.params, parent.eos_token_ids,
                        parent.priority, parent.arrival_time, group_id=parent.group_id,
                        sample_index=index, status=RequestStatus.RUNNING,
                        num_computed_tokens=parent.num_computed_tokens,
                        num_cached_tokens=parent.num_cached_tokens, sent_to_worker=True,
                        first_scheduled_time=parent.first_scheduled_time, images=parent.images)
        if sample.logprob is not None:
            child.logprobs.append(sample)
        child.prompt_logprobs = parent.prompt_logprobs  # complete: the prompt is computed
        children.append(child)
    return children


def pooled_vector(req: Request, result: ModelRunnerOutput) -> bytes | None:
    """An embedding request's vector from the step that completed its prompt (None: not one)."""
    if req.params.pooling is None:
        return None
    data = result.pooled.get(req.request_id)
    if data is None:
        raise RuntimeError("the worker completed an embedding request's prompt but returned no vector")
    return data


def first_prompt_logprobs(req: Request) -> list[SampledToken] | None:
    # Sent once per request, with sample 0's first token (the other samples share them): a
    # request resumed after a restart (outputs already stored) or re-run by recompute is past
    # it and sends nothing again.
    return list(req.prompt_logprobs) if req.params.prompt_logprobs is not None and req.sample_index == 0 \
        else None
