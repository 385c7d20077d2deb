"""Short prompts ahead of a long prefill: the one rule of a step's order that is not first come, first
served.

A long prompt prefills in chunks of at most long_prefill_token_threshold tokens a step (`cap`). A short
prompt that arrives meanwhile would otherwise run in the same step as the long one's next chunk, and a
chunk step costs several times a short prompt's own step (on two CPU cores a 128-token chunk took
~140 ms, a 32-token prompt alone ~42: its time to first token was 5-8x what it is alone).

So when the head of the waiting queue is short (its prompt fits in one chunk) and arrived while a long
prefill was under way (after the step that first scheduled it), the running prefills that began before it
arrived and still have more than a chunk to go leave this step to it: the step runs the decodes and the
short prompts at the head of the queue, and the long chunks go on in the next step. Prompts that were
waiting together keep first come, first served (a batch submitted at once, W64: yielding there cost 3% of
its throughput). A long prefill yields at
most every other step (it yielded in the step before: it runs), so it keeps at least half its pace
whatever arrives; and only when a short prompt is admitted in its place (else it runs in the same
step after all: Scheduler.schedule). Ahead steps (async scheduling) follow the rule too; steps with
swapped requests to bring back keep the usual order.

Pure functions over the scheduler's queues; the scheduler thread only.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.scheduler.core.request import Request


def is_short(req: Request, cap: int) -> bool:
    """Whether the request's prompt (its tokens so far, cached prefix or not) fits in one chunk."""
    return req.num_tokens <= cap


def yielding_prefills(prefills: Sequence[Request], waiting: Sequence[Request], cap: int,
                      step_id: int) -> list[Request]:
    """The running prefills (`prefills`, in the step's order) that leave step `step_id` to the short
    prompt at the head of `waiting`: those first scheduled before it arrived (Request.first_step <= its
    queued_step), with more than one chunk (`cap` tokens) to go, that did not yield in the step before.
    None without a cap (0: chunks as large as the budget) or a short head."""
    if not cap or not waiting or not is_short(waiting[0], cap):
        return []
    arrived = waiting[0].queued_step
    return [r for r in prefills if r.num_unscheduled_tokens > cap and r.yielded_step != step_id - 1
            and 0 <= r.first_step <= arrived]
