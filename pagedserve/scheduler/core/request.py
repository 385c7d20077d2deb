"""A request as the scheduler sees it: token ids, progress, status; and the ids of its samples.

A request (a group) of n samples runs as n sequences: its own id for sample 0, and
`<id>#<i>` for sample i (forked at the first token). Every one of those ids is the key of the
sequence's block table, so no two live requests may share one (Scheduler.add_request checks).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedserve.common.messages import SampledToken
from pagedserve.common.multimodal import ImageInput
from pagedserve.common.prefix_hashes import image_extras
from pagedserve.common.sampling_params import SamplingParams


class RequestIdInUse(ValueError):
    """A new request's id, or the id of one of its samples, belongs to a live request."""


class RequestNotServable(ValueError):
    """The worker could not run this request for a reason of its own asking (its LoRA adapter does
    not fit the model): the client's mistake, told to it as such (400), not a server fault."""


def sample_ids(group_id: str, n: int) -> list[str]:
    """The sequence ids of a request's n samples: group_id, then group_id#1 .. group_id#(n-1)."""
    return [group_id, *(f"{group_id}#{i}" for i in range(1, n))]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    token_ids: list[int]  # prompt followed by the outputs so far
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0  # lower runs first (vLLM's convention)
    arrival_time: float = field(default_factory=time.monotonic)
    group_id: str = ""  # the id the client knows; samples 1..n-1 of it have their own request_id
    sample_index: int = 0
    child_req_ids: list[str] = field(default_factory=list)  # samples still to fork from this one
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose step's results are in (update)
    # Async scheduling (Scheduler.schedule(ahead=True)): tokens scheduled in steps whose results
    # are not in yet, and how many of those steps will sample a token for it. Both 0 between a
    # step's update and the next schedule, and always with synchronous scheduling.
    num_inflight_tokens: int = 0
    num_pending_samples: int = 0
    num_cached_tokens: int = 0  # prefix-cache hits at its first admission
    # Speculative decoding (speculation.py): proposals riding in the step in flight (a row of
    # 1 + num_spec_tokens tokens), and what its verified rows drafted and accepted so far.
    num_spec_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_preemptions: int = 0
    # Steps (Scheduler.step_id), for short_first.py: the last step scheduled before it was added, the first
    # that scheduled it, the last its prefill chunk left to short prompts.
    queued_step: int = 0
    first_step: int = -1
    yielded_step: int = -1
    sent_to_worker: bool = False  # the worker holds its state (cleared by a recompute preemption)
    logprobs: list[SampledToken] = field(default_factory=list)
    prompt_logprobs: list[SampledToken] = field(default_factory=list)  # positions 1, 2, ... as computed
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    images: tuple[ImageInput, ...] = ()  # a multimodal model's, in prompt order
    _extras: dict[int, bytes] | None = None  # image_extras at the block size, once (block_extras)

    def __post_init__(self) -> None:
        if not self.group_id:
            self.group_id = self.request_id

    def block_extras(self, block_size: int) -> dict[int, bytes] | None:
        """The prefix cache's image keys by block (common/prefix_hashes.image_extras); None without images."""
        if not self.images:
            return None
        if self._extras is None:
            self._extras = image_extras(self.images, block_size)
        return self._extras

    @property
    def image_bytes(self) -> int:
        return sum(len(image.data) for image in self.images)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens computed or in flight: where the next step starts."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def num_unscheduled_tokens(self) -> int:
        """Tokens the next step could run: the known ones, and the ones in-flight steps will sample,
        not yet scheduled."""
        return self.num_tokens + self.num_pending_samples - self.num_scheduled_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def add_prompt_logprobs(self, start: int, tokens: list[SampledToken]) -> None:
        """A chunk's prompt logprobs (tokens[i] at position start + i): keeps each position's first
        copy, so a prompt re-run by a recompute preemption delivers no position twice."""
        wanted = 1 + len(self.prompt_logprobs)
        if start <= wanted < start + len(tokens):
            self.prompt_logprobs.extend(tokens[wanted - start:])

    def sort_key(self) -> tuple[int, float, int]:
        return (self.priority, self.arrival_time, self.sample_index)

    def arrival_key(self) -> tuple[float, int]:
        return (self.arrival_time, self.sample_index)
