"""`--speculative-config`: the speculative decoding settings as vLLM takes them (a JSON object),
parsed and checked once, here. No torch; used by the engine, the scheduler service and the
scheduler core (which proposes and budgets the lookahead tokens).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "draft_model", "model": "path/or/name", "num_speculative_tokens": 4}

Methods: "ngram" (prompt lookup: docs in scheduler/core/ngram_proposer.py) and "draft_model" (a
smaller model of the same vocabulary proposes greedily, in the worker: worker/draft_model.py); as
in vLLM, "method" may be left out when "model" is given. A bad value raises ValueError naming the
field and its limit; the draft model's files are checked against the target's where the model is
known (model_files/draft_check.py), before anything loads.

Verification rule (worker/spec_verify.py): each of the k + 1 positions of a speculated row is
sampled as a plain step would sample it (same sampler, same per-position seeded key), and
the proposals are accepted while they equal those samples. With a one-hot draft (n-gram) that is
exactly vLLM's rejection sampler: a proposal d is accepted with probability p(d), and on a
rejection the token drawn is distributed as p without d, renormalised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
MAX_LOOKUP = 64
DEFAULT_DISABLE_BY_BATCH_SIZE = 6  # see SpeculativeConfig.disable_by_batch_size


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # Speculation turns itself down for a request whose proposals keep failing (the scheduler's
    # Speculation): after this many steps in a row with nothing accepted it pauses, for twice
    # as long each time (up to max_backoff_steps).
    max_backoff_steps: int = 64
    # vLLM's disable_by_batch_size: a step with this many running requests or more carries no
    # proposals (0: never). On these CPUs a verified row costs its k + 1 tokens of compute once
    # the batch is past a few rows: bench serve random 128/64 gained 55% at concurrency 2 and 26%
    # at 4, and lost 9% at 8 with 92% of the proposals accepted; one stream gains 2-3x.
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    model: str | None = None  # draft_model: the draft's folder, prepared name or hub id

    @property
    def draft_model(self) -> str | None:
        """The draft model to load in the worker (method draft_model), else None."""
        return self.model if self.method == "draft_model" else None


def _int_field(values: dict, name: str, default: int, low: int, high: int) -> int:
    value = values.get(name, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"--speculative-config: {name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"--speculative-config: {name} must be between {low} and {high}, got {value}")
    return value


def parse_speculative_config(text: str | dict | None) -> SpeculativeConfig | None:
    """The config from the flag's JSON text (or an already parsed dict); None or "" means off."""
    if text is None or text == "" or text == {}:
        return None
    if isinstance(text, str):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not valid JSON ({exc.msg}): {text!r}") from None
    else:
        values = dict(text)
    if not isinstance(values, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {text!r}")
    method = values.get("method")
    if method is None:
        method = "draft_model" if values.get("model") else "ngram" if (
            "prompt_lookup_max" in values or "prompt_lookup_min" in values) else None
    if method not in METHODS:
        raise ValueError(f"--speculative-config: method must be one of {', '.join(METHODS)}, got {method!r}")
    known = {"method", "num_speculative_tokens", "max_backoff_steps", "disable_by_batch_size"}
    known |= {"model"} if method == "draft_model" else {"prompt_lookup_min", "prompt_lookup_max"}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"--speculative-config: unknown field(s) {', '.join(unknown)} for method {method!r}")
    if "num_speculative_tokens" not in values:
        raise ValueError("--speculative-config: num_speculative_tokens is required")
    k = _int_field(values, "num_speculative_tokens", 4, 1, MAX_SPECULATIVE_TOKENS)
    backoff = _int_field(values, "max_backoff_steps", 64, 0, 1 << 20)
    by_batch = _int_field(values, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE, 0, 1 << 20)
    if method == "draft_model":
        model = values.get("model")
        if not isinstance(model, str) or not model.strip():
            raise ValueError(f"--speculative-config: method 'draft_model' needs model (the draft's folder, "
                             f"prepared name or hub id), got {model!r}")
        return SpeculativeConfig("draft_model", k, max_backoff_steps=backoff, disable_by_batch_size=by_batch,
                                 model=model)
    lookup_max = _int_field(values, "prompt_lookup_max", values.get("prompt_lookup_min") or 5, 1, MAX_LOOKUP)
    lookup_min = _int_field(values, "prompt_lookup_min", min(2, lookup_max), 1, MAX_LOOKUP)
    if lookup_min > lookup_max:
        raise ValueError(f"--speculative-config: prompt_lookup_min ({lookup_min}) must be at most "
                         f"prompt_lookup_max ({lookup_max})")
    return SpeculativeConfig("ngram", k, lookup_min, lookup_max, backoff, by_batch)
