"""vLLM's Score API (POST /v1/score, /score) and rerank API (POST /v1/rerank, /rerank, /v2/rerank: Jina's
and Cohere's request and answer, as vLLM serves them) on a --runner pooling server.

A pair's score is the cosine similarity of the two texts' embeddings, as vLLM scores with an embedding
model (the served architectures have no cross-encoder classification head). Every distinct text of the
request is embedded once, normalised, exactly as /v1/embeddings embeds it (embeddings.embed_all: each a
request downstream, admission and the rate bucket paying for each), so a score equals the dot product of
the two vectors /v1/embeddings returns.

Score: text_1 and text_2 are each a string or a list of strings; one text_1 is scored against every
text_2, else the two lists pair up by index (other lengths: 400 naming text_2). Rerank: a query and
its documents (strings, or Cohere's {"text": ...}), answered best first, `top_n` of them (0 or unset:
all), each with its index, its text (unless Cohere's return_documents is false) and `relevance_score`.
Unknown fields are refused naming them.

Threads: the gateway's event loop.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedserve.gateway.backend import Backend, as_request_error
from pagedserve.gateway.embeddings import MAX_INPUTS, check_integers, embed_all
from pagedserve.gateway.protocol import RequestError, bad_request
from pagedserve.v1 import common_pb2

SCORE_FIELDS = {"model", "text_1", "text_2", "priority", "user", "truncate_prompt_tokens"}
RERANK_FIELDS = {"model", "query", "documents", "top_n", "priority", "user", "return_documents",
                 "truncate_prompt_tokens"}


def _texts(value: Any, name: str) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise bad_request(f"{name} must be a non-empty string or a non-empty list of strings", name)
    for i, item in enumerate(items):
        if isinstance(item, dict) and name == "documents" and set(item) == {"text"}:
            item = items[i] = item["text"]  # Cohere's document object
        if not isinstance(item, str) or not item:
            raise bad_request(f"{name}[{i}] must be a non-empty string", name)
    return items


def _check(body: Any, fields: set[str], api: str) -> None:
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise bad_request(f"{unknown[0]} is not supported by {api}", unknown[0])
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise bad_request("model must be a string", "model")
    check_integers(body)


def score_pairs(body: dict) -> list[tuple[str, str]]:
    """The (text_1, text_2) pairs of a score request, in answer order; 400 naming the bad field."""
    first, second = _texts(body.get("text_1"), "text_1"), _texts(body.get("text_2"), "text_2")
    if len(first) == 1:
        return [(first[0], text) for text in second]
    if len(first) != len(second):
        raise bad_request(f"text_2 has {len(second)} texts for {len(first)} in text_1: give one text_1, or as "
                          "many as text_2", "text_2")
    return list(zip(first, second))


async def _cosines(backend: Backend, request: Request, body: dict, pairs: list[tuple[str, str]],
                   api: str) -> tuple[list[float], int, str, list[str]]:
    """(cosine similarity of each pair, prompt tokens, model, downstream request ids)."""
    backend.check_runner(f"the {api}", pooling=True)
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    if len(texts) > MAX_INPUTS:
        raise bad_request(f"the request has {len(texts)} distinct texts; at most {MAX_INPUTS}", "text_2")
    done = await embed_all(backend, request, texts, common_pb2.Pooling(type=backend.pooler, normalize=True), body,
                           api)
    vectors = {text: np.frombuffer(v, dtype="<f4").astype(np.float64) for text, v in zip(texts, done.vectors)}
    scores = [float(vectors[a] @ vectors[b]) for a, b in pairs]
    return scores, done.prompt_tokens, done.model, done.request_ids


async def score(backend: Backend, request: Request, body: Any) -> Response:
    """POST /v1/score, /score."""
    try:
        _check(body, SCORE_FIELDS, "/v1/score")
        received = time.time()
        scores, tokens, model, ids = await _cosines(backend, request, body, score_pairs(body), "Score API")
    except RequestError:
        raise
    except Exception as exc:
        raise as_request_error(exc) from exc
    out = {"id": "score-" + uuid.uuid4().hex, "object": "list", "created": int(received), "model": model,
           "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
           "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return JSONResponse(out, headers={"x-request-id": ",".join(ids)})


async def rerank(backend: Backend, request: Request, body: Any) -> Response:
    """POST /v1/rerank, /rerank, /v2/rerank."""
    try:
        _check(body, RERANK_FIELDS, "/v1/rerank")
        query = body.get("query")
        if not isinstance(query, str) or not query:
            raise bad_request("query must be a non-empty string", "query")
        documents = _texts(body.get("documents"), "documents")
        top_n = body.get("top_n") or len(documents)
        if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
            raise bad_request(f"top_n must be a non-negative integer, got {body.get('top_n')!r}", "top_n")
        scores, tokens, model, ids = await _cosines(backend, request, body, [(query, d) for d in documents],
                                                    "rerank API")
    except RequestError:
        raise
    except Exception as exc:
        raise as_request_error(exc) from exc
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n]
    results = [{"index": i, "document": {"text": documents[i]}, "relevance_score": scores[i]} for i in order]
    if body.get("return_documents") is False:  # Cohere's v1 switch (vLLM always returns them)
        for result in results:
            del result["document"]
    out = {"id": "rerank-" + uuid.uuid4().hex, "model": model, "usage": {"total_tokens": tokens}, "results": results}
    return JSONResponse(out, headers={"x-request-id": ",".join(ids)})
