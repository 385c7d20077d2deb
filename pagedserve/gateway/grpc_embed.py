"""Generation/Embed, the public gRPC twin of POST /v1/embeddings (embeddings.py): each input is a
prefill-only generation downstream under the caller's internal id (generation.forward_as), admitted
on its first message (admit_first), tracked by the metrics, its vector taken from its last message.
The inputs run concurrently; the first failure cancels the others and aborts the call with its
status. Refused with INVALID_ARGUMENT unless the server runs --runner pooling.

Threads: the serving event loop. Invariants: every downstream call is cancelled and every
reservation released when its task ends, whatever ends it.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import numpy as np

from pagedserve.common import request_checks as checks
from pagedserve.gateway.admission import Refusal
from pagedserve.gateway.embeddings import MAX_INPUTS
from pagedserve.gateway.generation import admit_first, forward_as
from pagedserve.gateway.protocol import RequestError
from pagedserve.v1 import common_pb2, generate_pb2


class EmbedFailed(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def request_inputs(request: generate_pb2.EmbedRequest) -> list[generate_pb2.GenerateRequest]:
    """One GenerateRequest per input (without params); EmbedFailed for a bad request."""
    if bool(request.texts) == bool(request.token_ids):
        raise EmbedFailed(grpc.StatusCode.INVALID_ARGUMENT, "give texts or token_ids (one of the two, not empty)")
    count = len(request.texts) or len(request.token_ids)
    if count > MAX_INPUTS:
        raise EmbedFailed(grpc.StatusCode.INVALID_ARGUMENT, f"{count} inputs; at most {MAX_INPUTS} in one request")
    gens = []
    for i, text in enumerate(request.texts):
        if not text:
            raise EmbedFailed(grpc.StatusCode.INVALID_ARGUMENT, f"texts[{i}] is empty")
        gens.append(generate_pb2.GenerateRequest(prompt=text))
    for i, ids in enumerate(request.token_ids):
        if not ids.ids:
            raise EmbedFailed(grpc.StatusCode.INVALID_ARGUMENT, f"token_ids[{i}] is empty")
        gens.append(generate_pb2.GenerateRequest(prompt_token_ids=ids))
    return gens


async def embed(service, request: generate_pb2.EmbedRequest, context: grpc.aio.ServicerContext,
                metadata: dict, peer: str | None) -> generate_pb2.EmbedResponse:
    backend = service.backend
    received = time.time()
    caller = await service._admit(context)
    try:
        backend.check_runner("Embeddings API", pooling=True)
        gens = request_inputs(request)
        backend.admission.check_priority(caller, request.priority)
        await backend.admission.admit_more(metadata.get("authorization"), peer, len(gens) - 1)
    except Refusal as refusal:  # the batch's rate: RESOURCE_EXHAUSTED, as Generate's
        await context.abort(refusal.grpc_code, refusal.message)
    except RequestError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
    except EmbedFailed as exc:
        await context.abort(exc.code, exc.message)
    info = await service._model_info(context, request)
    if checks.other_model(request.model, info):
        await context.abort(grpc.StatusCode.NOT_FOUND, f"the model {request.model!r} does not exist")
    normalize = request.normalize if request.HasField("normalize") else True
    for gen in gens:
        gen.priority = request.priority
        gen.params.max_tokens = 0
        gen.params.pooling.CopyFrom(common_pb2.Pooling(type=backend.pooler, normalize=normalize))
        problem = checks.prompt_chars_problem(gen, info.max_model_len)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
    tasks = [asyncio.ensure_future(_one(backend, gen, caller, received, info, context.time_remaining()))
             for gen in gens]
    try:
        results = await asyncio.gather(*tasks)
    except EmbedFailed as exc:
        await _cancel(tasks)
        await context.abort(exc.code, exc.message)
    except BaseException:
        await _cancel(tasks)
        raise
    reply = generate_pb2.EmbedResponse()
    for index, (data, prompt_tokens) in enumerate(results):
        reply.embeddings.add(index=index, values=np.frombuffer(data, dtype="<f4").tolist())
        reply.usage.prompt_tokens += prompt_tokens
    return reply


async def _cancel(tasks: list[asyncio.Future]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _one(backend, gen: generate_pb2.GenerateRequest, caller, received: float, info,
               timeout: float | None) -> tuple[bytes, int]:
    """One input's (vector, prompt tokens); EmbedFailed with the status that ended it."""
    request_id = forward_as(gen, caller, "embd-" + uuid.uuid4().hex, received, backend.prefix_cache_scope)
    tracker = backend.metrics.track(received)
    tracker.request_id = request_id
    call = backend.tokenizer.Generate(gen, timeout=timeout)
    finished, accepted, reserved, data, prompt_tokens = False, False, 0, b"", 0
    try:
        while (msg := await call.read()) is not grpc.aio.EOF:
            tracker.on_message(msg)
            if not accepted:
                reserved = await admit_first(backend, call, request_id, msg, 1, 0, info.max_model_len)
                accepted = True
            data = msg.embedding or data
            prompt_tokens = msg.usage.prompt_tokens or prompt_tokens
        finished = True
    except Refusal as refusal:
        finished = True
        raise EmbedFailed(refusal.grpc_code, refusal.message) from None
    except grpc.RpcError as exc:
        finished = True
        raise EmbedFailed(exc.code(), exc.details() or "") from None
    finally:
        call.cancel()
        backend.admission.release(reserved)
        tracker.finish(1, cancelled=not finished)
    if not data:
        raise EmbedFailed(grpc.StatusCode.INTERNAL, "an input ended without its vector")
    return data, prompt_tokens
