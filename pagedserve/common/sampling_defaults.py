"""The model's own sampling defaults (vLLM's --generation-config): what a request that does not set
temperature, top_p, top_k, min_p, repetition_penalty or max_tokens gets.

A model's generation_config.json may recommend sampling settings (Qwen2.5: temperature 0.7, top_p
0.8, top_k 20, repetition_penalty 1.05; Llama 3.1 Instruct: temperature 0.6, top_p 0.9). As vLLM
(0.8 on) does by default, the tokenizer service reads them at start-up (`read_defaults`: "auto", the
model's folder; a folder of its own; or "vllm": none) and fills every one of those fields a request
left unset (`apply_defaults`, before the scheduler sees it, so the request's record holds what ran).
HF's max_new_tokens caps max_tokens, sent or not (vLLM's rule: the least of the request's, the
model's and the context). --override-generation-config (JSON) sets or adds entries, as vLLM's.

Pure functions, standard library only; the tokenizer's event loop calls apply_defaults.
"""

from __future__ import annotations

import json
from pathlib import Path

from pagedserve.common.sampling_params import SamplingParams

# generation_config.json's keys that are sampling defaults (vLLM's available_params), and their field
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_defaults(model_folder: Path | str | None, source: str = "auto", override: str | dict | None = None) -> dict:
    """field -> default: from `source` ("auto": the model's folder; "vllm": none; else a folder with a
    generation_config.json), then `override` (a JSON object or a dict of generation_config keys).
    Raises ValueError naming the flag when a value is not one a request could send."""
    config: dict = {}
    if source != "vllm":
        folder = model_folder if source == "auto" else source
        path = Path(folder) / "generation_config.json" if folder is not None else None
        if source not in ("auto", "vllm") and (path is None or not path.is_file()):
            raise ValueError(f"--generation-config {source!r}: no generation_config.json there")
        if path is not None and path.is_file():
            try:
                config = json.loads(path.read_text())
            except ValueError as exc:
                raise ValueError(f"{path}: not JSON ({exc})") from None
    if override:
        try:
            extra = json.loads(override) if isinstance(override, str) else dict(override)
        except ValueError as exc:
            raise ValueError(f"--override-generation-config: not JSON ({exc})") from None
        if not isinstance(extra, dict):
            raise ValueError("--override-generation-config: want a JSON object")
        config = {**config, **extra}
    defaults = {field: config[key] for key, field in KEYS.items() if config.get(key) is not None}
    try:
        SamplingParams(**{k: v for k, v in defaults.items() if k != "max_tokens"})
        if "max_tokens" in defaults and not (isinstance(defaults["max_tokens"], int) and defaults["max_tokens"] > 0):
            raise ValueError(f"max_new_tokens must be a positive integer, got {defaults['max_tokens']!r}")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the model's generation config cannot be a request's defaults: {exc}") from None
    return defaults


def apply_defaults(params, defaults: dict) -> None:
    """Fill the fields a request left unset (common_pb2.SamplingParams, in place) from `defaults`
    (read_defaults'); max_tokens: the least of the request's and the model's. Embedding requests
    (pooling) sample nothing and keep theirs."""
    if not defaults or params.HasField("pooling"):
        return
    for field, value in defaults.items():
        if field == "max_tokens":
            params.max_tokens = min(params.max_tokens, value) if params.HasField("max_tokens") else value
        elif not params.HasField(field):
            setattr(params, field, value)
