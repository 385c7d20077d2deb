"""A StructuredOutput spec as an llguidance grammar, and its check (no torch, no tokenizer).

The gateway (HTTP and public gRPC) and the scheduler call `check` before anything is stored, so
that a bad schema, regex or grammar is refused with a message naming the field and the problem;
the worker compiles the same `grammar_text` against the model's tokenizer. Both go through this
module so that what was checked is what runs.

JSON is generated compactly (llguidance's defaults without flexible whitespace: ", " and ": "
separators), not with "any whitespace" as vLLM's default: a model (a random one in the tests,
a weak one in practice) can otherwise spend its whole budget on whitespace between two tokens.

Thread-safe: the caches are functools.lru_cache (the checks run on the gateway's event loop and
the scheduler's gRPC threads).
"""

from __future__ import annotations

import functools
import json

from pagedserve.common.sampling_params import StructuredOutput

# Any JSON object: what response_format {"type": "json_object"} asks for.
_JSON_OBJECT_SCHEMA = '{"type": "object"}'
_JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar for the spec; raises ValueError naming the field and the problem."""
    return _grammar_for_key(spec.key())


@functools.lru_cache(maxsize=256)
def _grammar_for_key(key: str) -> str:
    import llguidance

    kind, _, value = key.partition(":")
    try:
        if kind == "json_schema":
            try:
                schema = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"json_schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"json_schema must be a JSON object, got {type(schema).__name__}")
            return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=_JSON_DEFAULTS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(_JSON_OBJECT_SCHEMA, defaults=_JSON_DEFAULTS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            choices = json.loads(value)
            if not choices or any(not isinstance(c, str) or not c for c in choices):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            return llguidance.grammar_from("choice", choices)
        if kind == "grammar":
            return llguidance.grammar_from("grammar", value)  # Lark, or GBNF converted to Lark
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message if message.startswith(kind) else f"{kind}: {message}") from None
    raise ValueError(f"unknown structured output kind {kind!r}")


@functools.lru_cache(maxsize=256)
def _check_key(key: str) -> None:
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(_grammar_for_key(key))
    if error:
        kind = key.partition(":")[0]
        raise ValueError(f"{kind} is invalid: {error.strip()}")


def check(spec: StructuredOutput) -> None:
    """Raises ValueError("<field>: <problem>") when the spec cannot be compiled."""
    _check_key(spec.key())
