"""The offline API's plain types (`from pagedserve import SamplingParams`), in vLLM's shapes: pure
Python, so `pagedserve.SamplingParams` loads no torch.

SamplingParams here is the engine's (common/sampling_params.py: what the scheduler and worker
read) plus what the text layer does on top, stop strings and special tokens, as the tokenizer
service does for the servers. RequestOutput / CompletionOutput are what LLM.generate returns and
AsyncLLM.generate yields: cumulative (each AsyncLLM output holds everything so far).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.common.messages import SampledToken
from pagedserve.common.request_checks import truncation_problem
from pagedserve.common.sampling_params import SamplingParams as EngineSamplingParams
from pagedserve.common.sampling_params import StructuredOutput
from pagedserve.common.vllm_structured import from_structured_outputs

MAX_STOP_STRINGS = 16


@dataclass(slots=True)
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams (GuidedDecodingParams, its older name): exactly one constraint,
    json (a JSON Schema, a dict or its text), regex, choice, grammar (Lark or GBNF), json_object, or
    structural_tag (its JSON); and vLLM's options, read as the servers read them
    (common/vllm_structured.py)."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    backend: str | None = None

    def to_spec(self, where: str) -> StructuredOutput:
        return from_structured_outputs({name: getattr(self, name) for name in self.__slots__}, where)


GuidedDecodingParams = StructuredOutputsParams


@dataclass(slots=True)
class SamplingParams(EngineSamplingParams):
    """vLLM's SamplingParams: the engine's fields, plus `stop` (a string or a list of them; the
    text ends before the first one unless include_stop_str_in_output) and skip_special_tokens."""
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    bad_words: list[str] | None = None  # never generated (common/bad_words.py)
    truncate_prompt_tokens: int | None = None  # only the prompt's last k tokens are read (-1: the context)
    # vLLM's names for the constraint (the engine's own field: structured_output); either one sets it
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None

    def validate(self) -> None:
        for name in ("structured_outputs", "guided_decoding"):
            given = getattr(self, name)
            if given is None:
                continue
            if not isinstance(given, StructuredOutputsParams):
                raise ValueError(f"{name} must be a StructuredOutputsParams, got {type(given).__name__}")
            spec = given.to_spec(name)
            if self.structured_output is not None and self.structured_output != spec:
                raise ValueError(f"{name} and another constraint are both set: one constraint per request")
            self.structured_output = spec
        EngineSamplingParams.validate(self)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if (not isinstance(self.stop, list) or len(self.stop) > MAX_STOP_STRINGS
                or not all(isinstance(s, str) and s for s in self.stop)):
            raise ValueError(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them, "
                             f"got {self.stop!r}")
        k = self.truncate_prompt_tokens
        if k is not None:  # the range here; against the context when the engine knows it (llm.truncated)
            if not isinstance(k, int) or isinstance(k, bool):
                raise ValueError(f"truncate_prompt_tokens must be an integer, got {k!r}")
            problem = truncation_problem(k, max(k, 1))
            if problem:
                raise ValueError(problem)
        if self.bad_words is not None and not (isinstance(self.bad_words, list)
                                               and all(isinstance(w, str) and w.strip() for w in self.bad_words)):
            raise ValueError(f"bad_words must be a list of words (non-blank strings), got {self.bad_words!r}")


@dataclass(slots=True)
class CompletionOutput:
    """One sample: vLLM's CompletionOutput."""
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[SampledToken] | None = None  # with SamplingParams.logprobs: one entry per token
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running
    stop_reason: str | None = None  # the stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """One prompt's result: vLLM's RequestOutput (prompt, prompt_token_ids, outputs[i])."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None first (nothing predicts
    # it), then each token's logprob, rank and the top k (vLLM's RequestOutput.prompt_logprobs).
    prompt_logprobs: list[SampledToken | None] | None = None


@dataclass(slots=True)
class PoolingParams:
    """vLLM's PoolingParams for LLM.embed: normalize (L2, default on); dimensions (matryoshka
    truncation) is refused: no served model supports it."""
    normalize: bool = True
    dimensions: int | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    """vLLM's EmbeddingOutput: the vector."""
    embedding: list[float]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """One prompt's embedding: vLLM's EmbeddingRequestOutput (request_id, prompt_token_ids,
    outputs.embedding, finished)."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
