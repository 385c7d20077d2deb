"""Typed messages that cross the scheduler -> worker boundary, one pair per engine step.

They carry deltas only: a request's prompt goes across once, when the worker first sees it;
afterwards only its new block ids and how many tokens it runs this step.

Block tables: one per KV group (common/model_config.KVGroups). Group 0's travels in the original
fields (block_ids, new_block_ids, replaced_block), groups 1.. in the `group_*` fields, which are
empty for a model with one group. A sliding group's entries for blocks it dropped are id 0 (the
null block) in whole tables; a table the worker already has is not told of drops (attention
never reads those entries unmasked).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.common.multimodal import ImageInput
from pagedserve.common.sampling_params import SamplingParams, StructuredOutput


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    token_ids: list[int]  # prompt, plus outputs so far when resumed after a recompute preemption
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hits: KV already in the first blocks
    sample_index: int = 0  # which of the n samples of its prompt this sequence is (seeds differ)
    child_req_ids: list[str] = field(default_factory=list)  # n > 1: ids of samples 1..n-1, forked on first sample
    group_block_ids: list[list[int]] = field(default_factory=list)  # tables of KV groups 1..
    images: list[ImageInput] = field(default_factory=list)  # a multimodal model's, in prompt order


@dataclass(slots=True)
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]
    replaced_block: tuple[int, int] | None = None  # (index in block table, new block id) after copy-on-write
    block_ids: list[int] | None = None  # whole table again, only after a swap-in
    group_new_block_ids: list[list[int]] = field(default_factory=list)  # KV groups 1..: appended ids
    group_replaced: list[tuple[int, int, int]] = field(default_factory=list)  # (group, index, new id)
    group_block_ids: list[list[int]] | None = None  # KV groups 1..: whole tables, with block_ids


@dataclass(slots=True)
class SchedulerOutput:
    step_id: int
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # every request that runs this step, in batch order
    finished_req_ids: list[str] = field(default_factory=list)  # finished, aborted or preempted: drop state
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    # Speculative decoding: a decode row's proposals (vLLM's scheduled_spec_decode_tokens). Such a
    # row runs 1 + k tokens (num_scheduled_tokens counts them): its last known token, then the k
    # proposals; the worker samples every position and returns the accepted prefix + one token.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Grammars the worker compiles in the background (vLLM's WAITING_FOR_FSM), each sent once: the
    # requests that need one wait, unscheduled, until a result lists it (ModelRunnerOutput.grammars_ready).
    grammars: list[StructuredOutput] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    rank: int | None = None  # prompt logprobs: the token's rank in the vocabulary (1: the top)


@dataclass(slots=True)
class PromptLogprobs:
    """What one step's chunk computed of a request's prompt logprobs: tokens[i] is the prompt
    token at position start + i (start >= 1: position 0 is predicted by nothing)."""
    start: int
    tokens: list[SampledToken]


@dataclass(slots=True)
class ModelRunnerOutput:
    step_id: int
    # Requests whose scheduled tokens reached the end of their known tokens: one entry per sample
    # (n entries for a prompt that forks into n samples on this step, in sample order); for a row
    # with proposals (spec_token_ids), its new tokens in order: the accepted proposals, then one.
    sampled: dict[str, list[SampledToken]]
    forward_time_s: float = 0.0
    sample_time_s: float = 0.0
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # Pooling requests whose prompt this step completed: the pooled vector, float32 little-endian.
    pooled: dict[str, bytes] = field(default_factory=dict)
    # Requests the worker could not run this step, with why (a LoRA adapter that did not load): it
    # computed nothing for them, and the scheduler fails each one alone.
    failed: dict[str, str] = field(default_factory=dict)
    # Keys (StructuredOutput.key()) of the SchedulerOutput.grammars whose compile has ended since the
    # last result, compiled or failed (a failed one ends its requests at their first sample, as before).
    grammars_ready: list[str] = field(default_factory=list)
