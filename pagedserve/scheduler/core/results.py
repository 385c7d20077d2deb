"""Taking in one step's results (a mixin of Scheduler, scheduler.py): each request's computed
tokens, its sampled token(s) — the first sample of a request of n > 1 forks the others, which
share its blocks copy-on-write —, its prompt logprobs, the stop rules (stop ids, eos, max_tokens,
max_model_len), and the prefix cache's newly full blocks (entered first: a request that ends in
its step still leaves the blocks that step computed in the cache). An embedding request (params.pooling)
is prompt-only: it finishes on the step that completes its prompt, with the worker's pooled vector.

Threads: the Scheduler's (one thread: the step loop, or the in-process engine's caller).
Invariants: a request finished or failed here is in no queue and holds no blocks when update
returns; the request's prompt logprobs go out once, with sample 0's first token (listed first
among the request's updates of that step), never with the other samples'.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.common.messages import ModelRunnerOutput, SampledToken, SchedulerOutput
from pagedserve.common.stop_rules import at_length, samples_any, stops_on
from pagedserve.scheduler.core.request import Request, RequestStatus, sample_ids

if TYPE_CHECKING:
    from pagedserve.scheduler.core.scheduler import Scheduler


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


class Results:
    def update(self: Scheduler, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestUpdate]:
        updates = [RequestUpdate(req, [], True) for req in self._cut_short]
        self._cut_short = []
        for req_id, num_tokens in sched.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                # Aborted while the step ran (async scheduling). Had its samples forked there, the
                # worker holds the forks, which this side never registered: it drops them too
                # (unless a new request has claimed those ids since).
                forked = sample_ids(req_id, len(result.sampled.get(req_id) or ()))[1:]
                self._dropped_ids.extend(i for i in forked if i not in self.sample_ids)
                continue
            req.num_computed_tokens += num_tokens
            req.num_inflight_tokens -= num_tokens
            if req.num_pending_samples and req.num_computed_tokens == req.num_tokens:
                req.num_pending_samples -= 1  # (the worker's rule: it sampled where the known tokens end)
            samples = result.sampled.get(req_id)
            try:
                # The KV this step wrote is the prefix cache's whatever becomes of the request: its
                # full blocks go in before its token may finish it (max_tokens 1, a prompt-only
                # request), which frees them. Before a fork, so the samples share what is cached.
                self.block_manager.cache_full_blocks(req_id, req.token_ids, req.num_computed_tokens,
                                                     req.params.prefix_salt)
                prompt = result.prompt_logprobs.get(req_id)
                if prompt is not None:
                    req.add_prompt_logprobs(prompt.start, prompt.tokens)
                if not samples_any(req.params):  # the prompt only: done once it is computed, nothing sampled
                    if req.num_computed_tokens >= req.num_tokens:
                        self._finish(req, RequestStatus.FINISHED_LENGTH)
                        updates.append(RequestUpdate(req, [], True, self._first_prompt_logprobs(req),
                                                     self._embedding(req, result)))
                        continue
                    samples = None
                if samples:  # sample 0 (with the prompt logprobs) ahead of its forks
                    children = self._fork(req, samples[1:])
                    updates.append(self._append(req, samples[0]))
                    updates.extend(self._append(child, None) for child in children)
            except Exception as exc:  # noqa: BLE001 - it fails alone (take_failed)
                # The worker forked the samples itself when it sampled: it must drop those too.
                self._fail(req, exc, worker_forked=req.child_req_ids if samples else ())
        if self.failed:
            failed = {group_id for group_id, _ in self.failed}
            updates = [u for u in updates if u.request.group_id not in failed]
        return updates

    def _fork(self: Scheduler, parent: Request, child_samples: list[SampledToken]) -> list[Request]:
        children = []
        for index, (child_id, sample) in enumerate(zip(parent.child_req_ids, child_samples), start=1):
            child = Request(child_id, parent.token_ids[:parent.num_prompt_tokens] + [sample.token_id],
                            parent.num_prompt_tokens, parent.params, parent.eos_token_ids,
                            parent.priority, parent.arrival_time, group_id=parent.group_id,
                            sample_index=index, status=RequestStatus.RUNNING,
                            num_computed_tokens=parent.num_computed_tokens,
                            num_cached_tokens=parent.num_cached_tokens, sent_to_worker=True,
                            first_scheduled_time=parent.first_scheduled_time)
            if sample.logprob is not None:
                child.logprobs.append(sample)
            child.prompt_logprobs = parent.prompt_logprobs  # complete: the prompt is computed
            self.block_manager.fork(parent.request_id, child_id)
            self.requests[child_id] = child
            self.groups[parent.group_id].append(child)
            bisect.insort(self.running, child, key=self._key)
            children.append(child)
        parent.child_req_ids = []
        return children

    def _append(self: Scheduler, req: Request, sample: SampledToken | None) -> RequestUpdate:
        """Add a sampled token (None: already added at fork) and apply the stop rules."""
        if sample is not None:
            req.token_ids.append(sample.token_id)
            if sample.logprob is not None:
                req.logprobs.append(sample)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        token = req.token_ids[-1]
        if sample is None:  # a forked sample: its first token (and logprob) came in at the fork
            sample = req.logprobs[-1] if req.logprobs else SampledToken(token)
        new = [sample]
        params = req.params
        stop = None
        if stops_on(token, req.num_output_tokens, params, req.eos_token_ids):
            stop = RequestStatus.FINISHED_STOPPED
        elif at_length(req.num_output_tokens, req.num_prompt_tokens, params, self.config.max_model_len):
            stop = RequestStatus.FINISHED_LENGTH
        if stop is not None:
            self._finish(req, stop)
        first = self._first_prompt_logprobs(req) if req.num_output_tokens == 1 else None
        return RequestUpdate(req, new, stop is not None, first)

    @staticmethod
    def _embedding(req: Request, result: ModelRunnerOutput) -> bytes | None:
        if req.params.pooling is None:
            return None
        data = result.pooled.get(req.request_id)
        if data is None:
            raise RuntimeError("the worker completed an embedding request's prompt but returned no vector")
        return data

    @staticmethod
    def _first_prompt_logprobs(req: Request) -> list[SampledToken] | None:
        # Sent once per request, with sample 0's first token (the other samples share them): a
        # request resumed after a restart (outputs already stored) or re-run by recompute is past
        # it and sends nothing again.
        return list(req.prompt_logprobs) if req.params.prompt_logprobs is not None and req.sample_index == 0 \
            else None
