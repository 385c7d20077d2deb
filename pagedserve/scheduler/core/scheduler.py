"""Continuous batching with one token budget per step shared by decodes and prefill chunks.

Each step: running decodes first (a decode is one token and keeps a stream moving), then running
partial prefills, then swapped-out requests, then waiting ones — all against max_num_seqs and
max_num_batched_tokens; except that a prefill with more than a chunk to go leaves a step now and then
to the short prompts at the head of the waiting queue (short_first.py). When blocks run out the
lowest-priority (latest-arrived) running request is preempted, by recompute or by swapping its blocks
to the host pool. The step being built, and what fits in it (a waiting request admitted, a swapped
one brought back, a row's proposals, a victim preempted), is step_draft.py; this module orders the
step and picks whom to preempt.

Async scheduling (schedule(ahead=True), vLLM's): while one step runs on the worker, the next is
scheduled as if each request that step samples already had its token (Request.num_pending_samples):
the worker, which appends its own samples, runs the two back to back. An ahead step preempts
nothing and swaps nothing in; a request waits for the result when its next step depends on it (its
samples fork, or the pending token ends it by length). A request that stops on the pending token
(eos, a stop id) has run one step for nothing: update() ignores it and the worker drops it next step.

A bad request fails alone: an exception in one request's scheduling or result bookkeeping ends
that request's whole group (aborted, its blocks freed) and is reported by take_failed(); the
step goes on for the others (_fail: whatever the step being built had given it is taken back).
No two live requests share a sample id (sample_ids.py). update() takes a step's results in: what
they make of each request — sampled tokens, forks of n > 1, stop rules, prompt logprobs, pooled
vectors — is results.py; counting what a step did (StepStats, waiting reasons) is step_stats.py. A
structured request waits, passed over by admission, until the worker has compiled its grammar (grammar_wait.py).

Speculative decoding (speculative: set): a decode row of a synchronous step may carry proposals
(speculation.py, which also says how update() takes back the rejected ones); they are dropped
first when blocks run short, before anything is preempted.

Invariants: `sample_ids` holds exactly the sample ids of every group in `groups`; a request
finished or failed in update() or by _fail is in no queue and holds no blocks when it returns;
the request's prompt logprobs go out once, with sample 0's first token (listed first among the
request's updates of that step), never with the other samples'.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from pagedserve.common.speculative import SpeculativeConfig
from pagedserve.common.stop_rules import samples_any
from pagedserve.common.messages import ModelRunnerOutput, SampledToken, SchedulerOutput
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.scheduler.core.grammar_wait import GrammarWait
from pagedserve.scheduler.core.kv_groups import make_block_manager, prompt_problem
from pagedserve.scheduler.core.results import (RequestUpdate, append_sample, first_prompt_logprobs, fork_children,
                                               pooled_vector)
from pagedserve.scheduler.core.request import Request, RequestNotServable, RequestStatus, sample_ids
from pagedserve.scheduler.core.sample_ids import SampleIds
from pagedserve.scheduler.core.short_first import yielding_prefills
from pagedserve.scheduler.core.speculation import Speculation
from pagedserve.scheduler.core.step_draft import StepDraft, waits_for_result
from pagedserve.scheduler.core.step_stats import StepStats, count_step


class Scheduler:
    def __init__(self, config: SchedulerConfig, speculative: SpeculativeConfig | None = None) -> None:
        self.config = config
        self.speculation = Speculation(speculative) if speculative is not None else None
        self.block_manager = make_block_manager(config.num_gpu_blocks, config.block_size, config.enable_prefix_caching,
                                                config.num_cpu_blocks, config.kv_group_windows)
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []  # sorted by Request.sort_key
        self.swapped: list[Request] = []  # sorted by Request.sort_key
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, list[Request]] = {}
        self.sample_ids = SampleIds()  # every sample id of the groups, forked or still to fork
        self.failed: list[tuple[str, Exception]] = []  # (group id, why): see take_failed
        self._dropped_ids: list[str] = []  # the worker must forget these on the next step
        self._cut_short: list[Request] = []  # finished inside schedule(): reported by update()
        self._key = Request.sort_key if config.policy == "priority" else Request.arrival_key
        self.step_id = 0
        self.num_preemptions = 0
        self.last_step = StepStats()
        self._draft: StepDraft | None = None  # the step schedule() is building (step_draft.py)
        self.grammar_wait = GrammarWait()  # waiting requests whose grammar the worker compiles
        # An ahead step left work that only a step after the results can do (a preemption to
        # free blocks, a swap-in): the caller should schedule the next step synchronously.
        self.needs_sync = False

    # ---- admission and abort -------------------------------------------------------------
    def check_prompt(self, num_prompt_tokens: int, images=()) -> None:
        """ValueError when a prompt of that many tokens (and images) can never run here (kv_groups.prompt_problem)."""
        problem = prompt_problem(self.config, self.block_manager.num_total_blocks, num_prompt_tokens, images)
        if problem:
            raise ValueError(problem)

    def add_request(self, request: Request) -> None:
        """Queue a new request; raises ValueError (RequestIdInUse for a taken id) and changes nothing."""
        self.check_prompt(request.num_prompt_tokens, request.images)
        if request.params.lora_name and not self.config.max_loras:
            raise ValueError(f"lora_name {request.params.lora_name!r}: LoRA adapters are off (--enable-lora)")
        if request.params.n > self.config.max_num_seqs:
            raise ValueError(f"n={request.params.n} is more than max_num_seqs ({self.config.max_num_seqs})")
        self.sample_ids.claim(request.group_id, request.params.n)
        if request.params.n > 1 and not request.child_req_ids:
            request.child_req_ids = sample_ids(request.request_id, request.params.n)[1:]
        request.status = RequestStatus.WAITING
        request.queued_step = self.step_id
        self.requests[request.request_id] = request
        self.groups[request.group_id] = [request]
        bisect.insort(self.waiting, request, key=self._key)
        self.grammar_wait.holds(request.params.structured_output)  # asked for now, compiled while it queues

    def add_resumed_group(self, requests: list[Request]) -> None:
        """Re-admit the unfinished samples of one request (after a restart) to run by recompute.
        Each carries its outputs so far in token_ids; samples already forked come separately."""
        group_id = requests[0].group_id
        for req in requests:
            self.check_prompt(req.num_tokens)
        self.sample_ids.claim(group_id, requests[0].params.n)
        for req in requests:
            req.status = RequestStatus.WAITING
            req.num_computed_tokens = 0
            self.requests[req.request_id] = req
            bisect.insort(self.waiting, req, key=self._key)
        self.groups[group_id] = list(requests)

    def abort(self, group_id: str, sample_index: int | None = None) -> bool:
        """Stop a request (all its samples, or one) and free its blocks now. False if unknown."""
        group = self.groups.get(group_id)
        if group is None:
            return False
        if sample_index is None:
            self._forget(group_id)
        elif any(r.child_req_ids for r in group):
            return False  # its samples have not forked yet: stopping one alone would strand the others
        for req in list(group):
            if not req.status.finished and sample_index in (None, req.sample_index):
                self._finish(req, RequestStatus.FINISHED_ABORTED)
        return True

    def take_failed(self) -> list[tuple[str, Exception]]:
        """(group id, exception) of the groups ended by a fault in their own bookkeeping since the
        last call; they are aborted already (blocks freed): the caller tells their clients."""
        failed, self.failed = self.failed, []
        return failed

    def preempt_all_for_new_session(self, num_gpu_blocks: int, num_cpu_blocks: int) -> int:
        """The workers lost their KV cache (a rank died and was re-initialised): every running or
        swapped request goes back to waiting to resume by recompute from its tokens so far, and the
        block manager starts afresh (its prefix cache described blocks that no longer exist).
        Returns how many requests were preempted."""
        cfg = self.config
        cfg.num_gpu_blocks, cfg.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
        self.block_manager = make_block_manager(cfg.num_gpu_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                                cfg.num_cpu_blocks, cfg.kv_group_windows)
        moved = self.running + self.swapped
        self.running, self.swapped = [], []
        for req in moved + self.waiting:
            req.num_computed_tokens = req.num_inflight_tokens = req.num_pending_samples = req.num_spec_tokens = 0
            req.sent_to_worker = False
        for req in moved:
            req.num_preemptions += 1
            req.status = RequestStatus.WAITING
            bisect.insort(self.waiting, req, key=self._key)
        self.num_preemptions += len(moved)
        self._dropped_ids = []  # the new session knows no request
        self.grammar_wait.forget()  # nor any grammar
        return len(moved)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self, ahead: bool = False) -> SchedulerOutput | None:
        """The next step. ahead: the previous step is still running (its results not yet given to
        update()); see the module docstring. None only when ahead finds nothing to run."""
        self.step_id += 1
        self.needs_sync = False
        out = SchedulerOutput(self.step_id, [], [], {}, finished_req_ids=self._dropped_ids)
        self._dropped_ids = []
        speculate = (self.speculation is not None and not ahead
                     and self.speculation.begin_step(self.requests, len(self.running)))
        draft = self._draft = StepDraft(self.config, self.block_manager, self.waiting, self.running, self.swapped,
                                        self._key, self.step_id, self.speculation if speculate else None)

        decodes, prefills = [], []
        for r in self.running:
            unscheduled = r.num_unscheduled_tokens
            if unscheduled == 1:
                decodes.append(r)
            elif unscheduled > 1:
                prefills.append(r)
        if ahead:
            decodes = [r for r in decodes if not waits_for_result(r, self.config.max_model_len)]
        cfg = self.config
        cap = cfg.long_prefill_token_threshold if cfg.enable_chunked_prefill and cfg.short_prompts_first else 0
        yielding = [] if self.swapped else yielding_prefills(prefills, self.waiting, cap, self.step_id)
        if yielding:
            prefills = [r for r in prefills if r not in yielding]
        preempted = self._schedule_all(decodes + prefills, out, ahead)

        queues = [(self.swapped, draft.swap_in), (self.waiting, draft.admit)]
        if ahead:
            self.needs_sync |= bool(self.swapped)
            queues = queues[1:]
        held = lambda r: self.grammar_wait.holds(r.params.structured_output)  # noqa: E731
        admitted = 0 if preempted else draft.take_from(queues, cap if yielding else None, out, self._fail, held)
        if yielding and admitted:
            for req in yielding:
                req.yielded_step = self.step_id
        elif yielding:  # no short prompt could come in: the long ones run after all
            preempted |= self._schedule_all(yielding, out, ahead)

        out.grammars = self.grammar_wait.take_asks()
        if ahead and not out.num_scheduled_tokens:
            # Nothing could run ahead: no step. Its drops and asks go with the next one.
            self.step_id -= 1
            self._dropped_ids = out.finished_req_ids + self._dropped_ids
            self.grammar_wait.put_back(out.grammars)
            return None
        self.num_preemptions += draft.num_preempted
        self.last_step = count_step(out, draft.decode_ids, len(self.waiting), draft.num_preempted,
                                    preempted, draft.budget, draft.wait_reason)
        draft.close(out)
        return out

    def _schedule_all(self, reqs: list[Request], out: SchedulerOutput, ahead: bool) -> bool:
        """Schedule running requests in order while the budget lasts; True if one was preempted."""
        preempted = False
        for req in reqs:
            if self._draft.budget <= 0:
                break
            if req.status is RequestStatus.RUNNING:
                try:
                    if ahead:
                        self._schedule_ahead(req, out)
                    else:
                        preempted |= not self._schedule_running(req, out)
                except Exception as exc:  # noqa: BLE001 - it fails alone (take_failed)
                    self._fail(req, exc, out)
        return preempted

    # ---- a step's results ---------------------------------------------------------------
    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestUpdate]:
        updates = [RequestUpdate(req, [], True) for req in self._cut_short]
        self._cut_short = []
        self.grammar_wait.ready(result.grammars_ready)
        for req_id, num_tokens in sched.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                # Aborted while the step ran (async scheduling). Had its samples forked there, the
                # worker holds the forks, which this side never registered: it drops them too
                # (unless a new request has claimed those ids since).
                forked = [] if req_id in sched.spec_token_ids else sample_ids(
                    req_id, len(result.sampled.get(req_id) or ()))[1:]
                self._dropped_ids.extend(i for i in forked if i not in self.sample_ids)
                continue
            if req_id in result.failed:  # the worker could not run it (its LoRA adapter did not load)
                self._fail(req, RequestNotServable(result.failed[req_id]))
                continue
            samples = result.sampled.get(req_id)
            spec = sched.spec_token_ids.get(req_id) if sched.spec_token_ids else None
            rejected = self.speculation.settle(req, spec, samples, sched.step_id) if spec is not None else 0
            req.num_computed_tokens += num_tokens - rejected
            req.num_inflight_tokens -= num_tokens
            if req.num_pending_samples and req.num_computed_tokens >= req.num_tokens:
                req.num_pending_samples -= 1  # (the worker's rule: it sampled where the known tokens end)
            try:
                # The KV this step wrote is the prefix cache's whatever becomes of the request: its full blocks
                # go in before its token may finish it (max_tokens 1, a prompt-only request), which frees them.
                # Before a fork, so the samples share it. (A verified row computed its kept proposals.)
                written = min(req.num_computed_tokens, req.num_tokens)
                self.block_manager.cache_full_blocks(req_id, req.token_ids, written, req.params.prefix_salt,
                                                     req.block_extras(self.config.block_size))
                prompt = result.prompt_logprobs.get(req_id)
                if prompt is not None:
                    req.add_prompt_logprobs(prompt.start, prompt.tokens)
                if not samples_any(req.params):  # the prompt only: done once it is computed, nothing sampled
                    if req.num_computed_tokens >= req.num_tokens:
                        self._finish(req, RequestStatus.FINISHED_LENGTH)
                        updates.append(RequestUpdate(req, [], True, first_prompt_logprobs(req),
                                                     pooled_vector(req, result)))
                        continue
                    samples = None
                if samples and spec is not None:
                    updates.append(self._append(req, samples))
                elif samples:  # sample 0 (with the prompt logprobs) ahead of its forks
                    children = self._fork(req, samples[1:]) if len(samples) > 1 or req.child_req_ids else ()
                    updates.append(self._append(req, samples[:1]))
                    updates.extend(self._append(child, [None]) for child in children)
            except Exception as exc:  # noqa: BLE001 - it fails alone (take_failed)
                # The worker forked the samples itself when it sampled: it must drop those too.
                self._fail(req, exc, worker_forked=req.child_req_ids if samples else ())
        if self.failed:
            failed = {group_id for group_id, _ in self.failed}
            updates = [u for u in updates if u.request.group_id not in failed]
        return updates

    def _fork(self, parent: Request, child_samples: list[SampledToken]) -> list[Request]:
        children = fork_children(parent, child_samples)
        for child in children:
            self.block_manager.fork(parent.request_id, child.request_id)
            self.requests[child.request_id] = child
            self.groups[parent.group_id].append(child)
            bisect.insort(self.running, child, key=self._key)
        parent.child_req_ids = []
        return children

    def _append(self, req: Request, samples: Sequence[SampledToken | None]) -> RequestUpdate:
        """The step's tokens of req (a verified row's several, in order), until one ends the sample
        (the rest are cut). [None]: a fork, whose token fork_children gave it."""
        update = None
        for sample in samples:
            more, stop = append_sample(req, sample, self.config.max_model_len)
            if stop is not None:
                self._finish(req, stop)
            if update is None:
                update = more
            else:
                update.new_tokens += more.new_tokens
                update.finished = more.finished
            if update.finished:
                break
        return update

    # ---- one request's fault -------------------------------------------------------------
    def _fail(self, req: Request, exc: Exception, out: SchedulerOutput | None = None,
              worker_forked: Sequence[str] = ()) -> None:
        """req's scheduling (out: the step being built) or its results raised: abort its whole
        group, taking back what this step had given its sequences, so the others go on.
        worker_forked: sample ids the worker created (it forks at its first sampled token) that
        may not have been registered here; the worker is told to drop them."""
        self.failed.append((req.group_id, exc))
        unregistered = [i for i in worker_forked if i not in self.requests]
        if out is not None:
            for r in self.groups.get(req.group_id) or [req]:
                self._draft.take_back(r, out)
        if not self.abort(req.group_id) and not req.status.finished:
            self._finish(req, RequestStatus.FINISHED_ABORTED)
        self._dropped_ids.extend(unregistered)
        if out is not None:  # what it held on the worker is dropped by this same step
            out.finished_req_ids.extend(self._dropped_ids)
            self._dropped_ids.clear()

    def _schedule_ahead(self, req: Request, out: SchedulerOutput) -> None:
        """Schedule a running request in an ahead step: no preemption. Out of blocks, it waits,
        and needs_sync asks for the next step after the results, where preemption can free some."""
        num_new = self._draft.chunk(req.num_unscheduled_tokens, req)
        result = self.block_manager.allocate(req.request_id, req.num_scheduled_tokens, num_new)
        if result is None:
            self.needs_sync = True
            return
        self._draft.record(req, num_new, result, out)

    def _schedule_running(self, req: Request, out: SchedulerOutput) -> bool:
        """Schedule a running request, preempting others if blocks run out. False if anything
        was preempted."""
        num_new = self._draft.chunk(req.num_unscheduled_tokens, req)
        spec = self._draft.proposals(req, num_new)
        preempted = False
        while True:
            result = self.block_manager.allocate(req.request_id, req.num_scheduled_tokens, num_new + len(spec))
            if result is not None:
                break
            if spec:
                spec = []  # no room for the lookahead: a plain decode, before preempting anyone
                continue
            victim = self.running[-1]
            if victim is req and len(self.running) == 1:
                # Alone and still out of blocks: the pool cannot hold this sequence any longer.
                self._finish(req, RequestStatus.FINISHED_LENGTH)
                out.finished_req_ids.extend(self._dropped_ids)
                self._dropped_ids.clear()
                self._cut_short.append(req)
                return False
            self._draft.preempt(victim, out)
            preempted = True
            if victim is req:
                return False
        self._draft.record(req, num_new + len(spec), result, out, spec=spec)
        return not preempted

    def waits_for_speculation(self) -> bool:
        """Whether the step after the running one should wait for its results instead of going
        ahead (Speculation.wants_next_step)."""
        return self.speculation is not None and self.speculation.wants_next_step(self.running, self.config,
                                                                                 self.step_id + 1)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        queue = {RequestStatus.WAITING: self.waiting, RequestStatus.RUNNING: self.running,
                 RequestStatus.SWAPPED: self.swapped}.get(req.status)
        if queue is not None:
            queue.remove(req)
        req.status = status
        self.block_manager.free(req.request_id)
        if req.sent_to_worker:
            self._dropped_ids.append(req.request_id)
        self.requests.pop(req.request_id, None)
        group = self.groups.get(req.group_id)
        if group is not None and all(r.status.finished for r in group) and not any(
                r.child_req_ids for r in group):
            self._forget(req.group_id)

    def _forget(self, group_id: str) -> None:
        group = self.groups.pop(group_id)
        self.sample_ids.release(group_id, group[0].params.n)
