"""The OpenAI-compatible REST API: completions and chat (SSE streaming or one JSON), models,
health, metrics and request status, in front of the tokenizer and scheduler services."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.v1 import generate_pb2
from services.gateway.backend import Backend, not_ready_error, rpc_error
from services.gateway.metrics import Metrics, RequestTracker
from services.gateway.protocol import (ChatCompletionRequest, CompletionRequest, RequestError, chat_to_generate,
                                       completion_to_generate, error_body, include_usage)
from services.gateway.responses import ChunkBuilder, Collector

log = logging.getLogger("pagedserve.gateway")

# Paths that answer without the API key: probes and scrapers do not carry one.
OPEN_PATHS = ("/health", "/metrics")
KNOWN_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/engine/stats", "/health",
                   "/metrics", "/dashboard")


def _endpoint_label(path: str) -> str:
    if path in KNOWN_ENDPOINTS:
        return path
    return "/v1/requests/{id}" if path.startswith("/v1/requests/") else "other"


class _Gate:
    """Pure ASGI middleware (it must not wrap `receive`, or disconnects would go unseen):
    checks the API key on /v1 paths and counts responses by endpoint and status."""

    def __init__(self, app, backend: Backend) -> None:
        self.app, self.backend = app, backend

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        label = _endpoint_label(scope["path"])
        http = self.backend.metrics.http

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                http.labels(label, str(message["status"])).inc()
            await send(message)

        if scope["path"].startswith("/v1") and scope["path"] not in OPEN_PATHS:
            headers = dict(scope.get("headers") or [])
            authorization = headers.get(b"authorization", b"").decode("latin-1")
            if not self.backend.key_ok(authorization):
                response = JSONResponse(error_body("Incorrect or missing API key (Authorization: Bearer <key>).",
                                                   "invalid_request_error", None, "invalid_api_key"),
                                        status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, counting_send)
                return
        await self.app(scope, receive, counting_send)


class _CancellingStream(StreamingResponse):
    """SSE response that cancels the gRPC call the moment the response ends for any reason.
    Starlette stops iterating the body when the client disconnects, but an async generator left
    suspended at a `yield` is only closed whenever it is garbage-collected; this does it at once."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
            await self.body_iterator.aclose()


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _watch_disconnect(receive, on_disconnect: Callable[[], None]) -> None:
    # After the body is read, receive() only returns once the client went away (or the response
    # is complete, when this task is cancelled anyway).
    while (await receive())["type"] != "http.disconnect":
        pass
    on_disconnect()


def _error_response(exc: RequestError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


class _Generation:
    """One completions/chat call: accepted before headers, then streamed or collected."""

    def __init__(self, backend: Backend, request: Request, chat: bool,
                 body: CompletionRequest | ChatCompletionRequest) -> None:
        self.backend, self.request, self.chat, self.body = backend, request, chat, body
        self.received = time.time()
        self.tracker: RequestTracker = backend.metrics.track(self.received)
        self.call = None
        self.client_gone = False

    async def start(self) -> Response:
        body, backend = self.body, self.backend
        info = await backend.served_model(body.model)
        gen = chat_to_generate(body) if self.chat else completion_to_generate(body)
        if gen.params.HasField("max_tokens") and gen.params.max_tokens > info.max_model_len:
            name = "max_completion_tokens" if self.chat and body.max_completion_tokens is not None else "max_tokens"
            raise RequestError(400, f"{name}={gen.params.max_tokens} exceeds the model's maximum context length "
                               f"of {info.max_model_len} tokens", name)
        request_id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        key = self.request.headers.get("idempotency-key")
        if key:
            # A retried POST attaches to the first one's generation and replays it from the start.
            request_id = await backend.claim_idempotency_key(key, request_id)
        gen.request_id = request_id
        self.tracker.request_id = request_id
        gen.timings.gateway_received = self.received
        self.model, self.request_id, self.created = info.model, request_id, int(self.received)

        self.call = backend.tokenizer.Generate(gen)
        try:
            first = await self.call.read()
        except grpc.RpcError as exc:
            self.tracker.finish(body.n)
            raise rpc_error(exc) from exc
        except BaseException:
            self.call.cancel()
            raise
        if first is grpc.aio.EOF:
            self.tracker.finish(body.n)
            raise RequestError(500, "the tokenizer service ended the stream before accepting the request",
                               type="server_error")
        headers = {"x-request-id": request_id}
        if body.stream:
            return _CancellingStream(self._stream(first), self.call.cancel,
                                     {**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(await self._collect(first), headers=headers)

    def _disconnected(self) -> None:
        self.client_gone = True
        self.call.cancel()

    async def _read(self) -> generate_pb2.GenerateResponse | None:
        msg = await self.call.read()
        if msg is grpc.aio.EOF:
            return None
        self.tracker.on_message(msg)
        return msg

    async def _stream(self, first: generate_pb2.GenerateResponse) -> AsyncIterator[str]:
        body = self.body
        logprobs = bool(body.logprobs) if self.chat else body.logprobs is not None
        builder = ChunkBuilder(self.chat, self.request_id, self.model, self.created, body.n, logprobs,
                               echo=not self.chat and body.echo)
        finished = False
        usage, tracker = include_usage(body), self.tracker
        try:
            for chunk in builder.add(first):
                yield _sse(chunk)
            while (msg := await self._read()) is not None:
                chunks = builder.add(msg)
                if msg.text and chunks:
                    tracker.streamed()
                if body.timings and not usage and chunks and msg.finish_reason and tracker.all_finished(body.n):
                    chunks[-1]["timings"] = tracker.timings_object()
                for chunk in chunks:
                    yield _sse(chunk)
            if usage:
                chunk = builder.usage_chunk()
                if body.timings:
                    chunk["timings"] = tracker.timings_object()
                yield _sse(chunk)
            finished = True
            yield "data: [DONE]\n\n"
        except grpc.RpcError as exc:
            # Headers are gone: report in-band, as vLLM does (the openai client raises on it).
            finished = True
            error = rpc_error(exc)
            yield _sse(error_body(error.message, error.type, error.param, error.code))
            yield "data: [DONE]\n\n"
        finally:
            self.call.cancel()
            self.tracker.finish(body.n, cancelled=not finished)

    async def _collect(self, first: generate_pb2.GenerateResponse) -> dict:
        body = self.body
        collector = Collector(body.n)
        collector.add(first)
        watcher = asyncio.create_task(_watch_disconnect(self.request.receive, self._disconnected))
        try:
            while (msg := await self._read()) is not None:
                collector.add(msg)
        except (grpc.RpcError, asyncio.CancelledError) as exc:
            self.tracker.finish(body.n, cancelled=self.client_gone)
            if self.client_gone:
                # Nobody is listening; answer something short rather than raise into the server.
                raise RequestError(499, "client closed the request", type="client_closed") from None
            if isinstance(exc, grpc.RpcError):
                raise rpc_error(exc) from exc
            raise
        finally:
            watcher.cancel()
            self.call.cancel()
        self.tracker.finish(body.n)
        if self.chat:
            out = collector.chat(self.request_id, self.model, self.created, bool(body.logprobs))
        else:
            out = collector.completion(self.request_id, self.model, self.created, body.logprobs is not None,
                                       body.echo)
        if body.timings:
            out["timings"] = self.tracker.timings_object()
        return out


async def _generate(backend: Backend, request: Request, chat: bool, body) -> Response:
    try:
        return await _Generation(backend, request, chat, body).start()
    except RequestError:
        raise
    except grpc.RpcError as exc:
        raise rpc_error(exc) from exc
    except Exception as exc:
        log.exception("generation failed")
        raise RequestError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error") from exc


def build_app(backend: Backend) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await backend.close()

    app = FastAPI(title="pagedserve", version="0.1.0", lifespan=lifespan)
    app.state.backend = backend
    app.add_middleware(_Gate, backend=backend)

    @app.exception_handler(RequestError)
    async def _request_error(_request: Request, exc: RequestError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422; OpenAI's API (and its clients' error classes) expect 400.
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        where = ".".join(loc)
        message = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
        return _error_response(RequestError(400, message, loc[0] if loc else None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _generate(backend, request, False, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _generate(backend, request, True, body)

    @app.get("/v1/models")
    async def models() -> dict:
        info = await backend.model_info()
        return {"object": "list", "data": [
            {"id": info.model, "object": "model", "created": 0, "owned_by": "pagedserve", "root": info.model,
             "parent": None, "max_model_len": info.max_model_len, "ready": info.ready}]}

    @app.get("/v1/requests/{request_id}")
    async def request_status(request_id: str) -> dict:
        return await backend.request_status(request_id)

    @app.get("/v1/engine/stats")
    async def engine_stats(steps: int = 256) -> dict:
        return await backend.engine_stats(steps)

    @app.get("/health")
    async def health() -> JSONResponse:
        """Readiness: 503 with the cause while the model loads, a service or worker rank is gone, the
        engine is stalled with work pending, or Redis is unreachable."""
        try:
            info, stats = await asyncio.gather(backend.fresh_model_info(), backend.stats())
        except grpc.RpcError as exc:
            return JSONResponse({"status": "unavailable", "cause": rpc_error(exc).message}, status_code=503,
                                headers={"Retry-After": "5"})
        except RequestError as exc:
            return JSONResponse({"status": "unavailable", "cause": exc.message}, status_code=503,
                                headers={"Retry-After": "5"})
        if not (info.ready and stats.ready):
            cause = not_ready_error("the model is loading").message
            return JSONResponse({"status": "loading", "cause": cause}, status_code=503, headers={"Retry-After": "5"})
        if stats.unhealthy_cause:
            return JSONResponse({"status": "unhealthy", "cause": stats.unhealthy_cause}, status_code=503,
                                headers={"Retry-After": "5"})
        return JSONResponse({"status": "ok", "model": info.model})

    @app.get("/health/ready")
    async def health_ready() -> JSONResponse:
        """Kubernetes readiness probe: the same conditions as /health."""
        return await health()

    @app.get("/health/live")
    async def health_live() -> JSONResponse:
        """Kubernetes liveness probe: this process answers (it asks no other service)."""
        return JSONResponse({"status": "alive"})

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            stats = await backend.stats()
        except grpc.RpcError:
            stats = None
        return Response(backend.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    try:  # the live dashboard (its own module; the API works without it)
        from services.gateway import dashboard
        app.include_router(dashboard.router)
    except ImportError:
        pass
    return app


__all__ = ["Backend", "Metrics", "build_app"]
