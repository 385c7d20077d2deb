"""The scheduler service's step loop (vLLM's EngineCore, beside the service's I/O): admit, step the
workers, publish each step's tokens through the record writer, abort.

Async scheduling (ServiceConfig.async_scheduling, on by default): behind a short decode step
(AHEAD_MAX_STEP_S), step N+1 is scheduled and sent before step N's results are taken in, so the
worker runs it while this thread publishes N's tokens; `inflight` holds the steps sent and not yet
taken in (one or two), oldest first. Not while speculation would propose for a running request
(Scheduler.waits_for_speculation): an ahead step carries no proposals.

Threads: every method here runs on the step-loop thread, the only one that touches the Scheduler;
other threads hand it work through `post` (callables run between two steps). The live groups'
lock guards each group's subscriber list, which the gRPC event loop also reads.

A bad request fails alone: an exception in one request's admission, its scheduling or results,
its publishing, replay or abort ends that request and nothing else; how a request is aborted,
refused or failed is request_endings.py (`endings`). No command's exception ends the step-loop
thread.

Its interface, for the service that owns it (service.py): `start()`, `stop()`, `post(command)`,
`admit(group)`, `replay(group, subscriber)`, `abort(request_id, index)`, `is_alive()` and
`pending_admissions` (admitted, not yet handed to the Scheduler). Everything else it uses comes
through its constructor: the Scheduler, the workers, the live groups (records.py), the record
writer, the stats recorder, recovery and health.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import grpc

from pagedserve.common.grpc_util import StatusError
from pagedserve.common.messages import SchedulerOutput
from pagedserve.common.store import RecordWrite
from pagedserve.scheduler.core.request import Request, RequestIdInUse
from pagedserve.scheduler.core.scheduler import Scheduler
from pagedserve.scheduler.core.step_stats import StepStats
from pagedserve.scheduler.health import Health
from pagedserve.scheduler.records import GroupState, LiveGroups, RecordWriter
from pagedserve.scheduler.recovery import Recovery
from pagedserve.scheduler.request_endings import RequestEndings
from pagedserve.scheduler.stats_log import StatsLog
from pagedserve.scheduler.stats_recorder import MAX_PREFILL_CHUNKS_KEPT, StatsRecorder
from pagedserve.scheduler.subscriptions import Delivery, Subscription
from pagedserve.scheduler.worker_client import WorkerError

log = logging.getLogger("pagedserve.scheduler")


# A step goes ahead only behind a short decode step (the last one's worker time under this): the
# round trip it hides (~1.5 ms on a 2-core machine) is a sizeable part of a step only then. Behind
# a long step (a prefill, a big batch) it saves a few percent at most, while a request that
# arrives during that step misses the step sent ahead and waits a whole step more; at
# concurrency 32 (~70 ms steps) going ahead cost throughput and TTFT (docs/performance.md).
AHEAD_MAX_STEP_S = 0.02


@dataclass(slots=True)
class InFlightStep:
    """A step sent to the workers whose results are not in yet (at most two: async scheduling)."""
    sched: SchedulerOutput
    stats: StepStats  # what schedule() did (its last_step)
    wants_logprobs: set[str]  # requests whose samples carry logprobs
    completing: list[GroupState]  # groups whose prompt this step completes (their prefill_end)
    scheduled_at: float  # wall clock
    schedule_s: float  # the step loop's time on it before it was sent


class StepLoop:
    def __init__(self, scheduler: Scheduler, workers, live: LiveGroups, writer: RecordWriter, recorder: StatsRecorder,
                 recovery: Recovery, health: Health, stopping: threading.Event, eos_token_ids: tuple[int, ...],
                 async_scheduling: bool, readmitted: list[str], orphan_timeout_s: float,
                 stats_log: StatsLog | None = None) -> None:
        """readmitted: the requests re-admitted from the store at start; those no client attaches
        to within orphan_timeout_s are aborted. stats_log: the periodic stats line (None: off)."""
        self.scheduler, self.workers, self.live, self.writer = scheduler, workers, live, writer
        self.recorder, self.recovery, self.health, self.stopping = recorder, recovery, health, stopping
        self.eos_token_ids, self.async_scheduling = eos_token_ids, async_scheduling
        self.readmitted, self.orphan_deadline = readmitted, time.monotonic() + orphan_timeout_s
        self.stats_log = stats_log
        self.endings = RequestEndings(scheduler, live, writer, recorder)  # aborts and failures, on this thread
        self.commands: queue.SimpleQueue = queue.SimpleQueue()  # callables run on the step-loop thread
        self.pending_admissions = 0  # admitted (event loop), not yet handed to the Scheduler
        self.inflight: deque[InFlightStep] = deque()  # sent, results not yet taken in
        self.last_worker_step_s = 0.0  # the worker time of the last step taken in
        self.thread = threading.Thread(target=self._loop, name="step-loop", daemon=True)

    # ---- called from other threads ------------------------------------------------------------
    def start(self) -> None:
        self.health.progress()
        self.thread.start()

    def stop(self) -> None:
        """After `stopping` is set: wake the loop and wait for it to end."""
        self.commands.put(lambda: None)
        self.thread.join(timeout=10)

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def post(self, command) -> None:
        """Run `command` on the step-loop thread, between two steps."""
        self.commands.put(command)

    def admit(self, group: GroupState) -> None:
        """A new request (live already) goes to the Scheduler."""
        self.pending_admissions += 1
        self.commands.put(lambda: self._admit(group))

    def replay(self, group: GroupState, sub: Subscription) -> None:
        """A new subscriber of a live request gets its tokens so far, then follows it."""
        self.commands.put(lambda: self._replay(group, sub))

    def abort(self, request_id: str, index: int | None) -> None:
        self.commands.put(lambda: self.endings.abort(request_id, index))

    # ---- on the step-loop thread --------------------------------------------------------------
    def _loop(self) -> None:
        while not self.stopping.is_set():
            self._run_commands(block=not (self.scheduler.has_unfinished() or self.inflight))
            if self.readmitted and time.monotonic() > self.orphan_deadline:
                self._abort_orphans()
            if self.stopping.is_set() or not (self.scheduler.has_unfinished() or self.inflight):
                self.health.progress()
                continue
            try:
                self._step()
                self.health.progress()
            except WorkerError as exc:
                self.inflight.clear()  # the new session knows none of them
                self.recovery.recover_workers(str(exc))
            except Exception as exc:  # noqa: BLE001 - keep serving; the requests in flight fail loudly
                log.exception("step failed")
                self.endings.fail_all(StatusError(grpc.StatusCode.INTERNAL, f"the engine step failed: {exc}"))

    def _abort_orphans(self) -> None:
        """Requests re-admitted after a restart whose clients went down with the old scheduler:
        nobody re-attached within the grace period, so they stop rather than run for no one."""
        orphans = [rid for rid in self.readmitted if (g := self.live.get(rid)) is not None
                   and not g.subscribers and not g.done]
        self.readmitted = []
        for request_id in orphans:
            self.endings.abort(request_id, None)
        if orphans:
            log.info("aborted %d re-admitted request(s) that no client re-attached to", len(orphans))

    def _run_commands(self, block: bool) -> None:
        waited = time.perf_counter()
        try:
            command = self.commands.get(timeout=0.5) if block else self.commands.get_nowait()
        except queue.Empty:
            return
        finally:
            if block:
                self.recorder.totals.idle_s += time.perf_counter() - waited
        self._run_command(command)
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            self._run_command(command)

    @staticmethod
    def _run_command(command) -> None:
        try:
            command()
        except Exception:  # noqa: BLE001 - the commands blame their own request; this keeps the loop alive
            log.exception("a step-loop command failed")

    def _admit(self, group: GroupState) -> None:
        self.pending_admissions -= 1
        if group.done:
            return
        req = Request(group.group_id, list(group.prompt_token_ids), len(group.prompt_token_ids), group.params,
                      self.eos_token_ids, group.priority, images=group.images)
        try:
            self.scheduler.add_request(req)
        except RequestIdInUse as exc:
            self.endings.end_group(group, StatusError(grpc.StatusCode.ALREADY_EXISTS, str(exc)))
            return
        except ValueError as exc:
            self.endings.end_group(group, StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
            return
        except Exception as exc:  # noqa: BLE001 - this request fails alone
            self.endings.fail_group(group, exc, stored=False)
            return
        try:
            self.recorder.totals.prompt_tokens += len(group.prompt_token_ids)
            self.writer.submit([RecordWrite(group.group_id, group.creation_fields(), created=True)], [])
        except Exception as exc:  # noqa: BLE001 - this request fails alone
            self.endings.fail_group(group, exc, stored=False)

    def _replay(self, group: GroupState, sub: Subscription) -> None:
        try:
            self._replay_to(group, sub)
        except Exception:  # noqa: BLE001 - only this subscriber's replay failed
            log.exception("request %s: replay to a new subscriber failed", group.group_id)
            sub.push(StatusError(grpc.StatusCode.INTERNAL, f"replaying request {group.group_id!r} failed"))

    def _replay_to(self, group: GroupState, sub: Subscription) -> None:
        members = {**group.ended_samples,
                   **{r.sample_index: r for r in self.scheduler.groups.get(group.group_id, [])}}
        deliveries = []
        for index in range(group.n):
            req = members.get(index)
            tokens = req.output_token_ids if req is not None else []
            logprobs = list(req.logprobs) if req is not None and group.params.logprobs is not None else None
            reason = group.finish_reasons[index]
            prompt = self._replayed_prompt_logprobs(group, index, req)
            deliveries.append(Delivery(index, 0, tokens, logprobs, reason,
                                       group.timings_snapshot() if reason else None, group.num_cached_tokens,
                                       prompt))
        self.writer.submit([], [(group, deliveries)], only_to=sub)

    @staticmethod
    def _replayed_prompt_logprobs(group: GroupState, index: int, req: Request | None) -> list | None:
        """The request's prompt logprobs ride with sample 0's replay once they are complete (as
        live, with its first token; a max_tokens 0 request has no token); the subscription's
        filter drops them for a subscriber past that first delivery."""
        if index or req is None or group.params.prompt_logprobs is None:
            return None
        return list(req.prompt_logprobs) if len(req.prompt_logprobs) >= len(group.prompt_token_ids) - 1 else None

    def _step(self) -> None:
        """One step's results taken in. With async scheduling the step after it is scheduled and
        sent first, so that the worker runs it while this thread takes in the results."""
        if not self.inflight:  # (an exception in _take_results may leave the ahead step here)
            self._send_step(self.scheduler.schedule())
        if self.async_scheduling and len(self.inflight) == 1 and not self.scheduler.needs_sync \
                and not self.inflight[0].stats.prefill_tokens and self.last_worker_step_s < AHEAD_MAX_STEP_S \
                and not self.scheduler.waits_for_speculation():
            ahead = self.scheduler.schedule(ahead=True)
            if ahead is not None:
                self._send_step(ahead)
            elif self.scheduler.failed:
                self.endings.end_failed()
        self._take_results(self.inflight.popleft())

    def _send_step(self, sched: SchedulerOutput) -> None:
        started = time.perf_counter()
        if self.scheduler.failed:
            self.endings.end_failed()
        now = time.time()
        requests = self.scheduler.requests
        wants_logprobs = set()
        for req_id in sched.num_scheduled_tokens:
            req = requests[req_id]
            if req.params.logprobs is not None:
                wants_logprobs.add(req_id)
            group = self.live.get(req.group_id)
            if group is not None:
                group.timings.setdefault("first_scheduled", now)
                group.num_preemptions = max(group.num_preemptions, req.num_preemptions)
        stats = self.scheduler.last_step
        completing = []  # groups whose prompt this step completes
        for req_id in stats.prefill_req_ids:
            req = requests[req_id]
            group = self.live.get(req.group_id)
            if group is None or req.sample_index != 0:
                continue
            num = sched.num_scheduled_tokens[req_id]
            group.num_prefill_chunks += 1
            if len(group.prefill_chunks) < MAX_PREFILL_CHUNKS_KEPT:
                group.prefill_chunks.append((now, num))
            if req.num_scheduled_tokens >= req.num_tokens and "prefill_end" not in group.timings:
                completing.append(group)
        self.workers.send(sched)
        self.inflight.append(InFlightStep(sched, stats, wants_logprobs, completing, now,
                                          time.perf_counter() - started))

    def _take_results(self, step: InFlightStep) -> None:
        started = time.perf_counter()
        sched = step.sched
        result, overhead = self.workers.receive(sched, step.wants_logprobs)
        if step.completing:
            returned = time.time()
            for group in step.completing:
                group.timings.setdefault("prefill_end", returned)
        step_worker_time = self.last_worker_step_s = result.forward_time_s + result.sample_time_s
        # A step that ran nothing is the poll while only requests waiting for their grammars are left
        # (scheduler/core/grammar_wait.py): not a step of the stats.
        ran = bool(sched.num_scheduled_tokens)
        if ran:
            self.recorder.worker_step(step_worker_time + overhead, overhead, step_worker_time)
        requests = self.scheduler.requests
        for req_id in sched.num_scheduled_tokens:
            req = requests.get(req_id)
            group = self.live.get(req.group_id) if req is not None else None
            if group is not None and group.last_step_id != sched.step_id:
                group.last_step_id = sched.step_id
                group.worker_time_s += step_worker_time
                group.num_steps += 1
            if group is not None and req_id in sched.spec_token_ids:  # speculative decoding's share
                group.spec_draft_tokens += len(sched.spec_token_ids[req_id])
                group.spec_accepted_tokens += max(0, len(result.sampled.get(req_id) or ()) - 1)
        updates = self.scheduler.update(sched, result)
        if self.scheduler.failed:
            self.endings.end_failed()
        self._publish(updates)
        if ran:
            self.recorder.step(sched.step_id, step.scheduled_at, step.schedule_s + time.perf_counter() - started,
                               step.stats, self.scheduler)
        if self.stats_log is not None:
            self.stats_log.maybe_log(self.recorder.totals, self.scheduler, self.pending_admissions)

    def _publish(self, updates) -> None:
        now = time.time()
        changed: dict[str, tuple[GroupState, RecordWrite, list[Delivery]]] = {}
        done, failed = [], []
        for update in updates:
            req = update.request
            group = self.live.get(req.group_id)
            if group is None or group.done:
                continue
            try:  # free unless it raises (3.11): one try per sample, not per token
                if group.group_id not in changed:
                    changed[group.group_id] = (group, RecordWrite(group.group_id), [])
                _, write, deliveries = changed[group.group_id]
                tokens = [t.token_id for t in update.new_tokens]
                self.recorder.totals.generation_tokens += len(tokens)
                group.output_tokens += len(tokens)
                write.new_tokens.setdefault(req.sample_index, []).extend(tokens)
                if tokens and "first_token" not in group.timings:
                    group.timings["first_token"] = now
                    group.num_cached_tokens = req.num_cached_tokens
                    write.fields["status"] = "running"
                    write.fields["num_cached_tokens"] = str(req.num_cached_tokens)
                    write.fields["timings"] = ""  # filled below, once the step's updates are in
                delivery = Delivery(req.sample_index, req.num_output_tokens - len(tokens), tokens,
                                    list(update.new_tokens) if group.params.logprobs is not None else None,
                                    num_cached_tokens=group.num_cached_tokens,
                                    prompt_logprobs=update.prompt_logprobs, embedding=update.embedding)
                if update.finished:
                    group.ended_samples[req.sample_index] = req
                    group.finish_reasons[req.sample_index] = delivery.finish_reason = req.finish_reason or "stop"
                    if all(group.finish_reasons):
                        group.timings["finished"] = now
                        group.done = True
                        done.append(group)
                        self.recorder.finished(group)
                        write.finished = True
                        write.fields["status"] = "finished"
                    write.fields["finish_reasons"] = json.dumps(group.finish_reasons)
                    write.fields["timings"] = ""
                    delivery.timings = group.timings_snapshot()
                deliveries.append(delivery)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                group.done = True  # its other samples' updates are skipped
                failed.append((group, exc, req.sample_index))
        for group, exc, index in failed:
            # Nothing of this step reaches its client: what it finished here ends as aborted.
            _, _, deliveries = changed.pop(group.group_id, (None, None, ()))
            for i in [index, *(d.index for d in deliveries if d.finish_reason)]:
                group.finish_reasons[i] = ""
            if group in done:
                done.remove(group)
            self.endings.fail_group(group, exc)
        for group, write, _ in changed.values():
            if "timings" in write.fields:
                write.fields["timings"] = json.dumps(group.timings_snapshot())
                write.ttl_samples = group.n
        self.writer.submit([w for _, w, _ in changed.values()], [(g, d) for g, _, d in changed.values()], done)
