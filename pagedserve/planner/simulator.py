"""The planner's simulator: the real Scheduler and BlockManager, stepped in virtual time.

Nothing of the scheduling is re-implemented: requests go through Scheduler.add_request, each step
is Scheduler.schedule() then Scheduler.update() with a ModelRunnerOutput, as LLMEngine.step does;
only the model is replaced. Each request that reaches the end of its known tokens gets one sampled
token (token id 0; ignore_eos, max_tokens = the trace's output length, as `bench serve` asks), and
the step lasts what the cost model says for its shape. Virtual time then moves on by that much.
A request of the trace with a LoRA adapter carries its name, so the scheduler holds a step to
--max-loras adapters as it does when serving, and the step's shape counts its adapted rows and
adapters (the cost model's LoRA term).

The client side is `bench serve`'s: request i is ready at its arrival_s; with --max-concurrency it
is sent when one of the slots frees (first ready, first sent, as asyncio's semaphore does); the
scheduler sees it request_overhead_s after the send (gateway, tokenizer, network) and admits it
before the next step starts, as the scheduler service runs its commands between steps. A token is
the client's when its step ends.

Single-threaded and deterministic: the same trace and config give the same result.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.common.messages import ModelRunnerOutput, SampledToken
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.planner.cost_model import StepShape
from pagedserve.planner.trace import TraceRequest
from pagedserve.scheduler.core.request import Request
from pagedserve.scheduler.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.scheduler.core.step_stats import WAITING_REASONS

SAMPLED_TOKEN = 0
TIE_BREAK_S = 1e-9  # requests admitted at the same instant keep their trace order (FCFS)


@dataclass(slots=True)
class RequestTimeline:
    send_s: float = 0.0
    admit_s: float = 0.0
    token_s: list[float] = field(default_factory=list)  # when each output token reached the client
    finish_s: float | None = None
    cached_tokens: int = 0
    preemptions: int = 0


@dataclass(slots=True)
class StepRecord:
    start_s: float
    duration_s: float
    scheduled: tuple[tuple[str, int], ...]  # (request id, tokens) in the scheduler's batch order
    prefill_tokens: int
    decode_seqs: int
    preemptions: int
    running: int
    waiting: int
    waiting_reason: str | None
    kv_usage: float  # share of the device pool in use after the step was scheduled
    lora_rows: int = 0  # tokens of requests with an adapter
    lora_slots: int = 0  # distinct adapters in the step


@dataclass(slots=True)
class SimResult:
    requests: list[RequestTimeline]
    steps: list[StepRecord]
    duration_s: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_gpu_blocks: int
    waiting_request_seconds: dict[str, float]  # reason -> sum over steps of (requests waiting x step time)


class Simulator:
    def __init__(self, config: SchedulerConfig, step_time: Callable[[StepShape], float],
                 request_overhead_s: float = 0.0, max_concurrency: int | None = None) -> None:
        self.config = config
        self.step_time = step_time
        self.request_overhead_s = request_overhead_s
        self.max_concurrency = max_concurrency

    def run(self, trace: list[TraceRequest]) -> SimResult:
        scheduler = Scheduler(SchedulerConfig(**{name: getattr(self.config, name)
                                                 for name in SchedulerConfig.__dataclass_fields__}))
        order = sorted(range(len(trace)), key=lambda i: (trace[i].arrival_s, i))
        timelines = [RequestTimeline() for _ in trace]
        # Times the free client slots freed at (a heap); a request in flight holds one.
        free_slots = [0.0] * (self.max_concurrency or len(trace) or 1)
        to_send = list(order)  # ready in this order; sent as slots free
        admissions: list[tuple[float, int]] = []  # heap of (admit time, trace index)
        for index in order:
            scheduler.check_prompt(trace[index].prompt_tokens)
        steps: list[StepRecord] = []
        waiting_time = dict.fromkeys(WAITING_REASONS, 0.0)
        now = 0.0
        sent = done = 0

        def send_ready() -> None:
            nonlocal sent
            while sent < len(to_send) and trace[to_send[sent]].arrival_s <= now and free_slots:
                index = to_send[sent]
                send = max(trace[index].arrival_s, heapq.heappop(free_slots))
                timelines[index].send_s = send
                timelines[index].admit_s = send + self.request_overhead_s
                heapq.heappush(admissions, (timelines[index].admit_s, index))
                sent += 1

        def admit() -> None:
            while admissions and admissions[0][0] <= now:
                admit_s, index = heapq.heappop(admissions)
                req = trace[index]
                params = SamplingParams(temperature=0.0, max_tokens=req.output_tokens, ignore_eos=True,
                                        lora_name=req.lora or "")
                scheduler.add_request(Request(f"r{index}", list(req.prompt_token_ids), req.prompt_tokens, params,
                                              arrival_time=admit_s + index * TIE_BREAK_S))

        def next_event() -> float:
            times = [admissions[0][0]] if admissions else []
            if sent < len(to_send) and free_slots:
                times.append(max(trace[to_send[sent]].arrival_s, free_slots[0]))
            if not times:
                raise RuntimeError("the simulation stalled: nothing runs and nothing can arrive")
            return min(times)

        while done < len(trace):
            send_ready()
            admit()
            if not scheduler.has_unfinished():
                now = max(now, next_event())
                continue
            out = scheduler.schedule()
            if not out.num_scheduled_tokens:
                if admissions or (sent < len(to_send) and free_slots):
                    now = max(now, next_event())
                    continue
                raise RuntimeError("the scheduler scheduled nothing with requests waiting and none to come "
                                   "(the KV pool cannot hold them)")
            shape = StepShape()
            sampled: dict[str, list[SampledToken]] = {}
            adapters = set()
            for req_id, num in out.num_scheduled_tokens.items():
                r = scheduler.requests[req_id]
                shape.add(num, r.num_computed_tokens, r.num_tokens, lora=bool(r.params.lora_name))
                if r.params.lora_name:
                    adapters.add(r.params.lora_name)
                if r.num_computed_tokens + num >= r.num_tokens:
                    sampled[req_id] = [SampledToken(SAMPLED_TOKEN)]
            shape.lora_slots = len(adapters)
            stats = scheduler.last_step
            duration = self.step_time(shape)
            steps.append(StepRecord(now, duration, tuple(out.num_scheduled_tokens.items()), shape.prefill_tokens,
                                    shape.decode_seqs, stats.preemptions, len(scheduler.running), stats.waiting,
                                    stats.waiting_reason, scheduler.block_manager.usage(), shape.lora_rows,
                                    shape.lora_slots))
            if stats.waiting and stats.waiting_reason:
                waiting_time[stats.waiting_reason] += stats.waiting * duration
            now += duration
            for update in scheduler.update(out, ModelRunnerOutput(out.step_id, sampled,
                                                                       grammars_ready=[g.key() for g in out.grammars])):
                index = int(update.request.group_id[1:])
                timeline = timelines[index]
                timeline.token_s.extend(now for _ in update.new_tokens)
                if update.finished:
                    timeline.finish_s = now
                    timeline.cached_tokens = update.request.num_cached_tokens
                    timeline.preemptions = update.request.num_preemptions
                    heapq.heappush(free_slots, now)
                    done += 1
            for group_id, exc in scheduler.take_failed():
                raise RuntimeError(f"request {group_id} failed in the scheduler: {exc}") from exc
        bm = scheduler.block_manager
        return SimResult(timelines, steps, max((t.finish_s or 0.0) for t in timelines) if timelines else 0.0,
                         scheduler.num_preemptions, bm.prefix_queries, bm.prefix_hits, bm.num_total_blocks,
                         waiting_time)
