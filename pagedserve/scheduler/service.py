"""The scheduler service as a plain class (the gRPC servicer in server.py only translates): start
and stop, admission (submit, validate, attach), leaving and aborting, stats. It owns, and hands
each what it needs through its constructor: the live requests (records.py's LiveGroups), the record writer
(records.py), the stats recorder (stats_recorder.py), health (health.py), and, made at start once
the workers are known, the Scheduler, recovery (recovery.py), the step loop (step_loop.py) and
adoption (adoption.py). Nothing else is shared between them.

Threads: the caller's event loop (gRPC handlers) calls submit/unsubscribe/abort/stats; one
step-loop thread owns the Scheduler (nothing else touches it: other threads hand it commands);
one writer thread writes each step's records to the store and then publishes the step's tokens;
one thread pings the store.

Request ids: a schedule for the id of a live or stored request attaches to it (an idempotent
retry, a resume) when it carries the same prompt and n (or attach=true), and is refused with
ALREADY_EXISTS otherwise; a new request whose id or any of whose sample ids (`<id>#<i>`, see
core/request.py) a live request holds is refused with ALREADY_EXISTS at submit, before it
reaches the step loop (LiveGroups.claim, under its lock).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass

import grpc

from pagedserve.common import request_checks as checks
from pagedserve.common import wire
from pagedserve.common.grpc_util import StatusError
from pagedserve.common.multimodal import check_placements, image_from_proto
from pagedserve.common import structured_output
from pagedserve.common.sampling_params import MAX_LOGPROBS, SamplingParams
from pagedserve.common.settings import step_budgets
from pagedserve.common.speculative import parse_speculative_config
from pagedserve.common.store import RequestStore, StoredRequest
from pagedserve.v1 import scheduler_pb2, worker_pb2
from pagedserve.scheduler.adoption import Adoption
from pagedserve.scheduler.health import Health
from pagedserve.scheduler.records import GroupState, LiveGroups, RecordWriter
from pagedserve.scheduler.recovery import Recovery
from pagedserve.scheduler.stats_log import StatsLog
from pagedserve.scheduler.stats_recorder import StatsRecorder
from pagedserve.scheduler.step_loop import StepLoop
from pagedserve.scheduler.subscriptions import Delivery, Outbox, Subscription
from pagedserve.scheduler.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.scheduler.worker_client import WorkerGroup

log = logging.getLogger("pagedserve.scheduler")
STATS_SNAPSHOT_S = 0.5  # how long one engine-stats snapshot answers every caller


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
    max_logprobs: int = MAX_LOGPROBS  # --max-logprobs (-1: the vocabulary)
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
    # Schedule and send step N+1 while the worker runs step N (--no-async-scheduling turns it off).
    async_scheduling: bool = True
    enable_lora: bool = False
    max_loras: int = 1  # most adapters among the running requests (--max-loras), with enable_lora
    speculative_config: str | None = None  # --speculative-config (common/speculative.py)
    log_stats: bool = True  # the periodic stats line (stats_log.py); --disable-log-stats turns it off


class SchedulerService:
    def __init__(self, config: ServiceConfig, workers: WorkerGroup, store: RequestStore) -> None:
        self.config, self.workers, self.store = config, workers, store
        self.info: worker_pb2.WorkerInfo | None = None
        self.max_model_len = 0
        self.max_logprobs = 0  # the bound --max-logprobs makes, once the workers say the vocabulary
        self.stopping = threading.Event()
        self.live = LiveGroups()  # live requests, until their last tokens are published
        self.writer = RecordWriter(store, self.live.lock, self.live.forget)
        self.recorder = StatsRecorder()  # written by the step loop only
        self.health = Health(store, self.stopping, config.stall_timeout_s, config.store_check_interval_s)
        # Made by start(), once the workers have said what they hold:
        self.scheduler: Scheduler | None = None
        self.recovery: Recovery | None = None
        self.step_loop: StepLoop | None = None
        self.adoption: Adoption | None = None
        # max_steps -> (when, snapshot): the engine stats of the last STATS_SNAPSHOT_S (event loop only)
        self._stats_snapshots: dict[int, tuple[float, scheduler_pb2.EngineStats]] = {}

    @property
    def ready(self) -> bool:
        return self.health.ready

    def unhealthy_cause(self) -> str:
        return self.health.unhealthy_cause()

    # ---- start and stop -------------------------------------------------------------------
    def start(self) -> None:
        """Connect the workers, size and allocate the KV pool, re-admit unfinished requests from
        the store, then run the step loop on its own thread."""
        cfg = self.config
        self.info = self.workers.connect(cfg.worker_timeout_s)
        self.max_model_len = min(self.info.max_model_len, cfg.max_model_len or self.info.max_model_len)
        self.max_logprobs = checks.logprobs_limit(cfg.max_logprobs, self.info.vocab_size)
        budget, long_prefill = step_budgets(cfg.max_num_batched_tokens, cfg.long_prefill_token_threshold,
                                            self.info.device)
        profile = worker_pb2.ProfileRequest(
            block_size=cfg.block_size, kv_cache_memory=cfg.kv_cache_memory or "",
            swap_space=cfg.swap_space if cfg.preemption_mode == "swap" else "",
            max_num_batched_tokens=budget, gpu_memory_utilization=cfg.gpu_memory_utilization)
        sizes = self.workers.init_session(profile)
        self.scheduler = Scheduler(SchedulerConfig(
            num_gpu_blocks=sizes.num_gpu_blocks, block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=budget, max_model_len=self.max_model_len, num_cpu_blocks=sizes.num_cpu_blocks,
            enable_prefix_caching=cfg.enable_prefix_caching, enable_chunked_prefill=cfg.enable_chunked_prefill,
            preemption_mode=cfg.preemption_mode, policy=cfg.policy,
            long_prefill_token_threshold=long_prefill, kv_group_windows=tuple(sizes.kv_group_windows) or (0,),
            max_loras=cfg.max_loras if cfg.enable_lora else 0, whole_images=self.info.whole_images),
            parse_speculative_config(cfg.speculative_config))
        log.info("KV pool: %d blocks of %d tokens (%.1f MiB) on %d rank(s); step budget %d tokens, %d seqs",
                 sizes.num_gpu_blocks, cfg.block_size, sizes.num_gpu_blocks * sizes.bytes_per_block / 2**20,
                 len(self.workers.addresses), budget, cfg.max_num_seqs)
        eos = tuple(self.info.eos_token_ids)
        self.recovery = Recovery(self.store, self.workers, self.scheduler, self.health, self.stopping, profile,
                                 eos, self.max_model_len)
        readmitted = self.recovery.readmit_from_store(self.live)
        self.step_loop = StepLoop(self.scheduler, self.workers, self.live, self.writer, self.recorder,
                                  self.recovery, self.health, self.stopping, eos, cfg.async_scheduling,
                                  readmitted, cfg.orphan_timeout_s, StatsLog() if cfg.log_stats else None)
        self.adoption = Adoption(self.store, self.live, self.recovery, self.step_loop)
        self.step_loop.start()
        self.health.start_store_checks()
        self.health.ready = True

    def stop(self) -> None:
        self.health.ready = False
        self.stopping.set()
        if self.step_loop is not None:
            self.step_loop.stop()
        self.writer.stop()
        self.workers.close()

    # ---- called from the gRPC event loop --------------------------------------------------
    def submit(self, msg: scheduler_pb2.ScheduleRequest, outbox: Outbox,
               tag: int = 0) -> tuple[Subscription, GroupState]:
        """Subscribe `outbox` to a new request, or attach it to a live or stored one; raise
        StatusError for a refusal. Deliveries reach the outbox only after this returns."""
        if not self.ready:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, "the scheduler is starting: the model is still loading")
        request_id = msg.request_id or f"req-{uuid.uuid4().hex}"
        with self.live.lock:
            group = self.live.get(request_id)
            if group is not None:
                if not msg.attach:
                    self._check_same_request(request_id, group.n, group.prompt_token_ids, group.images, msg)
                return self._attach_live(group, outbox, tag), group
        record = self.store.load(request_id) if msg.request_id else None
        if record is not None:
            if not msg.attach:
                self._check_same_request(record.request_id, record.n, record.prompt_token_ids, record.images, msg)
            adopted = self.adoption.adopt(record)  # a dead replica's request resumes here
            if adopted is not None:
                return self._attach_live(adopted, outbox, tag), adopted
            return self._attach_stored(record, outbox, tag)
        if msg.attach:
            raise StatusError(grpc.StatusCode.NOT_FOUND, f"no request {request_id!r} to attach to")
        group = self._validate(request_id, msg)
        if len(self.scheduler.waiting) + self.step_loop.pending_admissions >= self.config.max_waiting_requests:
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the waiting queue is full ({self.config.max_waiting_requests} requests, "
                               "--max-waiting-requests); retry later")
        sub = Subscription(request_id, outbox, replayed=True, tag=tag)
        group.subscribers.append(sub)
        with self.live.lock:
            self.live.claim(group)
        self.step_loop.admit(group)
        return sub, group

    async def check_grammar(self, msg) -> None:
        """A request's grammar checked on a worker thread (seconds for a large one; llguidance releases
        the GIL), so that submit()'s own check on the event loop, which every stream shares, finds it
        cached. StatusError INVALID_ARGUMENT when it does not compile."""
        if not msg.params.HasField("structured_output"):
            return
        spec = wire.structured_output_from_proto(msg.params.structured_output)
        if len(spec.kinds()) != 1:
            return  # submit's validation names the problem
        try:
            await asyncio.to_thread(structured_output.check, spec)
        except ValueError as exc:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None

    def _validate(self, request_id: str, msg: scheduler_pb2.ScheduleRequest) -> GroupState:
        prompt = list(msg.prompt_token_ids)
        vocab = self.info.vocab_size
        max_tokens = msg.params.max_tokens if msg.params.HasField("max_tokens") else None
        problem = (checks.prompt_ids_problem(prompt, vocab)
                   or checks.prompt_tokens_problem(len(prompt), self.max_model_len)
                   or checks.output_room_problem(len(prompt), max_tokens, self.max_model_len))
        if problem:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, problem)
        try:
            params = wire.params_from_proto(msg.params, default_max_tokens=self.max_model_len - len(prompt))
            images = tuple(image_from_proto(image) for image in msg.images)
            self.scheduler.check_prompt(len(prompt), images)
            if params.n > self.config.max_num_seqs:
                raise ValueError(f"n={params.n} is more than max_num_seqs ({self.config.max_num_seqs})")
            problem = (checks.params_vocab_problem(params, vocab)
                       or checks.logprobs_problem(params, self.max_logprobs))
            if problem:
                raise ValueError(problem)
            if params.structured_output is not None:
                structured_output.check(params.structured_output)  # cached per spec
            check_placements(images, len(prompt))
        except ValueError as exc:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        timings = {k: v for k, v in wire.timings_to_dict(msg.timings).items() if v}
        timings["scheduler_received"] = time.time()
        return GroupState(request_id, params.n, prompt, params, msg.priority, timings, [""] * params.n,
                          images=images)

    @staticmethod
    def _check_same_request(request_id: str, n: int, prompt: list[int], images,
                            msg: scheduler_pb2.ScheduleRequest) -> None:
        """A new schedule on a known id attaches only if it asks for the same thing (a retry)."""
        if ((msg.params.n or 1) != n or list(msg.prompt_token_ids) != prompt
                or [image_from_proto(i).hash for i in msg.images] != [i.hash for i in images]):
            raise StatusError(grpc.StatusCode.ALREADY_EXISTS,
                              f"request id {request_id!r} is already in use by another request (another prompt "
                              "or n); use another id, or attach=true to follow that request")

    def _attach_live(self, group: GroupState, outbox: Outbox, tag: int) -> Subscription:
        """A second stream on a running request: replay its tokens so far, then follow it."""
        sub = Subscription(group.group_id, outbox, replayed=False, tag=tag)
        group.subscribers.append(sub)
        self.step_loop.replay(group, sub)
        return sub

    def _attach_stored(self, record: StoredRequest, outbox: Outbox, tag: int) -> tuple[Subscription, GroupState]:
        if record.error:  # it failed: an attach (a resume, a retry) is told so, not "abort"
            code = getattr(grpc.StatusCode, record.error_code, grpc.StatusCode.INTERNAL)
            raise StatusError(code, record.error)
        params = SamplingParams(**record.params)
        group = GroupState(record.request_id, record.n, record.prompt_token_ids, params, record.priority,
                           dict(record.timings), list(record.finish_reasons),
                           num_cached_tokens=record.num_cached_tokens, images=record.images)
        sub = Subscription(record.request_id, outbox, replayed=False, tag=tag)
        # Not live: it finished (or was lost with a scheduler that had no durable store).
        deliveries = [Delivery(i, 0, record.outputs[i] if i < len(record.outputs) else [],
                               finish_reason=record.finish_reasons[i] or "abort", timings=record.timings,
                               num_cached_tokens=record.num_cached_tokens) for i in range(record.n)]
        sub.push((True, deliveries))
        return sub, group

    def unsubscribe(self, sub: Subscription) -> None:
        """A stream ended. The last one to leave an unfinished request aborts it."""
        with self.live.lock:
            group = self.live.get(sub.group_id)
            if group is None or sub not in group.subscribers:
                return
            group.subscribers.remove(sub)
            orphaned = not group.subscribers and not group.done
        if orphaned:
            self.step_loop.abort(group.group_id, None)

    def abort(self, request_id: str, index: int | None = None) -> bool:
        """Stop a live request, or one of its samples; False if there is no such request or sample."""
        with self.live.lock:
            group = self.live.get(request_id)
            found = group is not None and (index is None or 0 <= index < group.n)
        if found:
            self.step_loop.abort(request_id, index)
        return found

    # ---- introspection --------------------------------------------------------------------
    def stats(self) -> scheduler_pb2.SchedulerStats:
        sched = self.scheduler
        if sched is None or self.step_loop is None:
            return scheduler_pb2.SchedulerStats(ready=False, max_waiting_requests=self.config.max_waiting_requests,
                                                unhealthy_cause=self.unhealthy_cause())
        bm = sched.block_manager
        msg = scheduler_pb2.SchedulerStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting) + self.step_loop.pending_admissions,
            num_swapped=len(sched.swapped), num_gpu_blocks=bm.num_total_blocks,
            num_free_gpu_blocks=bm.num_free_blocks, num_cached_blocks=bm.pool.num_cached_free,
            prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits,
            num_preemptions=sched.num_preemptions, ready=self.ready,
            max_waiting_requests=self.config.max_waiting_requests,
            num_worker_recoveries=self.recovery.num_worker_recoveries)
        self.recorder.fill_stats(msg, sched)
        msg.unhealthy_cause = self.unhealthy_cause()
        msg.healthy = not msg.unhealthy_cause
        return msg

    async def engine_stats(self, max_steps: int = 256, timeout_s: float = 4.0) -> scheduler_pb2.EngineStats:
        """A snapshot taken on the step-loop thread between two steps (the only thread that may
        walk the scheduler's queues and the block pool). One snapshot serves every caller asking
        for as many steps within STATS_SNAPSHOT_S: however many gateways and dashboards poll, the
        step loop spends at most a few snapshots a second on them."""
        if self.scheduler is None or self.step_loop is None or not self.step_loop.is_alive():
            return scheduler_pb2.EngineStats(time=time.time(), ready=False)
        cached = self._stats_snapshots.get(max_steps)
        if cached is not None and time.monotonic() - cached[0] < STATS_SNAPSHOT_S:
            return cached[1]
        snapshot = await self._take_engine_stats(max_steps, timeout_s)
        self._stats_snapshots[max_steps] = (time.monotonic(), snapshot)
        return snapshot

    async def _take_engine_stats(self, max_steps: int, timeout_s: float) -> scheduler_pb2.EngineStats:
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
                value, error = self.recorder.engine_stats(self.scheduler, self.ready, self.step_loop.pending_admissions,
                                                          max_steps), None
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                value, error = None, exc
            try:
                loop.call_soon_threadsafe(settle, value, error)
            except RuntimeError:
                pass  # the caller's loop is gone

        self.step_loop.post(take)
        try:
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, "the step loop did not answer in time") from None

    def model_name(self) -> str:
        return os.path.basename(self.info.model.rstrip("/")) if self.info else ""
