"""The answer of one accepted REST completions or chat call (completion_call.CompletionCall), from
the tokenizer's first message to the end: SSE chunks (`stream`; errors after the headers go
in-band, as vLLM's) or one JSON body collected to the end; in `raw` mode (a prompt of a batch, an
embedding, the Anthropic and Responses APIs) the chunks or the body themselves. Each message is
counted by the call's metrics tracker as it is read.

Invariants: whatever way the answer ends (run to its end, failed, timed out, left by its client),
the call's gRPC stream is cancelled and the call ended (CompletionCall.end, once); a timeout that
passes aborts the request (in-band for a stream, a 504 otherwise); a shutdown that aborted a stream
ends it with an error event. Threads: the serving event loop; aborts whose answer nobody waits for
run as background tasks (spawn).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from fastapi.responses import JSONResponse, Response

from pagedserve.v1 import generate_pb2
from pagedserve.gateway.backend import rpc_error
from pagedserve.gateway.protocol import RequestError, error_body
from pagedserve.gateway.logprobs import show_ids_as_tokens, vllm_prompt_logprobs
from pagedserve.gateway.responses import ChunkBuilder, Collector
from pagedserve.gateway.background import spawn, watch_disconnect
from pagedserve.gateway.sse import DONE, SSE_HEADERS, CancellingStream, Cursor, ResumeSkip, sse_event

SHUTDOWN_MESSAGE = "the server is shutting down: the request was aborted after --shutdown-timeout"


async def respond(call, first, skip: ResumeSkip | None = None) -> Response:
    """The answer of an accepted call (a completion_call.CompletionCall) from its first message on:
    an SSE stream or a JSON body (raw: the chunks or the body itself)."""
    if call.raw:
        return _stream(call, first, skip) if call.stream else await _collect(call, first)
    headers = {"x-request-id": call.client_id}
    if call.stream:
        return CancellingStream(_stream(call, first, skip), call._closed, {**headers, **SSE_HEADERS})
    return JSONResponse(await _collect(call, first), headers=headers)


async def _read(call) -> generate_pb2.GenerateResponse | None:
    msg = await call.call.read()
    if msg is grpc.aio.EOF:
        return None
    if call.tracker is not None:
        call.tracker.on_message(msg)
    if call.ids_as_tokens:
        show_ids_as_tokens(msg.logprobs)
        if call.echo:  # an echo's logprobs list the prompt's entries first
            show_ids_as_tokens(msg.prompt_logprobs)
    return msg


async def _stream(call, first: generate_pb2.GenerateResponse, skip: ResumeSkip | None = None) -> AsyncIterator[str]:
    builder = ChunkBuilder(call.chat, call.client_id, call.model, call.created, call.n, call.logprobs,
                           echo=call.echo and skip is None, tools=call.tools,
                           prompt_logprobs=getattr(call.body, "prompt_logprobs", None) is not None,
                           reasoning=call.reasoning, token_ids=call.token_ids,
                           chat_echo=call.chat_echo if skip is None else "")
    cursor = Cursor(call.n)
    usage, tracker = call.usage, call.tracker

    def event(chunk: dict) -> str:
        if call.continuous_usage:
            builder.with_usage([chunk])
        if call.raw:
            return chunk
        return sse_event(chunk, cursor.event_id() if call.event_ids else None)
    try:
        chunks = builder.add(first)
        if skip is None:  # a resumed stream's client has had the role (chat) or echo chunks
            for chunk in chunks:
                yield event(chunk)
        while (msg := await _read(call)) is not None:
            cursor.grow(msg.index)
            send = await skip.apply(msg, cursor) if skip is not None else msg
            cursor.advance(msg)
            if skip is not None:
                builder.skip_text(msg.index, msg.text[:len(msg.text) - len(send.text if send else "")])
            if send is None:
                builder.usage.add(msg)
                continue
            chunks = builder.add(send)
            if send.text and chunks and tracker is not None:
                tracker.streamed()
            if call.timings and not usage and chunks and msg.finish_reason and tracker is not None \
                    and tracker.all_finished(call.n):
                chunks[-1]["timings"] = tracker.timings_object()
            for chunk in chunks:
                yield event(chunk)
        if usage:
            chunk = builder.usage_chunk()
            if call.timings and tracker is not None:
                chunk["timings"] = tracker.timings_object()
            yield event(chunk)
        if call.shutdown:
            error = error_body(SHUTDOWN_MESSAGE, "service_unavailable", None, "server_shutdown")
            yield error if call.raw else sse_event(error)
        call.finished = True
        yield DONE
    except grpc.RpcError as exc:
        # Headers are gone: report in-band, as vLLM does (the openai client raises on it).
        call.finished = True
        error = rpc_error(exc)
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            error.message = f"the request's timeout passed: it was aborted ({error.message})"
            spawn(call.backend.abort(call.request_id))
        body = error_body(error.message, error.type, error.param, error.code)
        yield body if call.raw else sse_event(body)
        yield DONE
    finally:
        call.call.cancel()
        call.end(cancelled=not call.finished)


async def _collect(call, first: generate_pb2.GenerateResponse) -> dict:
    collector = Collector(call.n)
    collector.add(first)
    watcher = asyncio.create_task(watch_disconnect(call.request.receive, call._disconnected))
    try:
        while (msg := await _read(call)) is not None:
            collector.add(msg)
    except (grpc.RpcError, asyncio.CancelledError) as exc:
        call.end(cancelled=call.client_gone)
        if call.client_gone:
            # Nobody is listening; answer something short rather than raise into the server.
            raise RequestError(499, "client closed the request", type="client_closed") from None
        if isinstance(exc, grpc.RpcError):
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                spawn(call.backend.abort(call.request_id))
                raise RequestError(504, "the request's timeout passed: it was aborted", "timeout", "timeout",
                                   "timeout") from exc
            raise rpc_error(exc) from exc
        raise
    finally:
        watcher.cancel()
        call.call.cancel()
    tracker = call.tracker
    out_timings = tracker.timings_object() if call.timings and tracker is not None else None
    call.end()
    if call.pooling is not None:
        return {"embedding": collector.embedding, "prompt_tokens": collector.usage.prompt_tokens,
                "finish_reason": collector.samples[0].finish_reason}
    body = call.body
    if call.chat:
        out = collector.chat(call.client_id, call.model, call.created, bool(body.logprobs), call.tools,
                             call.reasoning, call.token_ids)
        if call.chat_echo:
            for choice in out["choices"]:
                choice["message"]["content"] = call.chat_echo + (choice["message"]["content"] or "")
        if body.prompt_logprobs is not None:  # vLLM's: one list for the request, beside the choices
            out["prompt_logprobs"] = vllm_prompt_logprobs(collector.prompt_logprobs)
    else:
        out = collector.completion(call.client_id, call.model, call.created, body.logprobs is not None,
                                   body.echo, body.prompt_logprobs is not None, call.token_ids)
    if out_timings is not None:
        out["timings"] = out_timings
    return out
