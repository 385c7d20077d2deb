"""pagedserve: a paged-attention LLM server (gateway, tokenizer, scheduler and worker services)
and, in process, vLLM's offline API:

    from pagedserve import LLM, SamplingParams
    llm = LLM(model="path/to/model", dtype="float32")
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text

The names below resolve on first use (module __getattr__): importing the package, as every
service process does, loads nothing, and the front-end services must never load torch.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "LLM": "pagedserve.engine.llm",
    "AsyncLLM": "pagedserve.engine.async_llm",
    "SamplingParams": "pagedserve.common.offline_types",
    "RequestOutput": "pagedserve.common.offline_types",
    "CompletionOutput": "pagedserve.common.offline_types",
    "PoolingParams": "pagedserve.common.offline_types",
    "BeamSearchParams": "pagedserve.common.beam_search",
    "StructuredOutputsParams": "pagedserve.common.offline_types",
    "GuidedDecodingParams": "pagedserve.common.offline_types",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
