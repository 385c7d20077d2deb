"""POST /v1/embeddings (OpenAI's and vLLM's shape) on a --runner pooling server.

Each input (a string, a list of strings, a list of token ids, or a list of token-id lists) is its
own request downstream, a prefill-only generation whose last message carries the pooled vector
(params.pooling: the server's --pooler, normalised unless `normalize` is false): one
CompletionCall per input in `raw` mode (completion_call.py: admission and tokens in flight,
owners and the prefix-cache salt, metrics and time stamps, the scheduler's Redis record, abort on
disconnect), started together as a list of prompts on /v1/completions is (batched_completion.py).
Every input is checked before any is sent; the first refusal downstream cancels the others.

The answer: `data` in input order, each vector a list of floats (`encoding_format` "float",
the default) or base64 of its float32 little-endian bytes ("base64", what the openai SDK asks
for by default); `usage` counts the prompt tokens. Fields a client commonly sends that this
server cannot honour are refused with a 400 naming the field (`dimensions`: no served model
has matryoshka representations; an unknown field), never ignored. vLLM's `truncate_prompt_tokens`
embeds each input's last k tokens (-1: as many as the context holds).

Threads: the gateway's event loop.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedserve.gateway.backend import Backend, as_request_error
from pagedserve.gateway.batched_completion import start_all
from pagedserve.gateway.completion_call import CompletionCall
from pagedserve.gateway.protocol import CompletionRequest, RequestError, bad_request
from pagedserve.v1 import common_pb2

# The fields this endpoint takes; `user` is OpenAI's end-user id (kept nowhere, as vLLM).
FIELDS = {"model", "input", "encoding_format", "dimensions", "user", "priority", "normalize", "truncate_prompt_tokens"}
# Inputs in one request: each is a request downstream, all queued at once (the scheduler's
# waiting queue holds --max-waiting-requests, 1024 by default).
MAX_INPUTS = 512
ENCODINGS = ("float", "base64")


def pooling(backend: Backend, body: dict) -> common_pb2.Pooling:
    normalize = body.get("normalize", True)
    if not isinstance(normalize, bool):
        raise bad_request(f"normalize must be true or false, got {normalize!r}", "normalize")
    return common_pb2.Pooling(type=backend.pooler, normalize=normalize)


def inputs(body: dict) -> list[str | list[int]]:
    """The inputs as prompts: strings or token-id lists; 400 naming the bad one."""
    value = body.get("input")
    if isinstance(value, str) or (isinstance(value, list) and value and _is_ids(value)):
        items = [value]
    elif isinstance(value, list) and value and all(isinstance(v, str) or (isinstance(v, list) and _is_ids(v))
                                                   for v in value):
        items = value
    else:
        raise bad_request("input must be a non-empty string, a list of strings, a list of token ids or a list "
                          "of token-id lists", "input")
    if len(items) > MAX_INPUTS:
        raise bad_request(f"input has {len(items)} items; at most {MAX_INPUTS} in one request", "input")
    for i, item in enumerate(items):
        if not item:
            raise bad_request(f"input[{i}] is empty" if len(items) > 1 else "input is empty", "input")
    return items


def _is_ids(value: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def check_fields(body: Any) -> str:
    """The encoding format; 400 for a body this endpoint cannot honour."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise bad_request(f"{unknown[0]} is not supported by /v1/embeddings", unknown[0])
    if body.get("dimensions") is not None:
        raise bad_request("dimensions is not supported: the model has no matryoshka representations "
                          "(leave it unset for the full vector)", "dimensions")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ENCODINGS:
        raise bad_request(f"encoding_format must be one of {', '.join(ENCODINGS)}, got {encoding!r}",
                          "encoding_format")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    check_integers(body)
    return encoding


def check_integers(body: dict) -> None:
    """priority and truncate_prompt_tokens, when sent, are integers (the values are checked downstream)."""
    for name in ("priority", "truncate_prompt_tokens"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise bad_request(f"{name} must be an integer", name)


def vector(data: bytes, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(data).decode()
    return np.frombuffer(data, dtype="<f4").tolist()


async def create(backend: Backend, request: Request, body: Any) -> Response:
    """POST /v1/embeddings; any failure before the answer is an HTTP error."""
    try:
        return await _create(backend, request, body)
    except RequestError:
        raise
    except Exception as exc:
        raise as_request_error(exc) from exc


class Embedded:
    """The vectors of a request's inputs (float32 little-endian bytes, in input order), their prompt
    tokens, the served model's name and the downstream request ids."""

    def __init__(self, vectors: list[bytes], prompt_tokens: int, model: str, request_ids: list[str]) -> None:
        self.vectors, self.prompt_tokens, self.model, self.request_ids = vectors, prompt_tokens, model, request_ids


async def embed_all(backend: Backend, request: Request, items: list[str | list[int]], spec: common_pb2.Pooling,
                    body: dict, api: str = "/v1/embeddings") -> Embedded:
    """Each item's pooled vector, every item a request downstream (started together, the first refusal
    cancelling the others); the caller's rate bucket pays for all of them. body: model, priority, user."""
    if request.headers.get("idempotency-key"):
        raise bad_request(f"Idempotency-Key is not supported on {api}", "input")
    await backend.admission.admit_more(request.headers.get("authorization"),
                                       request.client.host if request.client else None, len(items) - 1)
    calls = []
    for item in items:
        part = CompletionRequest(model=body.get("model"), prompt=item, max_tokens=0,
                                 priority=body.get("priority", 0), user=body.get("user"),
                                 truncate_prompt_tokens=body.get("truncate_prompt_tokens"))
        call = CompletionCall(backend, request, False, part)
        call.raw, call.pooling = True, spec
        calls.append(call)
    answers = await start_all(calls)
    for i, answer in enumerate(answers):
        if not answer["embedding"]:
            raise RequestError(500, f"input[{i}] ended ({answer['finish_reason'] or 'no finish'}) without its vector",
                               type="server_error")
    return Embedded([answer["embedding"] for answer in answers], sum(answer["prompt_tokens"] for answer in answers),
                    calls[0].model, [c.client_id for c in calls])


async def _create(backend: Backend, request: Request, body: Any) -> Response:
    backend.check_runner("Embeddings API", pooling=True)
    encoding = check_fields(body)
    items = inputs(body)
    spec = pooling(backend, body)
    received = time.time()
    done = await embed_all(backend, request, items, spec, body)
    data = [{"object": "embedding", "index": i, "embedding": vector(v, encoding)} for i, v in enumerate(done.vectors)]
    out = {"id": "embd-" + uuid.uuid4().hex, "object": "list", "created": int(received),
           "model": done.model, "data": data,
           "usage": {"prompt_tokens": done.prompt_tokens, "total_tokens": done.prompt_tokens}}
    return JSONResponse(out, headers={"x-request-id": ",".join(done.request_ids)})
