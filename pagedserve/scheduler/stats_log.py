"""The scheduler's periodic stats line, vLLM's LoggingStatLogger's: every LOG_INTERVAL_S of steps, the
prompt and generation throughput since the last line, the running and waiting requests, the KV cache's
usage and the prefix cache's hit rate:

    engine: avg prompt throughput: 812.4 tokens/s, avg generation throughput: 233.9 tokens/s, running: 31 reqs,
    waiting: 4 reqs, KV cache usage: 41.2%, prefix cache hit rate: 37.5%

at INFO while tokens flow (or flowed in the last interval), at DEBUG when idle. --disable-log-stats
(vLLM's flag) turns it off.

Threads: the step loop's (it reads the scheduler's queues and pool, as StatsRecorder does).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("pagedserve.scheduler")
LOG_INTERVAL_S = 10.0  # vLLM's VLLM_LOG_STATS_INTERVAL


@dataclass
class StatsLine:
    prompt_tps: float
    generation_tps: float
    running: int
    waiting: int
    kv_usage: float  # 0..1
    prefix_hit_rate: float  # 0..1, of the prompt tokens looked up since the last line

    def text(self) -> str:
        return (f"engine: avg prompt throughput: {self.prompt_tps:.1f} tokens/s, avg generation throughput: "
                f"{self.generation_tps:.1f} tokens/s, running: {self.running} reqs, waiting: {self.waiting} reqs, "
                f"KV cache usage: {100 * self.kv_usage:.1f}%, prefix cache hit rate: {100 * self.prefix_hit_rate:.1f}%")


class StatsLog:
    def __init__(self, interval_s: float = LOG_INTERVAL_S, now: float | None = None) -> None:
        self.interval_s = interval_s
        self.last = time.monotonic() if now is None else now
        self._prompt = self._generation = self._queries = self._hits = 0
        self._was_busy = False

    def line(self, totals, scheduler, waiting_extra: int = 0, now: float | None = None) -> StatsLine | None:
        """The line due at `now` (None before the interval has passed); totals: StatsRecorder.totals."""
        now = time.monotonic() if now is None else now
        elapsed = now - self.last
        if elapsed < self.interval_s:
            return None
        bm = scheduler.block_manager
        queries, hits = bm.prefix_queries - self._queries, bm.prefix_hits - self._hits
        line = StatsLine((totals.prompt_tokens - self._prompt) / elapsed,
                         (totals.generation_tokens - self._generation) / elapsed, len(scheduler.running),
                         len(scheduler.waiting) + waiting_extra,
                         1.0 - bm.num_free_blocks / bm.num_total_blocks if bm.num_total_blocks else 0.0,
                         hits / queries if queries else 0.0)
        self.last, self._prompt, self._generation = now, totals.prompt_tokens, totals.generation_tokens
        self._queries, self._hits = bm.prefix_queries, bm.prefix_hits
        return line

    def maybe_log(self, totals, scheduler, waiting_extra: int = 0, now: float | None = None) -> None:
        line = self.line(totals, scheduler, waiting_extra, now)
        if line is None:
            return
        busy = bool(line.prompt_tps or line.generation_tps)
        log.log(logging.INFO if busy or self._was_busy else logging.DEBUG, "%s", line.text())
        self._was_busy = busy
