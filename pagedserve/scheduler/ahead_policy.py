"""When the step loop sends the next step before the running one's results are in (async
scheduling), from how long the last decode steps took on the worker.

Sending step N+1 ahead hides the round trip between two steps (the results' way back, the
scheduler's bookkeeping, the next step's way out: ~1.5 ms a step on a 2-core machine) but closes
N+1 to every request that arrives after it is sent: such a request waits for N+2. So:

- behind a short decode step (under SHORT_STEP_S: one stream, small batches) the next step goes
  at once: the round trip is a large part of such a step, and the step is short to wait out;
- behind a longer decode step (a big batch) it goes late: shortly before the step is expected to
  end (LEAD_FRACTION of it: at least 3 ms, several times what scheduling and sending a step take),
  so that requests arriving during the first 85% of the step still join it, as they would without async scheduling. A closed loop of
  clients sends its next request right after a finished one's last token, that is, just after the
  results of one step: sent at once, the ahead step would miss all of them (measured: median TTFT
  2.2-2.7 s against 1.9 s synchronous at concurrency 32, docs/performance.md);
- behind a step with prompt tokens (its time is not predictable from the last decode steps) or
  before any decode step was timed, nothing goes ahead.

A step sent late that finds the running one already finished (it ran faster than predicted) loses
that difference; so the prediction is the shorter of the last two decode steps, and only steps of
about as many sequences as the running one or fewer predict it.

Threads: the step loop's only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedserve.scheduler.core.step_stats import StepStats

SHORT_STEP_S = 0.02
LEAD_FRACTION = 0.15
# A decode step of more sequences than the running one by this factor does not predict it (fewer
# sequences, a shorter step: sent late by that prediction, the next step would start late).
COMPARABLE_SEQS = 1.25


@dataclass(slots=True)
class AheadPolicy:
    # (worker time, sequences) of the last decode steps (no prompt tokens), newest last.
    decode_steps: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=2))
    results_at: float = 0.0  # perf_counter when the last step's results came in

    def took_results(self, stats: StepStats, worker_time_s: float, now: float) -> None:
        """A step's results arrived at `now` (perf_counter)."""
        self.results_at = now
        if not stats.prefill_tokens:
            self.decode_steps.append((worker_time_s, stats.num_seqs))

    def send_at(self, running: StepStats, sent_at: float) -> float | None:
        """When (perf_counter) to send the step after `running`, which was sent at `sent_at`:
        a time already past means now; None means only after its results."""
        if running.prefill_tokens or not self.decode_steps:
            return None
        if min(t for t, _ in self.decode_steps) < SHORT_STEP_S:
            return sent_at
        comparable = [t for t, seqs in self.decode_steps if seqs <= running.num_seqs * COMPARABLE_SEQS]
        if not comparable:
            return None
        predicted = min(comparable)
        # The worker starts a step once the one before it is done: about when that one's results
        # came in here, when it had been sent ahead.
        started = max(sent_at, self.results_at)
        return started + predicted * (1 - LEAD_FRACTION)
