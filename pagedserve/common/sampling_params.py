"""Per-request sampling parameters: pure Python, shared by scheduler and worker."""

from __future__ import annotations

from dataclasses import dataclass, field, asdict

# Bounds a server applies to every request; a request outside them is refused at once.
MAX_LOGPROBS = 20
MAX_N = 16


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: sampled token's logprob plus the top k

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def validate(self) -> None:
        def bad(name: str, rule: str) -> None:
            raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            bad("n", f"an integer in [1, {MAX_N}]")
        if not self.temperature >= 0.0:
            bad("temperature", "non-negative")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "-1, 0 (off) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "in [0, 1]")
        if not self.repetition_penalty > 0.0:
            bad("repetition_penalty", "positive")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "in [-2, 2]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "an integer >= 1")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"an integer in [0, max_tokens={self.max_tokens}]")
        if self.logprobs is not None and (not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"an integer in [0, {MAX_LOGPROBS}]")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "an integer")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "a list of non-negative integers")

    def to_dict(self) -> dict:
        return asdict(self)
