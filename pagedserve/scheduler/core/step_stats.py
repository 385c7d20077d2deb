"""What one scheduled step did (StepStats), counted from the step itself: its tokens split into
decodes and prefill, its preemptions, and why requests were still waiting when admission stopped.
The scheduler's stats, the step loop's timings and the planner's simulator read these.

Threads: the Scheduler's. No pass over the pool or the queues.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.common.messages import SchedulerOutput

WAITING_REASONS = ("no_blocks", "seq_budget", "token_budget")


@dataclass(slots=True)
class StepStats:
    """What one schedule() did, counted as it went (no pass over the pool or the queues).

    waiting_reason says why the admission loop stopped with requests still waiting: every request
    left in the waiting queue stayed there for that reason (admission is first come, first served,
    so the head's reason holds back the rest)."""
    scheduled_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    num_seqs: int = 0
    preemptions: int = 0
    waiting: int = 0
    waiting_reason: str | None = None  # one of WAITING_REASONS when waiting > 0
    prefill_req_ids: tuple[str, ...] = ()  # requests that computed prompt (or recompute) tokens

    def waiting_reasons(self) -> dict[str, int]:
        counts = dict.fromkeys(WAITING_REASONS, 0)
        if self.waiting and self.waiting_reason:
            counts[self.waiting_reason] = self.waiting
        return counts


def count_step(out: SchedulerOutput, decode_ids: set[str], waiting: int, preemptions: int, preempted: bool,
               budget_left: int, wait_reason: str | None) -> StepStats:
    """The stats of the step `out`; decode_ids: its requests scheduled for one decode token;
    wait_reason: why the head of the waiting queue was not admitted (None: it was not tried)."""
    stats = StepStats(num_seqs=len(out.num_scheduled_tokens), preemptions=preemptions, waiting=waiting)
    prefills = []
    for req_id, num in out.num_scheduled_tokens.items():
        if req_id in decode_ids:
            stats.decode_tokens += 1
        else:
            stats.prefill_tokens += num
            prefills.append(req_id)
    stats.scheduled_tokens = stats.prefill_tokens + stats.decode_tokens
    stats.prefill_req_ids = tuple(prefills)
    if stats.waiting:
        # The loop stopped on the head's reason; an empty budget or a preemption (blocks ran
        # out) stopped it before it tried.
        if preempted:
            stats.waiting_reason = "no_blocks"
        elif budget_left <= 0:
            stats.waiting_reason = "token_budget"
        else:
            stats.waiting_reason = wait_reason or "token_budget"
    return stats
