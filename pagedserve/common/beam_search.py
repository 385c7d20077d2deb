"""vLLM's beam search (`LLM.beam_search` with BeamSearchParams; the OpenAI API's `use_beam_search`),
as a pure algorithm over each step's top logprobs. Pure Python; the drivers run the steps.

Each step, every live beam asks for its next token's top 2 x beam_width logprobs (a request with
max_tokens 1: the engine's prefix cache holds the beam's tokens, so only its last block is computed
again). Every (beam, token) candidate carries the beam's cumulative logprob plus the token's; one
that ends with EOS (unless ignore_eos) is complete, and of the others the beam_width best by score
go on. After max_tokens steps (or when no beam is left) the completed and the live beams are ranked
by score and the best beam_width are the answer. A beam's score is its cumulative logprob over
len(tokens) ** length_penalty, its tokens the prompt's and the output's with a final EOS not counted
(vLLM's get_beam_search_score). Candidates of a beam come in the step's order (the sampled token
first, then the top ones), and ranking is stable, so ties break as vLLM's do.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def beam_width_problem(beam_width: int, max_logprobs: int) -> str | None:
    """Each step asks for 2 x beam_width logprobs (vLLM's search), so the server's --max-logprobs
    (request_checks.logprobs_limit) bounds the width: the problem as a message, or None."""
    if 2 * beam_width > max_logprobs:
        return (f"a beam width of {beam_width} asks for {2 * beam_width} logprobs a step, more than this server "
                f"allows (--max-logprobs: at most {max_logprobs}): at most {max_logprobs // 2} beams")
    return None


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:  # (its bound: beam_width_problem)
            raise ValueError(f"beam_width must be a positive integer, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature!r}")


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam: vLLM's BeamSearchSequence (tokens: the prompt's and the output's)."""
    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per output token: the step's candidates
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | None = None  # the EOS id that ended it


@dataclass(slots=True)
class BeamSearchOutput:
    """vLLM's BeamSearchOutput: the best beams, best first."""
    sequences: list[BeamSearchSequence]


def beam_score(tokens: list[int], cum_logprob: float, eos_token_id: int | None, length_penalty: float) -> float:
    length = len(tokens) - (1 if eos_token_id is not None and tokens and tokens[-1] == eos_token_id else 0)
    return cum_logprob / (length ** length_penalty)


class BeamSearch:
    """One prompt's search: `live` beams to extend, `step(candidates)` with each live beam's
    (token, logprob) candidates in order, `done`, then `best()`."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_id: int | None) -> None:
        self.params, self.eos = params, eos_token_id
        self.prompt_len = len(prompt_token_ids)
        self.live = [BeamSearchSequence(list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.live or self.steps >= self.params.max_tokens

    def _key(self, beam: BeamSearchSequence) -> float:
        return beam_score(beam.tokens, beam.cum_logprob, self.eos, self.params.length_penalty)

    def step(self, candidates: list[list[tuple[int, float]]]) -> None:
        if len(candidates) != len(self.live):
            raise ValueError(f"{len(candidates)} candidate lists for {len(self.live)} live beams")
        grown = []
        for beam, options in zip(self.live, candidates):
            step = dict(options)
            for token, logprob in step.items():
                new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [step], beam.cum_logprob + logprob)
                if token == self.eos and not self.params.ignore_eos:
                    new.finish_reason, new.stop_reason = "stop", token
                    self.completed.append(new)
                else:
                    grown.append(new)
        self.live = sorted(grown, key=self._key, reverse=True)[:self.params.beam_width]
        self.steps += 1

    def best(self) -> list[BeamSearchSequence]:
        for beam in self.live:
            beam.finish_reason = beam.finish_reason or "length"
        return sorted(self.completed + self.live, key=self._key, reverse=True)[:self.params.beam_width]
