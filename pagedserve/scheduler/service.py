"""The scheduler service as a plain class: admission, the step loop, aborts, re-admission.

Threads: the caller's event loop (gRPC handlers) calls submit/unsubscribe/abort; one step-loop
thread owns the Scheduler (nothing else touches it: other threads hand it commands); one writer
thread writes each step's records to the store and then publishes the step's tokens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import statistics
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass

import grpc

from pagedserve.common import wire
from pagedserve.common.grpc_util import StatusError
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.store import RecordWrite, RequestStore, StoredRequest
from pagedserve.v1 import scheduler_pb2, worker_pb2
from pagedserve.scheduler.engine_stats import (
    QUEUE_LIST_LIMIT,
    RECENT_REQUESTS,
    STEP_HISTORY,
    STEP_SECONDS_BOUNDS,
    STEP_TOKENS_BOUNDS,
    UTILIZATION_BOUNDS,
    MAX_PREFILL_CHUNKS_KEPT,
    StepHistogram,
    engine_stats_proto,
)
from pagedserve.scheduler.records import Delivery, GroupState, RecordWriter, Subscription, resumed_requests
from pagedserve.scheduler.core.request import Request
from pagedserve.scheduler.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.scheduler.worker_client import WorkerError, WorkerGroup

log = logging.getLogger("pagedserve.scheduler")

@dataclass(slots=True)
class ServiceConfig:
    block_size: int = 16
    kv_cache_memory: str = ""
    gpu_memory_utilization: float = 0.9
    swap_space: str = "1GiB"
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None  # None: 512 on CPU workers, 2048 on CUDA
    long_prefill_token_threshold: int | None = None
    max_model_len: int | None = None
    preemption_mode: str = "recompute"
    policy: str = "fcfs"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_waiting_requests: int = 1024
    worker_timeout_s: float = 600.0
    orphan_timeout_s: float = 60.0  # re-admitted requests no stream re-attaches to by then are aborted
    step_timeout_s: float = 60.0  # a step with no result by then: the rank counts as dead (recovery)
    stall_timeout_s: float = 30.0  # work pending and no step completed for this long: unhealthy
    store_check_interval_s: float = 1.0  # how often the store (Redis) is pinged


class SchedulerService:
    def __init__(self, config: ServiceConfig, workers: WorkerGroup, store: RequestStore) -> None:
        self.config, self.workers, self.store = config, workers, store
        self.scheduler: Scheduler | None = None
        self.ready = False
        self.info: worker_pb2.WorkerInfo | None = None
        self.max_model_len = 0
        self.groups: dict[str, GroupState] = {}  # live requests, until their last tokens are published
        self.lock = threading.Lock()
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.writer = RecordWriter(store, self.lock, self._forget_group)
        self.pending_admissions = 0
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "finished": 0, "steps": 0,
                         "worker_busy_s": 0.0, "step_s": 0.0, "idle_s": 0.0}
        self.step_overheads: deque[float] = deque(maxlen=1000)
        self.step_times: deque[float] = deque(maxlen=1000)
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.readmitted: list[str] = []
        self.orphan_deadline = 0.0
        # Health: why the engine cannot serve now ("" when it can), as seen by the step loop and
        # the store checker; the stall is computed when asked (the step loop may be stuck).
        self.worker_cause = ""
        self.store_cause = ""
        self.last_progress = time.monotonic()  # the step loop's heartbeat: a step done, or idle
        self.num_worker_recoveries = 0
        # Introspection, written by the step loop only: the last steps, the last finished requests.
        self.step_history: deque[dict] = deque(maxlen=STEP_HISTORY)
        self.recent_requests: deque[dict] = deque(maxlen=RECENT_REQUESTS)
        self.waiting_reasons_total = {"no_blocks": 0, "seq_budget": 0, "token_budget": 0}
        self.scheduled_tokens_total = {"prefill": 0, "decode": 0}
        self.hist_step_tokens = StepHistogram(STEP_TOKENS_BOUNDS)
        self.hist_utilization = StepHistogram(UTILIZATION_BOUNDS)
        self.hist_step_seconds = StepHistogram(STEP_SECONDS_BOUNDS)

    # ---- start and stop -------------------------------------------------------------------
    def start(self) -> None:
        """Connect the workers, size and allocate the KV pool, re-admit unfinished requests from
        the store, then run the step loop on its own thread."""
        cfg = self.config
        self.info = self.workers.connect(cfg.worker_timeout_s)
        self.max_model_len = min(self.info.max_model_len, cfg.max_model_len or self.info.max_model_len)
        budget = cfg.max_num_batched_tokens or (2048 if self.info.device.startswith("cuda") else 512)
        sizes = self.workers.init_session(worker_pb2.ProfileRequest(
            block_size=cfg.block_size, kv_cache_memory=cfg.kv_cache_memory or "",
            swap_space=cfg.swap_space if cfg.preemption_mode == "swap" else "",
            max_num_batched_tokens=budget, gpu_memory_utilization=cfg.gpu_memory_utilization))
        self.scheduler = Scheduler(SchedulerConfig(
            num_gpu_blocks=sizes.num_gpu_blocks, block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=budget, max_model_len=self.max_model_len, num_cpu_blocks=sizes.num_cpu_blocks,
            enable_prefix_caching=cfg.enable_prefix_caching, enable_chunked_prefill=cfg.enable_chunked_prefill,
            preemption_mode=cfg.preemption_mode, policy=cfg.policy,
            long_prefill_token_threshold=budget // 4 if cfg.long_prefill_token_threshold is None
            else cfg.long_prefill_token_threshold))
        log.info("KV pool: %d blocks of %d tokens (%.1f MiB) on %d rank(s); step budget %d tokens, %d seqs",
                 sizes.num_gpu_blocks, cfg.block_size, sizes.num_gpu_blocks * sizes.bytes_per_block / 2**20,
                 len(self.workers.addresses), budget, cfg.max_num_seqs)
        self._readmit_from_store()
        self.last_progress = time.monotonic()
        self.thread = threading.Thread(target=self._loop, name="step-loop", daemon=True)
        self.thread.start()
        threading.Thread(target=self._check_store, name="store-check", daemon=True).start()
        self.ready = True

    def stop(self) -> None:
        self.ready = False
        self.stopping.set()
        self.commands.put(lambda: None)
        if self.thread is not None:
            self.thread.join(timeout=10)
        self.writer.stop()
        self.workers.close()

    def _readmit_from_store(self) -> None:
        eos = tuple(self.info.eos_token_ids)
        readmitted = 0
        for request_id in self.store.active_ids():
            record = self.store.load(request_id)
            if record is None:
                continue
            try:
                params = SamplingParams(**record.params)
                group = GroupState(request_id, record.n, record.prompt_token_ids, params, record.priority,
                                   dict(record.timings), [""] * record.n)
                group.timings.pop("worker_time_s", None)
                requests, reasons = resumed_requests(record, params, eos, self.max_model_len,
                                                     record.timings.get("scheduler_received", time.time()))
                group.finish_reasons = reasons
                if requests and not any(record.outputs):
                    self.scheduler.add_request(requests[0])  # n samples fork from the prompt as usual
                elif requests:
                    self.scheduler.add_resumed_group(requests)
            except (TypeError, ValueError) as exc:
                log.warning("request %s cannot be resumed (%s): marked aborted", request_id, exc)
                requests, group = [], None
            if not requests:
                fields = {"status": "finished"}
                if group is not None:
                    fields["finish_reasons"] = json.dumps(group.finish_reasons)
                self.store.write([RecordWrite(request_id, fields, finished=True)])
                continue
            self.groups[request_id] = group
            self.readmitted.append(request_id)
            readmitted += 1
        self.orphan_deadline = time.monotonic() + self.config.orphan_timeout_s
        if readmitted:
            log.info("re-admitted %d unfinished request(s) from the store; they resume by recompute", readmitted)

    # ---- called from the gRPC event loop --------------------------------------------------
    def submit(self, msg: scheduler_pb2.ScheduleRequest,
               loop: asyncio.AbstractEventLoop) -> tuple[Subscription, GroupState]:
        if not self.ready:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, "the scheduler is starting: the model is still loading")
        request_id = msg.request_id or f"req-{uuid.uuid4().hex}"
        with self.lock:
            group = self.groups.get(request_id)
            if group is not None:
                return self._attach_live(group, loop), group
        record = self.store.load(request_id) if msg.request_id else None
        if record is not None:
            return self._attach_stored(record, loop)
        if msg.attach:
            raise StatusError(grpc.StatusCode.NOT_FOUND, f"no request {request_id!r} to attach to")
        group = self._validate(request_id, msg)
        if len(self.scheduler.waiting) + self.pending_admissions >= self.config.max_waiting_requests:
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the waiting queue is full ({self.config.max_waiting_requests} requests, "
                               "--max-waiting-requests); retry later")
        sub = Subscription(request_id, loop, replayed=True)
        group.subscribers.append(sub)
        with self.lock:
            self.groups[request_id] = group
        self.pending_admissions += 1
        self.commands.put(lambda: self._admit(group))
        return sub, group

    def _validate(self, request_id: str, msg: scheduler_pb2.ScheduleRequest) -> GroupState:
        prompt = list(msg.prompt_token_ids)
        if not prompt:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty: at least one token is needed")
        vocab = self.info.vocab_size
        bad = next((t for t in prompt if t >= vocab), None)
        if bad is not None:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        room = self.max_model_len - len(prompt)
        if room < 1:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"the prompt has {len(prompt)} tokens, but the model's context (max_model_len) "
                               f"is {self.max_model_len} tokens including the output")
        if msg.params.HasField("max_tokens") and msg.params.max_tokens > room:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"this model's maximum context length is {self.max_model_len} tokens; the request "
                               f"asks for {len(prompt) + msg.params.max_tokens} ({len(prompt)} in the prompt, "
                               f"{msg.params.max_tokens} in max_tokens)")
        try:
            params = wire.params_from_proto(msg.params, default_max_tokens=room)
            self.scheduler.check_prompt(len(prompt))
            if params.n > self.config.max_num_seqs:
                raise ValueError(f"n={params.n} is more than max_num_seqs ({self.config.max_num_seqs})")
        except ValueError as exc:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        timings = {k: v for k, v in wire.timings_to_dict(msg.timings).items() if v}
        timings["scheduler_received"] = time.time()
        return GroupState(request_id, params.n, prompt, params, msg.priority, timings, [""] * params.n)

    def _attach_live(self, group: GroupState, loop) -> Subscription:
        """A second stream on a running request: replay its tokens so far, then follow it."""
        sub = Subscription(group.group_id, loop, replayed=False)
        group.subscribers.append(sub)
        self.commands.put(lambda: self._replay(group, sub))
        return sub

    def _attach_stored(self, record: StoredRequest, loop) -> tuple[Subscription, GroupState]:
        params = SamplingParams(**record.params)
        group = GroupState(record.request_id, record.n, record.prompt_token_ids, params, record.priority,
                           dict(record.timings), list(record.finish_reasons),
                           num_cached_tokens=record.num_cached_tokens)
        sub = Subscription(record.request_id, loop, replayed=False)
        # Not live: it finished (or was lost with a scheduler that had no durable store).
        deliveries = [Delivery(i, 0, record.outputs[i] if i < len(record.outputs) else [],
                               finish_reason=record.finish_reasons[i] or "abort", timings=record.timings,
                               num_cached_tokens=record.num_cached_tokens) for i in range(record.n)]
        sub.push((True, deliveries))
        return sub, group

    def unsubscribe(self, sub: Subscription) -> None:
        """A stream ended. The last one to leave an unfinished request aborts it."""
        with self.lock:
            group = self.groups.get(sub.group_id)
            if group is None or sub not in group.subscribers:
                return
            group.subscribers.remove(sub)
            orphaned = not group.subscribers and not group.done
        if orphaned:
            self.commands.put(lambda: self._abort(group.group_id, None))

    def abort(self, request_id: str, index: int | None = None) -> bool:
        with self.lock:
            found = request_id in self.groups
        if found:
            self.commands.put(lambda: self._abort(request_id, index))
        return found

    # ---- the step loop (its own thread) ---------------------------------------------------
    def _loop(self) -> None:
        while not self.stopping.is_set():
            self._run_commands(block=not self.scheduler.has_unfinished())
            if self.readmitted and time.monotonic() > self.orphan_deadline:
                self._abort_orphans()
            if self.stopping.is_set() or not self.scheduler.has_unfinished():
                self.last_progress = time.monotonic()
                continue
            try:
                self._step()
                self.last_progress = time.monotonic()
            except WorkerError as exc:
                self._recover_workers(str(exc))
            except Exception as exc:  # noqa: BLE001 - keep serving; the requests in flight fail loudly
                log.exception("step failed")
                self._fail_all(StatusError(grpc.StatusCode.INTERNAL, f"the engine step failed: {exc}"))

    def _abort_orphans(self) -> None:
        """Requests re-admitted after a restart whose clients went down with the old scheduler:
        nobody re-attached within the grace period, so they stop rather than run for no one."""
        orphans = [rid for rid in self.readmitted if (g := self.groups.get(rid)) is not None
                   and not g.subscribers and not g.done]
        self.readmitted = []
        for request_id in orphans:
            self._abort(request_id, None)
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
                self.counters["idle_s"] += time.perf_counter() - waited
        command()
        while True:
            try:
                self.commands.get_nowait()()
            except queue.Empty:
                return

    def _admit(self, group: GroupState) -> None:
        self.pending_admissions -= 1
        if group.done:
            return
        req = Request(group.group_id, list(group.prompt_token_ids), len(group.prompt_token_ids), group.params,
                      tuple(self.info.eos_token_ids), group.priority)
        try:
            self.scheduler.add_request(req)
        except ValueError as exc:
            self._end_group(group, StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
            return
        self.counters["prompt_tokens"] += len(group.prompt_token_ids)
        self.writer.submit([RecordWrite(group.group_id, group.creation_fields(), created=True)], [])

    def _replay(self, group: GroupState, sub: Subscription) -> None:
        members = {r.sample_index: r for r in self.scheduler.groups.get(group.group_id, [])}
        deliveries = []
        for index in range(group.n):
            req = members.get(index)
            tokens = req.output_token_ids if req is not None else []
            logprobs = list(req.logprobs) if req is not None and group.params.logprobs is not None else None
            reason = group.finish_reasons[index]
            deliveries.append(Delivery(index, 0, tokens, logprobs, reason,
                                       group.timings_snapshot() if reason else None, group.num_cached_tokens))
        self.writer.submit([], [(group, deliveries)], only_to=sub)

    def _step(self) -> None:
        step_started = time.perf_counter()
        sched = self.scheduler.schedule()
        now = time.time()
        requests = self.scheduler.requests
        wants_logprobs = set()
        for req_id in sched.num_scheduled_tokens:
            req = requests[req_id]
            if req.params.logprobs is not None:
                wants_logprobs.add(req_id)
            group = self.groups.get(req.group_id)
            if group is not None:
                group.timings.setdefault("first_scheduled", now)
                group.num_preemptions = max(group.num_preemptions, req.num_preemptions)
        stats = self.scheduler.last_step
        completing = []  # requests whose prompt this step completes: (request, group)
        for req_id in stats.prefill_req_ids:
            req = requests[req_id]
            group = self.groups.get(req.group_id)
            if group is None or req.sample_index != 0:
                continue
            num = sched.num_scheduled_tokens[req_id]
            group.num_prefill_chunks += 1
            if len(group.prefill_chunks) < MAX_PREFILL_CHUNKS_KEPT:
                group.prefill_chunks.append((now, num))
            if req.num_computed_tokens + num >= req.num_tokens and "prefill_end" not in group.timings:
                completing.append(group)
        started = time.perf_counter()
        result, overhead = self.workers.step(sched, wants_logprobs)
        step_time = time.perf_counter() - started
        if completing:
            returned = time.time()
            for group in completing:
                group.timings.setdefault("prefill_end", returned)
        self.step_times.append(step_time)
        self.step_overheads.append(overhead)
        step_worker_time = result.forward_time_s + result.sample_time_s
        self.counters["steps"] += 1
        self.counters["step_s"] += step_time
        self.counters["worker_busy_s"] += step_worker_time
        for req_id in sched.num_scheduled_tokens:
            req = requests.get(req_id)
            group = self.groups.get(req.group_id) if req is not None else None
            if group is not None and group.last_step_id != sched.step_id:
                group.last_step_id = sched.step_id
                group.worker_time_s += step_worker_time
                group.num_steps += 1
        self._publish(self.scheduler.update(sched, result))
        self._record_step(sched.step_id, now, time.perf_counter() - step_started, stats)

    def _record_step(self, step_id: int, started: float, duration: float, stats) -> None:
        sched = self.scheduler
        cfg = sched.config
        pool = sched.block_manager.pool
        num_free, num_cached = pool.num_free, pool.num_cached_free
        reasons = stats.waiting_reasons()
        for reason, count in reasons.items():
            self.waiting_reasons_total[reason] += count
        self.scheduled_tokens_total["prefill"] += stats.prefill_tokens
        self.scheduled_tokens_total["decode"] += stats.decode_tokens
        self.hist_step_tokens.observe(stats.scheduled_tokens)
        self.hist_utilization.observe(stats.scheduled_tokens / cfg.max_num_batched_tokens)
        self.hist_step_seconds.observe(duration)
        self.step_history.append({
            "step": step_id, "time": started, "duration_s": duration, "scheduled_tokens": stats.scheduled_tokens,
            "prefill_tokens": stats.prefill_tokens, "decode_tokens": stats.decode_tokens, "num_seqs": stats.num_seqs,
            "token_budget": cfg.max_num_batched_tokens, "seq_budget": cfg.max_num_seqs,
            "blocks_used": pool.num_blocks - num_free, "blocks_cached": num_cached,
            "blocks_free": num_free - num_cached, "preemptions": stats.preemptions, "waiting": stats.waiting,
            "waiting_reasons": reasons, "running": len(sched.running), "swapped": len(sched.swapped)})

    def _remember_finished(self, group: GroupState) -> None:
        self.recent_requests.append({
            "request_id": group.group_id, "prompt_tokens": len(group.prompt_token_ids),
            "output_tokens": group.output_tokens, "finish_reason": group.finish_reasons[0] if group.finish_reasons
            else "", "finish_reasons": list(group.finish_reasons), "cached_tokens": group.num_cached_tokens,
            "timings": group.timings_snapshot(), "prefill_chunks": list(group.prefill_chunks)})

    def _publish(self, updates) -> None:
        now = time.time()
        changed: dict[str, tuple[GroupState, RecordWrite, list[Delivery]]] = {}
        done = []
        for update in updates:
            req = update.request
            group = self.groups.get(req.group_id)
            if group is None:
                continue
            if group.group_id not in changed:
                changed[group.group_id] = (group, RecordWrite(group.group_id), [])
            _, write, deliveries = changed[group.group_id]
            tokens = [t.token_id for t in update.new_tokens]
            self.counters["generation_tokens"] += len(tokens)
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
                                num_cached_tokens=group.num_cached_tokens)
            if update.finished:
                group.finish_reasons[req.sample_index] = delivery.finish_reason = req.finish_reason or "stop"
                if all(group.finish_reasons):
                    group.timings["finished"] = now
                    group.done = True
                    done.append(group)
                    self.counters["finished"] += 1
                    self._remember_finished(group)
                    write.finished = True
                    write.fields["status"] = "finished"
                write.fields["finish_reasons"] = json.dumps(group.finish_reasons)
                write.fields["timings"] = ""
                delivery.timings = group.timings_snapshot()
            deliveries.append(delivery)
        for group, write, _ in changed.values():
            if "timings" in write.fields:
                write.fields["timings"] = json.dumps(group.timings_snapshot())
                write.ttl_samples = group.n
        self.writer.submit([w for _, w, _ in changed.values()], [(g, d) for g, _, d in changed.values()], done)

    def _abort(self, request_id: str, index: int | None) -> None:
        group = self.groups.get(request_id)
        if group is None or group.done:
            return
        if not self.scheduler.abort(request_id, index) and index is not None:
            return
        now = time.time()
        deliveries = []
        for i in range(group.n) if index is None else [index]:
            if not group.finish_reasons[i]:
                group.finish_reasons[i] = "abort"
                deliveries.append(Delivery(i, 0, [], finish_reason="abort"))
        write = RecordWrite(request_id, {"finish_reasons": json.dumps(group.finish_reasons)})
        if all(group.finish_reasons):
            group.timings["finished"] = now
            group.done = True
            write.fields.update(status="finished", timings=json.dumps(group.timings_snapshot()))
            write.finished = True
            write.ttl_samples = group.n
            self._remember_finished(group)
        for delivery in deliveries:
            delivery.timings = group.timings_snapshot()
        self.writer.submit([write], [(group, deliveries)], [group] if group.done else [])

    def _end_group(self, group: GroupState, error: StatusError) -> None:
        group.done = True
        with self.lock:
            for sub in group.subscribers:
                sub.push(error)
        self.writer.submit([], [], [group])

    def _fail_all(self, error: StatusError) -> None:
        for group in list(self.groups.values()):
            if not group.done:
                self.scheduler.abort(group.group_id)
                self._end_group(group, error)

    def _recover_workers(self, cause: str) -> None:
        """A rank died or hung. Every request is kept (the scheduler holds its tokens so far, the
        store its record): mark the engine unhealthy, wait until every rank answers again (the
        launcher or the container runtime restarts dead ones), open a new session on them (they
        forget every request) and put every request back to waiting to resume by recompute.
        Clients see a pause; tokens already delivered are not sent again."""
        failed_at = time.monotonic()
        self.worker_cause = f"a worker rank is gone ({cause}); waiting for it to come back"
        log.error("%s; keeping %d request(s) in flight until the workers are back", cause,
                  len(self.scheduler.requests))
        self.workers.close_streams()
        attempt = 0
        while not self.stopping.is_set():
            try:
                self.workers.connect(min(5.0 + attempt, 30.0))
                sizes = self.start_session_again()
            except Exception as exc:  # noqa: BLE001 - keep trying until stopped
                attempt += 1
                if attempt == 1 or attempt % 10 == 0:
                    log.warning("workers not back yet: %s", exc)
                time.sleep(0.5)
                continue
            moved = self.scheduler.preempt_all_for_new_session(sizes.num_gpu_blocks, sizes.num_cpu_blocks)
            self.num_worker_recoveries += 1
            self.worker_cause = ""
            self.last_progress = time.monotonic()
            log.info("the workers answer again after %.1f s: %d request(s) resume by recompute (%d were running)",
                     time.monotonic() - failed_at, len(self.scheduler.waiting), moved)
            return

    def start_session_again(self) -> worker_pb2.ProfileResponse:
        """A fresh KV pool on the workers (a new session: they forget every request)."""
        old = self.scheduler.config
        return self.workers.init_session(worker_pb2.ProfileRequest(
            block_size=old.block_size, kv_cache_memory=self.config.kv_cache_memory or "",
            swap_space=self.config.swap_space if old.preemption_mode == "swap" else "",
            max_num_batched_tokens=old.max_num_batched_tokens,
            gpu_memory_utilization=self.config.gpu_memory_utilization))

    # ---- health ---------------------------------------------------------------------------
    def _check_store(self) -> None:
        """Ping the store now and then; an unreachable Redis makes the engine unhealthy."""
        while not self.stopping.wait(self.config.store_check_interval_s):
            ok = self.store.ping()
            if not ok and not self.store_cause:
                log.error("the request store (Redis) does not answer")
            elif ok and self.store_cause:
                log.info("the request store (Redis) answers again")
            self.store_cause = "" if ok else "the request store (Redis) is unreachable"

    def unhealthy_cause(self) -> str:
        """Why the engine cannot serve now, or "" when it can."""
        if not self.ready:
            return "the model is loading" if not self.stopping.is_set() else "the scheduler is stopping"
        causes = [c for c in (self.worker_cause, self.store_cause) if c]
        stalled = time.monotonic() - self.last_progress
        if not self.worker_cause and stalled > self.config.stall_timeout_s:
            causes.append(f"the engine made no progress for {stalled:.0f} s with work pending "
                          f"(--stall-timeout {self.config.stall_timeout_s:g} s)")
        return "; ".join(causes)

    def _forget_group(self, group: GroupState) -> None:
        with self.lock:
            if self.groups.get(group.group_id) is group:
                del self.groups[group.group_id]

    # ---- introspection --------------------------------------------------------------------
    def stats(self) -> scheduler_pb2.SchedulerStats:
        sched = self.scheduler
        if sched is None:
            return scheduler_pb2.SchedulerStats(ready=False, max_waiting_requests=self.config.max_waiting_requests,
                                                unhealthy_cause=self.unhealthy_cause())
        bm = sched.block_manager
        msg = scheduler_pb2.SchedulerStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting) + self.pending_admissions,
            num_swapped=len(sched.swapped), num_gpu_blocks=bm.num_total_blocks,
            num_free_gpu_blocks=bm.num_free_blocks, num_cached_blocks=bm.pool.num_cached_free,
            prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits,
            num_preemptions=sched.num_preemptions, prompt_tokens_total=self.counters["prompt_tokens"],
            generation_tokens_total=self.counters["generation_tokens"], num_steps=self.counters["steps"],
            step_rtt_median_s=statistics.median(self.step_overheads) if self.step_overheads else 0.0,
            step_time_median_s=statistics.median(self.step_times) if self.step_times else 0.0,
            ready=self.ready, max_waiting_requests=self.config.max_waiting_requests,
            requests_finished_total=self.counters["finished"], worker_busy_seconds_total=self.counters["worker_busy_s"],
            step_seconds_total=self.counters["step_s"], idle_seconds_total=self.counters["idle_s"])
        msg.unhealthy_cause = self.unhealthy_cause()
        msg.healthy = not msg.unhealthy_cause
        msg.num_worker_recoveries = self.num_worker_recoveries
        self._fill_stats_extras(msg)
        return msg

    def _fill_stats_extras(self, msg: scheduler_pb2.SchedulerStats) -> None:
        self.hist_step_tokens.to_proto(msg.step_scheduled_tokens)
        self.hist_utilization.to_proto(msg.step_token_budget_utilization)
        self.hist_step_seconds.to_proto(msg.step_duration_seconds)
        msg.scheduled_prefill_tokens_total = self.scheduled_tokens_total["prefill"]
        msg.scheduled_decode_tokens_total = self.scheduled_tokens_total["decode"]
        for reason, count in self.waiting_reasons_total.items():
            setattr(msg.waiting_reasons_total, reason, count)
        cfg = self.scheduler.config
        msg.max_num_seqs, msg.max_num_batched_tokens = cfg.max_num_seqs, cfg.max_num_batched_tokens

    async def engine_stats(self, max_steps: int = 256, timeout_s: float = 4.0) -> scheduler_pb2.EngineStats:
        """A snapshot taken on the step-loop thread between two steps (the only thread that may
        walk the scheduler's queues and the block pool), converted here."""
        if self.scheduler is None or self.thread is None or not self.thread.is_alive():
            return scheduler_pb2.EngineStats(time=time.time(), ready=False)
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(value, error) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)

        def take() -> None:
            try:
                value, error = self._engine_snapshot(max_steps), None
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                value, error = None, exc
            try:
                loop.call_soon_threadsafe(settle, value, error)
            except RuntimeError:
                pass  # the caller's loop is gone

        self.commands.put(take)
        try:
            snap = await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, "the step loop did not answer in time") from None
        return engine_stats_proto(snap)

    def _engine_snapshot(self, max_steps: int) -> dict:
        sched = self.scheduler
        cfg, bm = sched.config, sched.block_manager
        max_steps = max(0, min(max_steps, STEP_HISTORY))
        steps = list(self.step_history)[-max_steps:] if max_steps else []
        return {
            "time": time.time(), "ready": self.ready,
            "config": {"max_num_batched_tokens": cfg.max_num_batched_tokens, "max_num_seqs": cfg.max_num_seqs,
                       "block_size": cfg.block_size, "num_gpu_blocks": cfg.num_gpu_blocks,
                       "max_model_len": cfg.max_model_len, "num_cpu_blocks": cfg.num_cpu_blocks,
                       "preemption_mode": cfg.preemption_mode, "enable_prefix_caching": cfg.enable_prefix_caching},
            "queues": {name: [r.request_id for r in queue[:QUEUE_LIST_LIMIT]]
                       for name, queue in (("waiting", sched.waiting), ("running", sched.running),
                                           ("swapped", sched.swapped))},
            "num_queued": (len(sched.waiting) + self.pending_admissions, len(sched.running), len(sched.swapped)),
            "states": bm.pool.block_states(),
            "tables": [(r.request_id, bm.block_ids(r.request_id)) for r in sched.running],
            "steps": steps, "recent": list(self.recent_requests),
            "totals": {"num_preemptions": sched.num_preemptions, "prefix_cache_queries": bm.prefix_queries,
                       "prefix_cache_hits": bm.prefix_hits, "num_steps": self.counters["steps"],
                       "prompt_tokens": self.counters["prompt_tokens"],
                       "generation_tokens": self.counters["generation_tokens"],
                       "prefill_tokens": self.scheduled_tokens_total["prefill"],
                       "decode_tokens": self.scheduled_tokens_total["decode"],
                       "requests_finished": self.counters["finished"]},
            "waiting_reasons": dict(self.waiting_reasons_total),
        }

    def model_name(self) -> str:
        return os.path.basename(self.info.model.rstrip("/")) if self.info else ""

