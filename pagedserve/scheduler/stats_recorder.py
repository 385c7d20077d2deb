"""What the scheduler service records about its steps and requests, as typed records: running
totals and histograms (exported through GetStats and Prometheus), the last steps and the last
finished requests (GetEngineStats, the dashboard).

Threads: written by the step loop only. GetStats reads totals from the gRPC loop (single values,
no iteration); GetEngineStats takes its snapshot on the step loop (see SchedulerService).
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from pagedserve.common import wire
from pagedserve.v1 import scheduler_pb2

STEP_HISTORY = 512       # steps kept for GetEngineStats
RECENT_REQUESTS = 64     # finished requests kept for GetEngineStats
QUEUE_LIST_LIMIT = 256   # ids per queue in GetEngineStats
MAX_PREFILL_CHUNKS_KEPT = 64
STEP_TOKENS_BOUNDS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
UTILIZATION_BOUNDS = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]
STEP_SECONDS_BOUNDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


class StepHistogram:
    """A Prometheus-style histogram kept as plain counts (exported through GetStats)."""

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def to_proto(self, out: scheduler_pb2.HistogramData) -> None:
        out.bounds[:] = self.bounds
        out.counts[:] = self.counts
        out.sum = self.sum


@dataclass(slots=True)
class WaitingCounts:
    """Requests left waiting, by why the admission loop stopped (once per request per step)."""
    no_blocks: int = 0
    seq_budget: int = 0
    token_budget: int = 0

    def add(self, reasons: dict[str, int]) -> None:
        for reason, count in reasons.items():
            setattr(self, reason, getattr(self, reason) + count)


@dataclass(slots=True)
class StepRecord:
    """One step, as GetEngineStats reports it (fields of scheduler_pb2.StepStats)."""
    step: int
    time: float               # when it was scheduled (unix s)
    duration_s: float         # schedule + worker + results
    scheduled_tokens: int
    prefill_tokens: int
    decode_tokens: int
    num_seqs: int
    token_budget: int
    seq_budget: int
    blocks_used: int
    blocks_cached: int
    blocks_free: int
    preemptions: int
    waiting: int
    waiting_reasons: WaitingCounts
    running: int
    swapped: int


@dataclass(slots=True)
class FinishedRecord:
    """A finished request, as GetEngineStats reports it (scheduler_pb2.RecentRequest)."""
    request_id: str
    prompt_tokens: int
    output_tokens: int               # summed over the samples
    finish_reasons: list[str]
    cached_tokens: int
    timings: dict
    prefill_chunks: list[tuple[float, int]]  # the first sample's (scheduled at, tokens)
    adapter: str = ""  # its LoRA adapter ("": the base model)


@dataclass(slots=True)
class Totals:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    steps: int = 0
    worker_busy_s: float = 0.0   # rank 0's forward + sample time
    step_s: float = 0.0          # the steps' wall time at the scheduler
    idle_s: float = 0.0          # the step loop waiting for work
    prefill_tokens: int = 0      # scheduled prompt (and recompute) tokens
    decode_tokens: int = 0
    waiting: WaitingCounts = field(default_factory=WaitingCounts)


class StatsRecorder:
    def __init__(self) -> None:
        self.totals = Totals()
        self.step_overheads: deque[float] = deque(maxlen=1000)  # round trip minus the worker's time
        self.step_times: deque[float] = deque(maxlen=1000)
        self.steps: deque[StepRecord] = deque(maxlen=STEP_HISTORY)
        self.recent: deque[FinishedRecord] = deque(maxlen=RECENT_REQUESTS)
        self.hist_step_tokens = StepHistogram(STEP_TOKENS_BOUNDS)
        self.hist_utilization = StepHistogram(UTILIZATION_BOUNDS)
        self.hist_step_seconds = StepHistogram(STEP_SECONDS_BOUNDS)

    # ---- written by the step loop -----------------------------------------------------------
    def worker_step(self, step_time: float, overhead: float, worker_time: float) -> None:
        self.step_times.append(step_time)
        self.step_overheads.append(overhead)
        self.totals.steps += 1
        self.totals.step_s += step_time
        self.totals.worker_busy_s += worker_time

    def step(self, step_id: int, started: float, duration: float, stats, scheduler) -> None:
        """After the step's results are in: stats is the scheduler's StepStats of it."""
        cfg = scheduler.config
        pool = scheduler.block_manager.pool
        num_free, num_cached = pool.num_free, pool.num_cached_free
        counts = stats.waiting_reasons()
        reasons = WaitingCounts(**counts)
        self.totals.waiting.add(counts)
        self.totals.prefill_tokens += stats.prefill_tokens
        self.totals.decode_tokens += stats.decode_tokens
        self.hist_step_tokens.observe(stats.scheduled_tokens)
        self.hist_utilization.observe(stats.scheduled_tokens / cfg.max_num_batched_tokens)
        self.hist_step_seconds.observe(duration)
        self.steps.append(StepRecord(
            step_id, started, duration, stats.scheduled_tokens, stats.prefill_tokens, stats.decode_tokens,
            stats.num_seqs, cfg.max_num_batched_tokens, cfg.max_num_seqs, pool.num_blocks - num_free, num_cached,
            num_free - num_cached, stats.preemptions, stats.waiting, reasons, len(scheduler.running),
            len(scheduler.swapped)))

    def finished(self, group) -> None:
        self.totals.finished += 1
        self.remember(group)

    def remember(self, group) -> None:
        self.recent.append(FinishedRecord(
            group.group_id, len(group.prompt_token_ids), group.output_tokens, list(group.finish_reasons),
            group.num_cached_tokens, group.timings_snapshot(), list(group.prefill_chunks), group.params.lora_name))

    # ---- read ---------------------------------------------------------------------------------
    def fill_stats(self, msg: scheduler_pb2.SchedulerStats, scheduler) -> None:
        t = self.totals
        msg.prompt_tokens_total, msg.generation_tokens_total = t.prompt_tokens, t.generation_tokens
        msg.num_steps, msg.requests_finished_total = t.steps, t.finished
        msg.worker_busy_seconds_total, msg.step_seconds_total, msg.idle_seconds_total = \
            t.worker_busy_s, t.step_s, t.idle_s
        msg.step_rtt_median_s = statistics.median(self.step_overheads) if self.step_overheads else 0.0
        msg.step_time_median_s = statistics.median(self.step_times) if self.step_times else 0.0
        self.hist_step_tokens.to_proto(msg.step_scheduled_tokens)
        self.hist_utilization.to_proto(msg.step_token_budget_utilization)
        self.hist_step_seconds.to_proto(msg.step_duration_seconds)
        msg.scheduled_prefill_tokens_total = t.prefill_tokens
        msg.scheduled_decode_tokens_total = t.decode_tokens
        msg.waiting_reasons_total.CopyFrom(_waiting_proto(t.waiting))
        cfg = scheduler.config
        msg.max_num_seqs, msg.max_num_batched_tokens = cfg.max_num_seqs, cfg.max_num_batched_tokens
        if scheduler.speculation is not None:
            c = scheduler.speculation.counters
            msg.spec_decode_enabled = True
            msg.spec_decode_num_drafts, msg.spec_decode_num_draft_tokens = c.num_drafts, c.num_draft_tokens
            msg.spec_decode_num_accepted_tokens = c.num_accepted_tokens
            msg.spec_decode_num_accepted_tokens_per_pos[:] = c.accepted_per_pos

    def engine_stats(self, scheduler, ready: bool, num_pending: int, max_steps: int) -> scheduler_pb2.EngineStats:
        """GetEngineStats' message. Walks the queues and the pool: call it on the step loop."""
        cfg, bm = scheduler.config, scheduler.block_manager
        states = bm.pool.block_states()
        msg = scheduler_pb2.EngineStats(
            time=time.time(), ready=ready, num_blocks=len(states), block_states=states,
            config=scheduler_pb2.EngineConfig(
                max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
                block_size=cfg.block_size, num_gpu_blocks=cfg.num_gpu_blocks, max_model_len=cfg.max_model_len,
                num_cpu_blocks=cfg.num_cpu_blocks, preemption_mode=cfg.preemption_mode,
                enable_prefix_caching=cfg.enable_prefix_caching),
            waiting=[r.request_id for r in scheduler.waiting[:QUEUE_LIST_LIMIT]],
            running=[r.request_id for r in scheduler.running[:QUEUE_LIST_LIMIT]],
            swapped=[r.request_id for r in scheduler.swapped[:QUEUE_LIST_LIMIT]],
            num_waiting=len(scheduler.waiting) + num_pending, num_running=len(scheduler.running),
            num_swapped=len(scheduler.swapped))
        for req in scheduler.running:
            msg.tables.add(request_id=req.request_id, block_ids=bm.block_ids(req.request_id))
        max_steps = max(0, min(max_steps, STEP_HISTORY))
        for s in list(self.steps)[-max_steps:] if max_steps else []:
            msg.steps.add(step=s.step, time=s.time, duration_s=s.duration_s, scheduled_tokens=s.scheduled_tokens,
                          prefill_tokens=s.prefill_tokens, decode_tokens=s.decode_tokens, num_seqs=s.num_seqs,
                          token_budget=s.token_budget, seq_budget=s.seq_budget, blocks_used=s.blocks_used,
                          blocks_cached=s.blocks_cached, blocks_free=s.blocks_free, preemptions=s.preemptions,
                          waiting=s.waiting, waiting_reasons=_waiting_proto(s.waiting_reasons), running=s.running,
                          swapped=s.swapped)
        for rec in self.recent:
            entry = msg.recent_requests.add(
                request_id=rec.request_id, prompt_tokens=rec.prompt_tokens, output_tokens=rec.output_tokens,
                finish_reason=rec.finish_reasons[0] if rec.finish_reasons else "",
                finish_reasons=rec.finish_reasons, cached_tokens=rec.cached_tokens, adapter=rec.adapter)
            wire.timings_from_dict(rec.timings, entry.timings)
            for at, tokens in rec.prefill_chunks:
                entry.prefill_chunks.add(time=at, tokens=tokens)
        t = self.totals
        msg.totals.CopyFrom(scheduler_pb2.EngineTotals(
            num_preemptions=scheduler.num_preemptions, prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits, num_steps=t.steps, prompt_tokens=t.prompt_tokens,
            generation_tokens=t.generation_tokens, prefill_tokens=t.prefill_tokens, decode_tokens=t.decode_tokens,
            requests_finished=t.finished, waiting_reasons=_waiting_proto(t.waiting)))
        return msg


def _waiting_proto(w: WaitingCounts) -> scheduler_pb2.WaitingReasons:
    return scheduler_pb2.WaitingReasons(no_blocks=w.no_blocks, seq_budget=w.seq_budget, token_budget=w.token_budget)
