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
from collections.abc import Mapping

from pagedserve.common import structural_format
from pagedserve.common.sampling_params import StructuredOutput

# Any JSON object: what response_format {"type": "json_object"} asks for.
_JSON_OBJECT_SCHEMA = '{"type": "object"}'
# llguidance's grammar size (symbols) bound here (its own default is 500,000): a JSON schema of ~2,000
# properties; the worst such grammar took the worker ~0.6 s to compile on the 2-core test CPU, a
# 10,000-property one (~0.5 MB) ~10 s.
GRAMMAR_SYMBOLS = 20_000
# llguidance's bound on the Earley items of one row (its default is 2,000). An object's optional
# properties are alternatives at each of its positions, ~4 items each: at the default, a schema of 500
# or more optional properties compiled but its matcher failed at the first key ('{"', then only eos:
# a broken text that said "stop"). Every grammar within GRAMMAR_SYMBOLS fits this; the worst such
# schema (2,000 optional properties) costs ~12 ms of mask a token (~75 ms at its widest) on the 2-core CPU.
MAX_ITEMS_IN_ROW = GRAMMAR_SYMBOLS
_JSON_DEFAULTS = structural_format.JSON_DEFAULTS
# vLLM's structural tag, either form, as StructuredOutput.structural_tag holds it (its home: structural_format)
structural_tag_text = structural_format.held_text


def grammar_text(spec: StructuredOutput, special_tokens: Mapping[str, int] | None = None) -> str:
    """llguidance's grammar for the spec; raises ValueError naming the field and the problem.
    special_tokens (the worker's: a special token's text -> id): in a structural tag's texts each of them is
    matched as that token, as a model writes it; without them every text is text."""
    special = ()
    if spec.structural_tag and special_tokens:
        texts = structural_format.literals(structural_format.as_format(spec.structural_tag))
        special = tuple(sorted((t, i) for t, i in special_tokens.items() if any(t in text for text in texts)))
    return _grammar_for_key(spec.key(), special)


@functools.lru_cache(maxsize=256)
def _grammar_for_key(key: str, special: tuple[tuple[str, int], ...] = ()) -> str:
    import llguidance

    kind, _, value = key.partition(":")
    try:
        if kind == "json_schema":
            schema_text(value, "json_schema")  # the checks only: what compiles is the text as given
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
        if kind == "structural_tag":
            return _structural_tag_grammar(value, dict(special))
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message if message.startswith(kind) else f"{kind}: {message}") from None
    raise ValueError(f"unknown structured output kind {kind!r}")


def schema_text(value: object, where: str) -> str:
    """A JSON Schema (an object, or its JSON text) as JSON text; ValueError naming `where` when it is
    not one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(value, (dict, bool)):
        raise ValueError(f"{where} must be a JSON Schema object, got {type(value).__name__}")
    return json.dumps(value)


def _structural_tag_grammar(text: str, special: dict[str, int]) -> str:
    """Either form as one grammar (common/structural_format.py); a text among `special` is that token, by id."""
    return structural_format.grammar(structural_format.as_format(structural_tag_text(text)), special)


@functools.cache
def parser_limits():
    """llguidance's limits for every grammar here, checked and compiled alike: GRAMMAR_SYMBOLS bounds
    what a new grammar costs the worker to compile (on a background thread, while its request waits,
    but on the cores its steps run on)."""
    import llguidance
    # verbose_errors off: a matcher's error would carry the whole grammar (a tenant's schema) into the log.
    return llguidance.LLParserLimits(max_grammar_size=GRAMMAR_SYMBOLS, max_items_in_row=MAX_ITEMS_IN_ROW,
                                     verbose_errors=False)


@functools.lru_cache(maxsize=256)
def _check_key(key: str) -> None:
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(_grammar_for_key(key), limits=parser_limits())
    if error:
        kind = key.partition(":")[0]
        if "grammar size" in error:
            raise ValueError(f"{kind} is too large: its grammar has more than {GRAMMAR_SYMBOLS} symbols (about 2,000 "
                             "object properties), pagedserve's bound on what one request's grammar may cost to compile")
        raise ValueError(f"{kind} is invalid: {error.strip()}")


def check(spec: StructuredOutput) -> None:
    """Raises ValueError("<field>: <problem>") when the spec cannot be compiled."""
    _check_key(spec.key())
