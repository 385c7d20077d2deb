"""The request checks against the served model, written once: a prompt's length and max_tokens
against the context, token ids (prompt, logit_bias) against the vocabulary, and how many logprobs
a request asks for against the server's --max-logprobs.

Every function is pure and answers the problem as a message (None when there is none); the
caller wraps it in its own error (the gateway's HTTP 400 naming the field, gRPC's
INVALID_ARGUMENT, the scheduler's StatusError, the engine's ValueError). Callers: the gateway's
REST path (gateway/completion_call.py, gateway/tokenization.py), its gRPC path
(gateway/grpc_api.request_problem), the scheduler service (scheduler/service._validate, for
what reaches it without the gateway) and the scheduler core (Scheduler.check_prompt).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pagedserve.common.sampling_params import MAX_LOGPROBS

# No tokenizer makes a token of more characters than this on real text; a prompt of more than
# max_model_len times it cannot fit the context, and is refused before anyone tokenizes it.
MAX_CHARS_PER_TOKEN = 64


def prompt_chars_problem(gen: Any, max_model_len: int) -> str | None:
    """Why a GenerateRequest's text cannot fit the context, counted in characters before any
    tokenization (a multi-megabyte prompt must not hold the tokenizer), or None."""
    kind = gen.WhichOneof("input")
    if kind == "prompt":
        chars = len(gen.prompt)
    elif kind == "chat":
        chars = sum(len(m.content) + len(m.role) + sum(len(p.text) for p in m.parts) for m in gen.chat.messages)
    else:
        return None
    bound = max_model_len * MAX_CHARS_PER_TOKEN
    if chars > bound:
        return (f"the prompt has {chars} characters: more than the context of {max_model_len} tokens can hold "
                f"(at most {bound} characters are tokenized)")
    return None


def truncation_problem(value: int | None, max_model_len: int) -> str | None:
    """Why vLLM's truncate_prompt_tokens cannot be honoured (-1: the context; k >= 1: the prompt's
    last k tokens, k at most the context), or None."""
    if value is None or value == -1 or 1 <= value <= max_model_len:
        return None
    if value > max_model_len:
        return (f"truncate_prompt_tokens={value} is greater than the model's maximum context length of "
                f"{max_model_len} tokens")
    return f"truncate_prompt_tokens must be -1 (the context) or a positive number of tokens, got {value}"


def max_tokens_problem(max_tokens: int | None, max_model_len: int, name: str = "max_tokens") -> str | None:
    """Why max_tokens alone cannot fit the context (before the prompt is tokenized), or None."""
    if max_tokens is not None and max_tokens > max_model_len:
        return f"{name}={max_tokens} exceeds the model's maximum context length of {max_model_len} tokens"
    return None


def prompt_tokens_problem(num_prompt_tokens: int, max_model_len: int) -> str | None:
    """Why a tokenized prompt leaves no room in the context (empty, or no token left for output)."""
    if num_prompt_tokens < 1:
        return "the prompt is empty: at least one token is needed"
    if num_prompt_tokens >= max_model_len:
        return (f"the prompt has {num_prompt_tokens} tokens, but the model's context (max_model_len) "
                f"is {max_model_len} tokens including the output")
    return None


def output_room_problem(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> str | None:
    """Why prompt + max_tokens overflow the context, or None (max_tokens None: up to the context)."""
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        return (f"this model's maximum context length is {max_model_len} tokens; the request asks for "
                f"{num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the prompt, {max_tokens} in max_tokens)")
    return None


def prompt_ids_problem(prompt_token_ids: Iterable[int], vocab_size: int) -> str | None:
    """The first prompt token id outside the vocabulary, as a message, or None."""
    bad = next((t for t in prompt_token_ids if t >= vocab_size), None)
    return None if bad is None else f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})"


def logit_bias_problem(logit_bias: Iterable[int] | None, vocab_size: int) -> str | None:
    """The lowest logit_bias token id outside the vocabulary, as a message, or None."""
    bad = min((t for t in logit_bias or () if t >= vocab_size), default=None)
    return None if bad is None else f"logit_bias token id {bad} is outside the vocabulary [0, {vocab_size})"


def params_vocab_problem(params, vocab_size: int) -> str | None:
    """The first token id of logit_bias, allowed_token_ids or bad_words outside the vocabulary, as a
    message starting with the field's name, or None. params: a SamplingParams or its proto."""
    problem = logit_bias_problem(params.logit_bias, vocab_size)
    if problem:
        return problem
    bad = next((t for t in params.allowed_token_ids or () if t >= vocab_size), None)
    if bad is not None:
        return f"allowed_token_ids token id {bad} is outside the vocabulary [0, {vocab_size})"
    for word in params.bad_words_token_ids or ():
        bad = next((t for t in getattr(word, "ids", word) if t >= vocab_size), None)
        if bad is not None:
            return f"bad_words token id {bad} is outside the vocabulary [0, {vocab_size})"
    return None


def logprobs_limit(max_logprobs: int, vocab_size: int) -> int:
    """The most logprobs a request may ask for: --max-logprobs (vLLM's; -1: the vocabulary), never
    more than the vocabulary holds."""
    return vocab_size if max_logprobs < 0 else min(max_logprobs, vocab_size)


def served_logprobs_limit(info) -> int:
    """The limit a ModelInfo (generate.proto) states, for the gateway; unset: vLLM's default."""
    return info.max_logprobs if info.HasField("max_logprobs") else MAX_LOGPROBS


def logprobs_problem(params, limit: int) -> str | None:
    """logprobs or prompt_logprobs past the limit (logprobs_limit), as a message starting with the
    field's name. params: a SamplingParams or its proto (an unset field reads 0 there)."""
    for name in ("logprobs", "prompt_logprobs"):
        asked = getattr(params, name)
        if asked is not None and asked > limit:
            return f"{name} {asked} is more than this server allows (--max-logprobs: at most {limit})"
    return None


def other_model(requested: str | None, served) -> bool:
    """The request names a model and not the served one (no name: the served one). served: its name, or
    a ModelInfo (its name and aliases: --served-model-name's other names). Each surface words the
    refusal as its clients expect: REST 404 model_not_found, gRPC NOT_FOUND."""
    names = (served,) if isinstance(served, str) else (served.model, *served.aliases)
    return bool(requested) and requested not in names
