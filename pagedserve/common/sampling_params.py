"""Per-request sampling parameters: pure Python, shared by scheduler and worker.

SamplingParams round-trips through JSON (the request records): __post_init__ turns a stored
structured_output dict and logit_bias's string keys back into their types before validating.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, asdict

from pagedserve.common.prefix_hashes import prefix_salt

# Bounds a server applies to every request; a request outside them is refused at once.
MAX_LOGPROBS = 20  # --max-logprobs' default (vLLM's); the server's own bound: request_checks.logprobs_problem
MAX_N = 16
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for each bias: [-100, 100]
MAX_CACHE_SALT = 256  # characters of vLLM's cache_salt
# Entries a request may send: each is work on every step of every sample (OpenAI: 300 logit_bias).
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 300
# vLLM's allowed_token_ids (a mask over the vocabulary) and bad_words (each word up to two token
# sequences: as written and after a space), both work on every step of the row.
MAX_ALLOWED_TOKEN_IDS = 1 << 18
MAX_BAD_WORDS = 100
MAX_BAD_WORD_TOKENS = 64
# A positive temperature below this is raised to it, as vLLM does (its _MAX_TEMP): logits / 1e-300 are
# float32 infinities (inf - inf is NaN in every softmax), where 0.01 is already all but greedy.
MIN_TEMPERATURE = 1e-2


# prompt_logprobs: entries (n x prompt tokens x (k + 1)) one request may ask for; each is a
# TokenLogprob on the wire and in the answer (a full 32k context at k = 20 fits, n = 1).
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 20


def prompt_logprobs_problem(n: int, prompt_tokens: int, k: int | None) -> str | None:
    """Why a request's prompt logprobs are too many (once its prompt is tokenized), or None."""
    if k is None:
        return None
    entries = n * prompt_tokens * (k + 1)
    if entries > MAX_PROMPT_LOGPROB_ENTRIES:
        return (f"prompt_logprobs={k} with n={n} and {prompt_tokens} prompt tokens asks for {entries} entries "
                f"(n x prompt x (k + 1)): at most {MAX_PROMPT_LOGPROB_ENTRIES}")
    return None


def size_problem(logit_bias_entries: int, stop_token_ids: int) -> str | None:
    """Why a request's logit_bias or stop_token_ids are too many (message starting with the
    field's name), or None. SamplingParams.validate and the gateway (before it builds them)."""
    if logit_bias_entries > MAX_LOGIT_BIAS:
        return f"logit_bias has {logit_bias_entries} entries: at most {MAX_LOGIT_BIAS}"
    if stop_token_ids > MAX_STOP_TOKEN_IDS:
        return f"stop_token_ids has {stop_token_ids} ids: at most {MAX_STOP_TOKEN_IDS}"
    return None


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(slots=True)
class StructuredOutput:
    """A constraint on the generated text (the proto's StructuredOutput): exactly one field set.
    The worker compiles it with llguidance (pagedserve/worker/structured_output.py); the gateway
    and the scheduler check it first (pagedserve/common/structured_output.py)."""
    json_schema: str = ""  # a JSON Schema, serialized
    json_object: bool = False  # any JSON object
    regex: str = ""
    choice: list[str] = field(default_factory=list)
    grammar: str = ""  # Lark (llguidance's dialect) or GBNF
    # With a reasoning parser: the text ending the reasoning ("</think>"); the constraint starts
    # after it (vLLM's behaviour). Not a kind: it qualifies the one kind set.
    reasoning_end: str = ""
    # vLLM's structural tag, as JSON: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}:
    # free text, and after a trigger one of the structures (its begin, JSON under its schema, its end).
    structural_tag: str = ""

    def kinds(self) -> list[str]:
        return [name for name in STRUCTURED_KINDS if getattr(self, name)]

    def key(self) -> str:
        """The spec as one string: the cache key of its compiled grammar."""
        kind = self.kinds()[0]
        value = getattr(self, kind)
        return f"{kind}:{json.dumps(value) if kind == 'choice' else value}"


POOLING_TYPES = ("last", "mean", "cls")


@dataclass(slots=True)
class Pooling:
    """An embedding request (vLLM's pooling runner, the proto's Pooling): its prompt's hidden states
    after the model's final norm become one vector (worker/pooling.py): the last token's, the mean
    over the prompt, or the first token's (cls); L2-normalised unless normalize is False."""
    type: str = "last"
    normalize: bool = True

    @property
    def takes_prefix_hits(self) -> bool:
        """Only the last token's state survives a prefix-cache hit (the scheduler always computes
        a prompt's last token); mean and cls read every / the first position's."""
        return self.type == "last"


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
    structured_output: StructuredOutput | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    # None: off; k >= 0: each prompt token's logprob and rank plus the top k at its position
    # (vLLM's prompt_logprobs). Such a request takes no prefix-cache hits: a cached prefix has no logits.
    prompt_logprobs: int | None = None
    # Names the prefix cache's scope (common/prefix_hashes.py): requests share cached blocks only
    # with requests of the same salt. The gateway sets it (the owner and the client's cache_salt).
    cache_salt: str = ""
    # Set: an embedding request, run as a prefill only (max_tokens 0, n 1) that returns the pooled
    # hidden states instead of sampling.
    pooling: Pooling | None = None
    # The LoRA adapter this request runs with (vLLM's LoRARequest, common/lora.py): its name and
    # folder; empty: the base model. The worker loads the folder on first use; the prefix cache
    # keeps each adapter's blocks apart (prefix_salt).
    lora_name: str = ""
    lora_path: str = ""
    # vLLM's allowed_token_ids: only these tokens may be sampled (None: all).
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words, tokenized (common/bad_words.py): a sequence's last token is never sampled
    # where the output so far ends with the rest of the sequence.
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_output, dict):
            self.structured_output = StructuredOutput(**self.structured_output)
        if isinstance(self.pooling, dict):
            self.pooling = Pooling(**self.pooling)
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()} or None
            except (TypeError, ValueError, AttributeError):
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from None
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        self.validate()

    @property
    def prefix_salt(self) -> str:
        """The prefix cache's scope (common/prefix_hashes.py): cache_salt, and the adapter when
        there is one (its KV differs from the base model's for the same tokens)."""
        return prefix_salt(self.cache_salt, self.lora_name, self.lora_path)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def takes_prefix_hits(self) -> bool:
        """A cached prefix computes no logits and no hidden states: a request that reads them
        (prompt logprobs, mean or cls pooling) takes no hits, as vLLM's; it still fills the cache."""
        return self.prompt_logprobs is None and (self.pooling is None or self.pooling.takes_prefix_hits)

    @property
    def reads_outputs(self) -> bool:
        """Whether sampling a row reads its output so far (min_tokens counts it, bad words match its end)."""
        return self.min_tokens > 0 or bool(self.bad_words_token_ids)

    @property
    def masks_tokens(self) -> bool:
        """allowed_token_ids or bad words: the sampler masks the row's logits."""
        return self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

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
        # max_tokens 0: the prompt alone (completions' echo, lm-eval's loglikelihood): it runs its
        # prefill, for its prompt logprobs, and finishes "length" without sampling.
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            bad("max_tokens", "an integer >= 1 (or 0: the prompt only)")
        if self.max_tokens == 0 and self.n != 1:
            raise ValueError(f"max_tokens 0 (the prompt only) needs n=1, got n={self.n}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"an integer in [0, max_tokens={self.max_tokens}]")
        # (their upper bound is the server's --max-logprobs: request_checks.logprobs_problem)
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            bad("logprobs", "an integer >= 0")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or self.prompt_logprobs < 0):
            bad("prompt_logprobs", "an integer >= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "an integer")
        too_many = size_problem(len(self.logit_bias or ()), len(self.stop_token_ids))
        if too_many:
            raise ValueError(too_many)
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "a list of non-negative integers")
        if self.logit_bias is not None:
            for token, bias in self.logit_bias.items():
                if token < 0:
                    raise ValueError(f"logit_bias token id {token} must be non-negative")
                if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                    raise ValueError(f"logit_bias of token {token} must be in [-100, 100], got {bias!r}")
        self._validate_token_masks()
        if not isinstance(self.cache_salt, str) or len(self.cache_salt) > MAX_CACHE_SALT:
            bad("cache_salt", f"a string of at most {MAX_CACHE_SALT} characters")
        if not isinstance(self.lora_name, str) or len(self.lora_name) > 128 or not isinstance(self.lora_path, str):
            bad("lora_name", "a string of at most 128 characters")
        if self.structured_output is not None and len(self.structured_output.kinds()) != 1:
            kinds = self.structured_output.kinds()
            raise ValueError(f"structured_output must set exactly one of {', '.join(STRUCTURED_KINDS)}; "
                             f"got {', '.join(kinds) if kinds else 'none'}")

        if self.pooling is not None:
            if self.pooling.type not in POOLING_TYPES:
                raise ValueError(f"pooling type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling.type!r}")
            if self.max_tokens != 0 or self.n != 1:
                raise ValueError("an embedding (pooling) request runs its prompt only: it needs max_tokens=0 "
                                 f"and n=1, got max_tokens={self.max_tokens}, n={self.n}")

    def _validate_token_masks(self) -> None:
        """(The lists may be long: the message names the rule, not the value.)"""
        allowed = self.allowed_token_ids
        if allowed is not None and (not isinstance(allowed, list) or not allowed
                                    or len(allowed) > MAX_ALLOWED_TOKEN_IDS
                                    or any(not isinstance(t, int) or t < 0 for t in allowed)):
            raise ValueError(f"allowed_token_ids must be a non-empty list of at most {MAX_ALLOWED_TOKEN_IDS} "
                             "non-negative token ids")
        words = self.bad_words_token_ids
        if words is not None and (not isinstance(words, list) or len(words) > 2 * MAX_BAD_WORDS
                                  or any(not isinstance(w, list) or not 0 < len(w) <= MAX_BAD_WORD_TOKENS
                                         or any(not isinstance(t, int) or t < 0 for t in w) for w in words)):
            raise ValueError(f"bad_words must come to at most {2 * MAX_BAD_WORDS} token sequences of 1 to "
                             f"{MAX_BAD_WORD_TOKENS} tokens (at most {MAX_BAD_WORDS} words)")

    def to_dict(self) -> dict:
        return asdict(self)
