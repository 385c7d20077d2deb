"""A simulation's result in `bench serve --json`'s shape: the per-request timings go through bench
serve's own aggregate() (so every key and statistic is computed the same way), then the keys a
run adds (request rate, concurrency, prefix-cache hit rate, the workload's flags), and under
"planner" what only a simulation can see: preemptions, KV usage over time, why requests waited,
the steps' mix. No torch here.
"""

from __future__ import annotations

import math

from pagedserve.bench.serve_client import RequestResult, aggregate
from pagedserve.bench.serve_datasets import BenchRequest
from pagedserve.planner.simulator import SimResult
from pagedserve.planner.trace import TraceRequest

MAX_TIMELINE_POINTS = 200  # KV usage over time, thinned to this many points


def request_results(sim: SimResult, trace: list[TraceRequest]) -> list[RequestResult]:
    results = []
    for timeline, req in zip(sim.requests, trace):
        times = timeline.token_s
        if not times or timeline.finish_s is None:
            results.append(RequestResult(error="the simulation ended before it produced a token"))
            continue
        results.append(RequestResult(success=True, ttft=times[0] - timeline.send_s,
                                     itl=[b - a for a, b in zip(times, times[1:])],
                                     latency=timeline.finish_s - timeline.send_s, output_tokens=len(times),
                                     prompt_tokens=req.prompt_tokens))
    return results


def kv_usage_timeline(sim: SimResult) -> list[list[float]]:
    """[[time s, share of the pool in use], ...] at most MAX_TIMELINE_POINTS, each the peak of its stretch."""
    steps = sim.steps
    if not steps:
        return []
    stride = max(1, math.ceil(len(steps) / MAX_TIMELINE_POINTS))
    return [[round(steps[i].start_s, 4), round(max(s.kv_usage for s in steps[i:i + stride]), 4)]
            for i in range(0, len(steps), stride)]


def planner_extras(sim: SimResult) -> dict:
    steps = sim.steps
    busy = sum(s.duration_s for s in steps)
    mixed = sum(1 for s in steps if s.prefill_tokens and s.decode_seqs)
    return {
        "num_steps": len(steps), "busy_s": busy, "num_preemptions": sim.num_preemptions,
        "num_gpu_blocks": sim.num_gpu_blocks,
        "kv_usage_peak": max((s.kv_usage for s in steps), default=0.0),
        "kv_usage_mean": (sum(s.kv_usage * s.duration_s for s in steps) / busy) if busy else 0.0,
        "kv_usage_over_time": kv_usage_timeline(sim),
        "waiting_request_seconds": sim.waiting_request_seconds,
        "mean_running": (sum(s.running * s.duration_s for s in steps) / busy) if busy else 0.0,
        "mean_waiting": (sum(s.waiting * s.duration_s for s in steps) / busy) if busy else 0.0,
        "steps_with_prefill_and_decode": mixed,
        "mean_step_ms": 1e3 * busy / len(steps) if steps else 0.0,
        "mean_step_tokens": sum(s.prefill_tokens + s.decode_seqs for s in steps) / len(steps) if steps else 0.0,
    }


def bench_json(sim: SimResult, trace: list[TraceRequest], slo_ttft_ms: float | None, slo_tpot_ms: float | None,
               request_rate: float, max_concurrency: int | None, config: dict) -> dict:
    bench_requests = [BenchRequest([], r.prompt_tokens, r.output_tokens) for r in trace]
    result = aggregate(request_results(sim, trace), bench_requests, sim.duration_s, slo_ttft_ms, slo_tpot_ms)
    result["prefix_cache_hit_rate"] = (sim.prefix_cache_hits / sim.prefix_cache_queries
                                       if sim.prefix_cache_queries else None)
    result.update(request_rate="inf" if math.isinf(request_rate) else request_rate, max_concurrency=max_concurrency)
    result.update(config)
    result["planner"] = planner_extras(sim)
    return result
