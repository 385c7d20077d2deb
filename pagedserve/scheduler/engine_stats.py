"""What the scheduler service reports about its steps: histograms kept as plain counts (exported
through GetStats) and the GetEngineStats message built from a snapshot of the step loop."""

from __future__ import annotations

import bisect

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


def engine_stats_proto(snap: dict) -> scheduler_pb2.EngineStats:
    msg = scheduler_pb2.EngineStats(time=snap["time"], ready=snap["ready"],
                                    config=scheduler_pb2.EngineConfig(**snap["config"]),
                                    waiting=snap["queues"]["waiting"], running=snap["queues"]["running"],
                                    swapped=snap["queues"]["swapped"], num_blocks=len(snap["states"]),
                                    block_states=snap["states"])
    msg.num_waiting, msg.num_running, msg.num_swapped = snap["num_queued"]
    for request_id, block_ids in snap["tables"]:
        msg.tables.add(request_id=request_id, block_ids=block_ids)
    for step in snap["steps"]:
        entry = msg.steps.add(**{k: v for k, v in step.items() if k != "waiting_reasons"})
        for reason, count in step["waiting_reasons"].items():
            setattr(entry.waiting_reasons, reason, count)
    for rec in snap["recent"]:
        entry = msg.recent_requests.add(
            request_id=rec["request_id"], prompt_tokens=rec["prompt_tokens"], output_tokens=rec["output_tokens"],
            finish_reason=rec["finish_reason"], finish_reasons=rec["finish_reasons"],
            cached_tokens=rec["cached_tokens"])
        wire.timings_from_dict(rec["timings"], entry.timings)
        for at, tokens in rec["prefill_chunks"]:
            entry.prefill_chunks.add(time=at, tokens=tokens)
    msg.totals.CopyFrom(scheduler_pb2.EngineTotals(**snap["totals"]))
    for reason, count in snap["waiting_reasons"].items():
        setattr(msg.totals.waiting_reasons, reason, count)
    return msg
