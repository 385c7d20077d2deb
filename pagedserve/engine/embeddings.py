"""LLM.embed (vLLM's, for --runner pooling): each prompt runs as a prefill-only request whose
worker returns its pooled hidden states (worker/pooling.py), through the same scheduler as any
request (prefix cache, chunked prefill, preemption).

Threads: the LLM's caller, like LLM.generate. A bad argument raises ValueError before any
request is added; an exception while stepping aborts every request of the call.
"""

from __future__ import annotations

from tqdm import tqdm

from pagedserve.common.offline_types import EmbeddingOutput, EmbeddingRequestOutput, PoolingParams
from pagedserve.common.sampling_params import Pooling, SamplingParams
from pagedserve.worker.pooling import as_floats


def pooling_request_params(runner: str, pooler: str, params: PoolingParams | None) -> SamplingParams:
    """The engine's parameters of one embedding request; ValueError for a generate runner or an
    unsupported field, worded as the servers' 400s."""
    if runner != "pooling":
        raise ValueError("LLM.embed() needs a pooling model: LLM(..., runner='pooling') (vLLM's --runner pooling)")
    params = params if params is not None else PoolingParams()
    if not isinstance(params, PoolingParams):
        raise TypeError(f"pooling_params must be a pagedserve PoolingParams, got {type(params).__name__}")
    if params.dimensions is not None:
        raise ValueError("dimensions: this model does not support matryoshka representation; "
                         "leave dimensions unset")
    return SamplingParams(max_tokens=0, pooling=Pooling(pooler, bool(params.normalize)))


def embed_all(engine, ids: list[str], encoded: list[tuple[str | None, list[int]]], params: SamplingParams,
              use_tqdm: bool) -> list[EmbeddingRequestOutput]:
    """Embed the (checked) prompts under the request ids `ids`; results in input order."""
    vectors: dict[str, bytes] = {}
    try:
        for rid, (_, token_ids) in zip(ids, encoded):
            engine.add_request(rid, token_ids, params)
        bar = tqdm(total=len(ids), desc="embedding", unit="req", disable=not use_tqdm)
        while len(vectors) < len(ids):
            for out in engine.step():
                if out.finished:
                    if out.embedding is None:
                        raise RuntimeError(f"request {out.request_id} finished ({out.finish_reason}) without a vector")
                    vectors[out.request_id] = out.embedding
                    bar.update(1)
        bar.close()
    except BaseException:
        for rid in ids:
            engine.abort(rid)
        raise
    return [EmbeddingRequestOutput(rid, list(token_ids), EmbeddingOutput(as_floats(vectors[rid])))
            for rid, (_, token_ids) in zip(ids, encoded)]
