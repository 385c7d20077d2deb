"""What a worker remembers of each request between steps, rebuilt from the scheduler's deltas
alone (new requests once, then only appended or replaced block ids, per KV group; dropped ids). No torch: the
model runner uses it, and so do the tests' fake workers, so the two cannot drift apart.

Invariant: after `apply(step)` the states equal the scheduler's view of its running and swapped
requests (token ids, block tables, computed tokens); `advance` and `commit` then record what the
step computed and sampled (for a row with proposals: what it kept of them). Every state here owns a row of
`tables` (block_table.BlockTables) equal to its block tables: each change to a state's tables below writes
its row too, so the layouts gather rows instead of copying lists. Single-threaded: the runner's (or the
fake worker's) step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pagedserve.common.messages import SchedulerOutput
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.worker.block_table import BlockTables


@dataclass(slots=True)
class RequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    sample_index: int
    child_req_ids: list[str]  # samples 1..n-1 fork from this one at its first sampled token
    group_block_ids: list[list[int]]  # the tables of KV groups 1.. (common/model_config.KVGroups)
    matcher: object | None = None  # structured outputs: its grammar's state (rank 0 only, built lazily)
    pooled: object | None = None  # embeddings: mean's running sum or cls's row (worker/pooling.py)
    # This step's proposals (speculative decoding): the row runs token_ids[-1] and these; commit
    # keeps the accepted ones and takes the rejected slots back from num_computed_tokens.
    spec_token_ids: list[int] | tuple[()] = ()
    # Async scheduling (step_overlap.py): where token_ids holds a place for the token the step in
    # flight samples (-1: none). commit writes the token there instead of appending it.
    held_at: int = -1
    table_row: int = -1  # its row of RequestStates.tables (-1: none, a state laid out from its lists)
    images: tuple = ()  # a multimodal prompt's ImageInputs, in prompt order (common/multimodal.py)
    # image index -> its encoder rows, from the step that first reaches its placeholders until the
    # step that computes its last one (worker/image_rows.py); a resent (preempted) request encodes again
    image_rows: dict | None = None
    # an M-RoPE model's mrope.RopeShifts of its images (worker/mrope.py): set when first laid out; a fork's
    # samples share their parent's
    mrope: object | None = None


class RequestStates(dict[str, RequestState]):
    """req_id -> RequestState, and the block tables' rows (tables) of those states."""

    def __init__(self) -> None:
        super().__init__()
        self.tables = BlockTables()

    def _add(self, state: RequestState) -> None:
        if (old := self.get(state.req_id)) is not None:
            self.tables.release(old)
        self[state.req_id] = state
        self.tables.assign(state)

    def clear(self) -> None:
        super().clear()
        self.tables.clear()

    def apply(self, step: SchedulerOutput, kv_ops: Callable[[SchedulerOutput], None] | None = None) -> None:
        """The step's delta: drop finished ids, run the block operations (kv_ops: swap-outs first,
        their device blocks may be handed to other requests in this same step), add new requests,
        extend or replace the block tables of the others."""
        tables = self.tables
        for req_id in step.finished_req_ids:
            dropped = self.pop(req_id, None)
            if dropped is not None:
                tables.release(dropped)
        if kv_ops is not None:
            kv_ops(step)
        for new in step.new_requests:
            self._add(RequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, new.params, list(new.block_ids),
                new.num_computed_tokens, new.sample_index, list(new.child_req_ids),
                [list(t) for t in new.group_block_ids], images=tuple(new.images)))
        for cached in step.cached_requests:
            state = self.state(cached.req_id)
            if cached.block_ids is not None:
                state.block_ids = list(cached.block_ids)
                state.group_block_ids = [list(t) for t in cached.group_block_ids or ()]
                tables.write(state)
                continue
            if cached.replaced_block is not None:
                index, block_id = cached.replaced_block
                state.block_ids[index] = block_id
                tables.set(state, 0, index, block_id)
            for group, index, block_id in cached.group_replaced:
                state.group_block_ids[group - 1][index] = block_id
                tables.set(state, group, index, block_id)
            if cached.new_block_ids:
                tables.extend(state, 0, len(state.block_ids), cached.new_block_ids)
                state.block_ids.extend(cached.new_block_ids)
            for group, (table, ids) in enumerate(zip(state.group_block_ids, cached.group_new_block_ids), start=1):
                tables.extend(state, group, len(table), ids)
                table.extend(ids)
        for req_id, proposals in step.spec_token_ids.items():
            self.state(req_id).spec_token_ids = proposals

    def state(self, req_id: str) -> RequestState:
        try:
            return self[req_id]
        except KeyError:
            raise KeyError(f"worker has no state for request {req_id!r}: "
                           "it was never sent or already dropped") from None

    def advance(self, scheduled: Iterable[tuple[RequestState, int]]) -> None:
        """The step computed these tokens of these requests."""
        for state, n in scheduled:
            state.num_computed_tokens += n

    def commit(self, sampled: dict[str, list[int]]) -> None:
        """The sampled token ids (one per sample; n at a fork step; a verified row's new tokens):
        forked samples become their own requests, sharing the parent's blocks; each request
        appends its token(s), or writes it where the step after already holds its place. A request
        dropped while its step was in flight (async scheduling) is passed over."""
        for req_id, tokens in sampled.items():
            state = self.get(req_id)
            if state is None:
                continue
            if state.held_at >= 0:  # (a plain row: one token, no proposals, no fork)
                state.token_ids[state.held_at] = tokens[0]
                state.held_at = -1
                continue
            if state.spec_token_ids:  # a verified row: its accepted proposals and the token after them
                state.num_computed_tokens -= len(state.spec_token_ids) - (len(tokens) - 1)
                state.token_ids.extend(tokens)
                state.spec_token_ids = ()
                continue
            for index, (child_id, token) in enumerate(zip(state.child_req_ids, tokens[1:]), start=1):
                self._add(RequestState(
                    child_id, state.token_ids[:state.num_prompt_tokens] + [token], state.num_prompt_tokens,
                    state.params, list(state.block_ids), state.num_computed_tokens, index, [],
                    [list(t) for t in state.group_block_ids], mrope=state.mrope))
            state.child_req_ids = []
            state.token_ids.append(tokens[0])
