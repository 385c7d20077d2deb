"""Async scheduling inside the model runner (issue 37; vLLM v1's async scheduling with the sampled ids
kept on the device, our own code): a step may begin while the one before it is still in flight.

The engine (engine/llm_engine.py) launches step N, schedules step N+1 ahead (the scheduler counts each
row N samples for as if its token were known: Scheduler.schedule(ahead=True)), begins N+1, and only then
takes N's tokens: on a GPU the host's work for N+1 (scheduling, layout, launches) and for N's results
(stop rules, detokenizing) overlaps the device's work instead of alternating with it.

A row of N+1 whose input token is the one N samples for it gets a held place: `hold_places` appends a
placeholder to its token ids (RequestState.held_at), the layout writes the placeholder, and `feed`
copies N's sampled id into the step's input ids on the device (after the step's one upload, before its
forward; into the graph's padding rows too when row 0 is held: a padding row must compute row 0's own
token, since it writes row 0's slot). N's commit then writes the token in the held place.

`can_follow` says when N+1 cannot begin before N's tokens are on the host: a row whose next step needs
them there — its samples forked at N, it verified proposals at N (a number of tokens only N knows), its
grammar reads its tokens, it is new in N+1 (its state would be replaced) or it runs more than one token —
and whenever proposals are drafted (a draft model reads the tokens). The runner then finishes N first: the
result is the same, without the overlap. Penalties do not stop it: N counts each plain row's sampled id
in the row's device histories as it samples (penalty_counts.py), so N+1 reads it there.

With tensor parallelism rank 0 samples and broadcasts the sampled ids on the device as the step begins
(StepSampling.share, step_sampling.py): every rank holds them there, feeds its held rows from them and takes its
tokens from them at finish, which runs no collective; so the ranks' collectives keep one order however
begins and finishes interleave, and ranks overlap as one does.

Invariants: at most one step is in flight when another begins (depth one: the runner finishes any older
one first); a held place is written by exactly one commit, the in-flight step's, before the step holding
it is finished. Threads: the model runner's torch thread only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.common.messages import ModelRunnerOutput, SchedulerOutput
from pagedserve.worker.sampler import to_device

PLACEHOLDER = 0  # the held place's host value until the commit: never read by the model (fed on the device)


@dataclass(slots=True)
class StepInFlight:
    """A step begun: its result so far (forward and sampling launched) and its sampling under way.
    pending: the step_sampling.PendingTokens (on ranks past 0: of rank 0's broadcast ids), None with
    nothing sampled;
    states: the request states it samples for."""
    result: ModelRunnerOutput
    pending: object | None
    states: list
    done: bool = False

    def ready(self) -> bool:
        """Whether finishing it would not wait for the device (always on the CPU)."""
        return self.done or self.pending is None or self.pending.pending.ready()

    @property
    def sampled_ids(self) -> torch.Tensor:
        """The sampled ids on the device, one per sampler row."""
        return self.pending.pending.token_ids

    def plain_rows(self) -> dict[str, int]:
        """req_id -> its sampler row, for the states whose row samples exactly their next token."""
        p = self.pending
        return {s.req_id: start for s, start, size in zip(p.states, p.starts, p.sizes)
                if size == 1 and not s.child_req_ids and not s.spec_token_ids}


def can_follow(before: StepInFlight, step: SchedulerOutput, runner) -> bool:
    """Whether `step` may begin while `before` is in flight (the module docstring's rules)."""
    if before.done or not before.states:
        return True
    if before.pending is None or runner.drafts:
        return False
    sampled = {s.req_id: s for s in before.states}
    if any(new.req_id in sampled for new in step.new_requests):
        return False
    plain = before.plain_rows()
    constrained = {before.states[i].req_id for i in before.pending.constrained}
    for req_id, n in step.num_scheduled_tokens.items():
        state = sampled.get(req_id)
        if state is None:
            continue
        params = state.params
        if (n != 1 or req_id not in plain or req_id in constrained or req_id in step.spec_token_ids
                or params.structured_output is not None):
            return False
    return True


def hold_places(before: StepInFlight, step: SchedulerOutput, requests) -> dict[str, int]:
    """For each row of `step` whose token `before` samples: a placeholder appended to its token ids
    (after the step's delta: a dropped request has no row) -> req_id: before's sampler row."""
    if before.done or before.pending is None:
        return {}
    plain = before.plain_rows()
    held = {}
    for req_id in step.num_scheduled_tokens:
        row = plain.get(req_id)
        if row is None:
            continue
        state = requests[req_id]
        state.token_ids.append(PLACEHOLDER)
        state.held_at = len(state.token_ids) - 1
        held[req_id] = row
    return held


def feed(input_ids: torch.Tensor, order: list, held: dict[str, int], sampled: torch.Tensor,
         graph_size: int | None) -> None:
    """The held rows' input ids from the step in flight's sampled ids, on the device: decode rows come
    first in `order`; with a decode graph (graph_size) the padding rows past the batch repeat row 0."""
    if sampled.dtype != input_ids.dtype:
        sampled = sampled.to(input_ids.dtype)
    dst, src = [], []
    for row, state in enumerate(order):
        source = held.get(state.req_id)
        if source is not None:
            dst.append(row)
            src.append(source)
    pad = graph_size is not None and dst and dst[0] == 0 and graph_size > len(order)
    if dst == src == list(range(len(dst))):  # the rows where they were (the usual decode step): one copy
        input_ids[:len(dst)].copy_(sampled[:len(dst)])
    else:
        device = input_ids.device
        input_ids.index_copy_(0, to_device(dst, torch.long, device),
                              sampled.index_select(0, to_device(src, torch.long, device)))
    if pad:
        input_ids[len(order):graph_size].copy_(input_ids[0].expand(graph_size - len(order)))
