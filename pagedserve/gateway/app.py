"""The OpenAI-compatible REST API: completions and chat (SSE streaming or one JSON), models,
health, metrics and request status, in front of the tokenizer and scheduler services."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import grpc
from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.v1 import generate_pb2
from pagedserve.gateway.backend import Backend, not_ready_error, rpc_error
from pagedserve.gateway.limits import RateLimiter, retry_after
from pagedserve.gateway.metrics import Metrics, RequestTracker
from pagedserve.gateway.protocol import (ChatCompletionRequest, CompletionRequest, RequestError, chat_to_generate,
                                       completion_to_generate, error_body, include_usage)
from pagedserve.gateway.responses import ChunkBuilder, Collector

# The tokenizer keeps a stream's request running this long after its caller vanished without
# aborting it (this gateway died), so that the client can resume it from another gateway.
RESUME_GRACE_METADATA = "pagedserve-resume-grace"
SHUTDOWN_MESSAGE = "the server is shutting down: the request was aborted after --shutdown-timeout"

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
            backend = self.backend
            if backend.draining:
                await _refuse(scope, receive, counting_send, 503, "the server is shutting down; retry on another "
                              "gateway (a stream resumes with GET /v1/requests/{id}/stream)",
                              "service_unavailable", "server_shutting_down", {"Retry-After": "5"})
                return
            authorization = headers.get(b"authorization", b"").decode("latin-1")
            if not backend.key_ok(authorization):
                response = JSONResponse(error_body("Incorrect or missing API key (Authorization: Bearer <key>).",
                                                   "invalid_request_error", None, "invalid_api_key"),
                                        status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, counting_send)
                return
            if backend.rate_limiter is not None:
                key = authorization.partition(" ")[2].strip() if backend.api_keys else None
                client = scope.get("client")
                wait = backend.rate_limiter.check(RateLimiter.identity(key, client[0] if client else None))
                if wait > 0:
                    rps, burst = backend.limits.rate_limit
                    await _refuse(scope, receive, counting_send, 429,
                                  f"rate limit exceeded: at most {rps:g} requests/s (burst {burst:g}) per API key",
                                  "rate_limit_error", "rate_limit_exceeded", {"Retry-After": retry_after(wait)})
                    return
            limit = backend.limits.max_body_bytes
            if limit > 0 and scope.get("method") in ("POST", "PUT", "PATCH"):
                length = headers.get(b"content-length")
                try:
                    too_big = length is not None and int(length) > limit
                except ValueError:
                    too_big = False
                if not too_big and length is None:
                    # No Content-Length (chunked): read the body here, up to the limit.
                    body, too_big, receive = await _buffer_body(receive, limit)
                if too_big:
                    await _refuse(scope, receive, counting_send, 413,
                                  f"the request body exceeds --max-body-bytes ({limit} bytes)",
                                  "invalid_request_error", "request_too_large", {})
                    return
        await self.app(scope, receive, counting_send)


async def _refuse(scope, receive, send, status: int, message: str, kind: str, code: str,
                  headers: dict[str, str]) -> None:
    response = JSONResponse(error_body(message, kind, None, code), status_code=status, headers=headers)
    await response(scope, receive, send)


async def _buffer_body(receive, limit: int):
    """(body, too_big, a receive that hands the buffered body on and then defers to `receive`)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            return b"", True, receive
        if not message.get("more_body"):
            break
    body = b"".join(chunks)
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return body, False, replay


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


def _sse(data: dict, event_id: str | None = None) -> str:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class Cursor:
    """Where a client is in a stream: per sample, the tokens and the characters of text it has
    received, and whether it saw the sample's last chunk. It is the SSE event id:
    `T:C` per sample (`T:C:f` once finished), samples joined by commas, e.g. `12:45` or `12:45:f,7:30`.
    GET /v1/requests/{id}/stream resumes after it (Last-Event-ID, or ?after=T[,T...] in tokens)."""

    def __init__(self, n: int) -> None:
        self.tokens, self.chars, self.done = [0] * n, [0] * n, [False] * n

    def grow(self, index: int) -> None:
        while index >= len(self.tokens):
            self.tokens.append(0)
            self.chars.append(0)
            self.done.append(False)

    def event_id(self) -> str:
        return ",".join(f"{t}:{c}" + (":f" if d else "") for t, c, d in zip(self.tokens, self.chars, self.done))

    @staticmethod
    def parse(text: str) -> tuple[list[int], list[int | None], list[bool]]:
        """(tokens, chars or None when not given, finished) per sample; raises ValueError."""
        tokens, chars, done = [], [], []
        for part in text.strip().split(","):
            fields = part.strip().split(":")
            if not 1 <= len(fields) <= 3 or (len(fields) == 3 and fields[2] != "f"):
                raise ValueError(part)
            t = int(fields[0])
            c = int(fields[1]) if len(fields) >= 2 else None
            if t < 0 or (c is not None and c < 0):
                raise ValueError(part)
            tokens.append(t)
            chars.append(c)
            done.append(len(fields) == 3)
        if len(tokens) > 1024:
            raise ValueError("too many samples")
        return tokens, chars, done


class _Skip:
    """Drops from a replayed stream what the client already has (its Cursor), cutting a message
    that straddles the cursor at the exact token and character."""

    def __init__(self, backend: Backend, tokens: list[int], chars: list[int | None], done: list[bool],
                 skip_special_tokens: bool) -> None:
        self.backend, self.skip_special = backend, skip_special_tokens
        self.tokens, self.chars, self.done = tokens, chars, done
        self.ids: dict[int, list[int]] = {}  # output ids so far, kept only while chars are unknown

    async def apply(self, msg: generate_pb2.GenerateResponse, cursor: Cursor):
        """The part of msg to send (or None); `cursor` holds the counts before msg."""
        i = msg.index
        if i >= len(self.tokens):
            return msg
        if self.done[i]:
            return None
        seen_t, seen_c = cursor.tokens[i], cursor.chars[i]
        ids, text = list(msg.token_ids), msg.text
        if self.chars[i] is None:
            if seen_t + len(ids) >= self.tokens[i]:
                if seen_t + len(ids) == self.tokens[i]:
                    self.chars[i] = seen_c + len(text)
                else:
                    known = self.ids.get(i, []) + ids[:max(0, self.tokens[i] - seen_t)]
                    self.chars[i] = await self._text_length(known)
                self.ids.pop(i, None)
            else:
                self.ids.setdefault(i, []).extend(ids)
                return None if not msg.finish_reason else self._cut(msg, len(ids), len(text))
        tok_cut = min(max(0, self.tokens[i] - seen_t), len(ids))
        char_cut = min(max(0, self.chars[i] - seen_c), len(text))
        if tok_cut == 0 and char_cut == 0:
            return msg
        return self._cut(msg, tok_cut, char_cut)

    @staticmethod
    def _cut(msg: generate_pb2.GenerateResponse, tok_cut: int, char_cut: int):
        out = generate_pb2.GenerateResponse()
        out.CopyFrom(msg)
        out.text = msg.text[char_cut:]
        del out.token_ids[:]
        out.token_ids.extend(msg.token_ids[tok_cut:])
        if len(msg.logprobs) == len(msg.token_ids):
            del out.logprobs[:]
            out.logprobs.extend(msg.logprobs[tok_cut:])
        if not out.text and not out.token_ids and not out.finish_reason:
            return None
        return out

    async def _text_length(self, ids: list[int]) -> int:
        reply = await self.backend.tokenizer.Detokenize(
            generate_pb2.DetokenizeRequest(token_ids=ids, skip_special_tokens=self.skip_special), timeout=5.0)
        return len(reply.text)


async def _watch_disconnect(receive, on_disconnect: Callable[[], None]) -> None:
    # After the body is read, receive() only returns once the client went away (or the response
    # is complete, when this task is cancelled anyway).
    while (await receive())["type"] != "http.disconnect":
        pass
    on_disconnect()


def _error_response(exc: RequestError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


class _Generation:
    """One completions/chat call (or a resumed stream): accepted before headers, then streamed
    or collected."""

    def __init__(self, backend: Backend, request: Request, chat: bool,
                 body: CompletionRequest | ChatCompletionRequest | None) -> None:
        self.backend, self.request, self.chat, self.body = backend, request, chat, body
        self.received = time.time()
        self.tracker: RequestTracker = backend.metrics.track(self.received)
        self.call = None
        self.client_gone = False
        self.finished = False
        self.shutdown = False  # aborted by the gateway's drain
        self.reserved = 0      # tokens counted in backend.tokens_in_flight
        self.request_id = ""
        # Another stream may share the request (an idempotent retry, a resume): then a client that
        # leaves does not abort it; the tokenizer's resume grace ends it if nobody is left.
        self.shared = False
        self.n = 1  # a resume learns its n from the record; until then (or when there is none) one sample
        if body is not None:
            self.n, self.stream = body.n, body.stream
            self.logprobs = bool(body.logprobs) if chat else body.logprobs is not None
            self.echo = not chat and body.echo
            self.usage, self.timings = include_usage(body), body.timings

    def _metadata(self):
        grace = self.backend.limits.resume_grace_s
        return ((RESUME_GRACE_METADATA, f"{grace:g}"),) if self.stream and grace > 0 else None

    def _timeout(self) -> float | None:
        timeout = getattr(self.body, "timeout", None)
        if timeout is None:
            return None
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise RequestError(400, f"timeout must be a positive number of seconds, got {timeout!r}", "timeout")
        return float(timeout)

    async def start(self) -> Response:
        body, backend = self.body, self.backend
        if body.n > backend.limits.max_n:
            raise RequestError(400, f"n={body.n} exceeds the limit of {backend.limits.max_n} samples per request "
                               "(--max-n)", "n")
        timeout = self._timeout()
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
            self.shared = True
        gen.request_id = request_id
        self.tracker.request_id = request_id
        gen.timings.gateway_received = self.received
        self.model, self.request_id, self.created = info.model, request_id, int(self.received)
        if self.stream:
            await backend.save_resume_record(request_id, {
                "chat": self.chat, "model": info.model, "created": self.created, "n": body.n,
                "logprobs": self.logprobs, "usage": self.usage, "timings": self.timings,
                "stop": list(gen.stop), "include_stop_str_in_output": gen.include_stop_str_in_output,
                "skip_special_tokens": gen.skip_special_tokens})

        self.call = backend.tokenizer.Generate(gen, timeout=timeout, metadata=self._metadata())
        first = await self._first()
        prompt_tokens = first.usage.prompt_tokens
        max_tokens = gen.params.max_tokens if gen.params.HasField("max_tokens") else \
            max(0, info.max_model_len - prompt_tokens)
        reserve = prompt_tokens + body.n * min(max_tokens, info.max_model_len)
        if not backend.reserve_tokens(reserve):
            self._end()
            self.call.cancel()
            await backend.abort(request_id)
            raise RequestError(429, f"too many tokens in flight at this gateway: this request needs {reserve} "
                               f"(prompt + n * max_tokens), {backend.tokens_in_flight} of "
                               f"{backend.limits.max_tokens_in_flight} are taken (--max-tokens-in-flight)",
                               None, "rate_limit_error", "too_many_tokens_in_flight", headers={"Retry-After": "1"})
        self.reserved = reserve
        return await self._respond(first)

    async def _first(self) -> generate_pb2.GenerateResponse:
        try:
            first = await self.call.read()
        except grpc.RpcError as exc:
            self._end()
            raise rpc_error(exc) from exc
        except BaseException:
            self._end()
            self.call.cancel()
            raise
        if first is grpc.aio.EOF:
            self._end()
            raise RequestError(500, "the tokenizer service ended the stream before accepting the request",
                               type="server_error")
        self.backend.inflight.add(self)
        return first

    async def _respond(self, first, skip: _Skip | None = None) -> Response:
        headers = {"x-request-id": self.request_id}
        if self.stream:
            return _CancellingStream(self._stream(first, skip), self._closed,
                                     {**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(await self._collect(first), headers=headers)

    def _end(self, cancelled: bool = False) -> None:
        """Once: the request leaves this gateway's books."""
        if self.tracker is not None:
            self.tracker.finish(self.n, cancelled=cancelled)
            self.tracker = None
        self.backend.inflight.discard(self)
        self.backend.release_tokens(self.reserved)
        self.reserved = 0

    def _closed(self) -> None:
        """The response ended: a stream not run to its end was left by its client, so its request
        is aborted here (the tokenizer would otherwise keep it for a resume)."""
        if not self.finished and self.call is not None:
            self.client_gone = True
            if self.request_id and not self.shared:
                _spawn(self.backend.abort(self.request_id))
        if self.call is not None:
            self.call.cancel()
        self._end(cancelled=not self.finished)

    def abort_for_shutdown(self) -> None:
        self.shutdown = True
        _spawn(self.backend.abort(self.request_id))

    def _disconnected(self) -> None:
        self.client_gone = True
        self.call.cancel()

    async def _read(self) -> generate_pb2.GenerateResponse | None:
        msg = await self.call.read()
        if msg is grpc.aio.EOF:
            return None
        if self.tracker is not None:
            self.tracker.on_message(msg)
        return msg

    async def _stream(self, first: generate_pb2.GenerateResponse, skip: _Skip | None = None) -> AsyncIterator[str]:
        builder = ChunkBuilder(self.chat, self.request_id, self.model, self.created, self.n, self.logprobs,
                               echo=self.echo and skip is None)
        cursor = Cursor(self.n)
        usage, tracker = self.usage, self.tracker
        try:
            chunks = builder.add(first)
            if skip is None:  # a resumed stream's client has had the role (chat) or echo chunks
                for chunk in chunks:
                    yield _sse(chunk, cursor.event_id())
            while (msg := await self._read()) is not None:
                i = msg.index
                cursor.grow(i)
                send = await skip.apply(msg, cursor) if skip is not None else msg
                cursor.tokens[i] += len(msg.token_ids)
                cursor.chars[i] += len(msg.text)
                if msg.finish_reason:
                    cursor.done[i] = True
                if send is None:
                    builder.usage.add(msg)
                    continue
                chunks = builder.add(send)
                if send.text and chunks and tracker is not None:
                    tracker.streamed()
                if self.timings and not usage and chunks and msg.finish_reason and tracker is not None \
                        and tracker.all_finished(self.n):
                    chunks[-1]["timings"] = tracker.timings_object()
                for chunk in chunks:
                    yield _sse(chunk, cursor.event_id())
            if usage:
                chunk = builder.usage_chunk()
                if self.timings and tracker is not None:
                    chunk["timings"] = tracker.timings_object()
                yield _sse(chunk, cursor.event_id())
            if self.shutdown:
                yield _sse(error_body(SHUTDOWN_MESSAGE, "service_unavailable", None, "server_shutdown"))
            self.finished = True
            yield "data: [DONE]\n\n"
        except grpc.RpcError as exc:
            # Headers are gone: report in-band, as vLLM does (the openai client raises on it).
            self.finished = True
            error = rpc_error(exc)
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                error.message = f"the request's timeout passed: it was aborted ({error.message})"
                _spawn(self.backend.abort(self.request_id))
            yield _sse(error_body(error.message, error.type, error.param, error.code))
            yield "data: [DONE]\n\n"
        finally:
            self.call.cancel()
            self._end(cancelled=not self.finished)

    async def _collect(self, first: generate_pb2.GenerateResponse) -> dict:
        collector = Collector(self.n)
        collector.add(first)
        watcher = asyncio.create_task(_watch_disconnect(self.request.receive, self._disconnected))
        try:
            while (msg := await self._read()) is not None:
                collector.add(msg)
        except (grpc.RpcError, asyncio.CancelledError) as exc:
            self._end(cancelled=self.client_gone)
            if self.client_gone:
                # Nobody is listening; answer something short rather than raise into the server.
                raise RequestError(499, "client closed the request", type="client_closed") from None
            if isinstance(exc, grpc.RpcError):
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    _spawn(self.backend.abort(self.request_id))
                    raise RequestError(504, "the request's timeout passed: it was aborted", "timeout", "timeout",
                                       "timeout") from exc
                raise rpc_error(exc) from exc
            raise
        finally:
            watcher.cancel()
            self.call.cancel()
        tracker = self.tracker
        out_timings = tracker.timings_object() if self.timings and tracker is not None else None
        self._end()
        body = self.body
        if self.chat:
            out = collector.chat(self.request_id, self.model, self.created, bool(body.logprobs))
        else:
            out = collector.completion(self.request_id, self.model, self.created, body.logprobs is not None,
                                       body.echo)
        if out_timings is not None:
            out["timings"] = out_timings
        return out

    async def resume(self, request_id: str, last_event_id: str | None, after: str | None) -> Response:
        """GET /v1/requests/{id}/stream: replay the request from the start through the tokenizer
        (it re-attaches at the scheduler, which replays from Redis and goes on live), dropping what
        the client already has."""
        backend = self.backend
        cursor_text = last_event_id if last_event_id not in (None, "") else after
        skip = None
        if cursor_text not in (None, ""):
            try:
                tokens, chars, done = Cursor.parse(cursor_text)
            except ValueError:
                raise RequestError(400, f"cannot parse the stream position {cursor_text!r}: want the SSE event id "
                                   "(T:C[,T:C...]) in Last-Event-ID, or ?after=T (tokens)",
                                   "Last-Event-ID" if last_event_id else "after") from None
            if last_event_id in (None, ""):
                chars = [None] * len(tokens)
        record = await backend.get_record(request_id)
        meta = await backend.load_resume_record(request_id) or {}
        n = int(meta.get("n") or len(record.outputs) or record.params.n or 1)
        self.chat = bool(meta.get("chat", request_id.startswith("chatcmpl-")))
        self.n, self.stream, self.logprobs, self.echo = n, True, bool(meta.get("logprobs")), False
        self.usage, self.timings = bool(meta.get("usage")), False
        info = await backend.model_info()
        self.model, self.created = meta.get("model") or info.model, int(meta.get("created") or self.received)
        self.request_id = self.tracker.request_id = request_id
        self.shared = True
        gen = generate_pb2.GenerateRequest(request_id=request_id, params=record.params,
                                           stop=list(meta.get("stop") or []),
                                           include_stop_str_in_output=bool(meta.get("include_stop_str_in_output")),
                                           skip_special_tokens=bool(meta.get("skip_special_tokens", True)))
        gen.prompt_token_ids.ids.extend(record.prompt_token_ids)
        if cursor_text not in (None, ""):
            tokens += [0] * (n - len(tokens))
            chars += [0] * (n - len(chars))
            done += [False] * (n - len(done))
            skip = _Skip(backend, tokens, chars, done, gen.skip_special_tokens)
        self.call = backend.tokenizer.Generate(gen, metadata=self._metadata())
        first = await self._first()
        return await self._respond(first, skip)


_background: set[asyncio.Task] = set()


def _spawn(coro) -> None:
    task = asyncio.get_running_loop().create_task(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


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
    if backend.limits.cors_origins:  # off unless --cors-origins; outermost, so preflights need no key
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=backend.limits.cors_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-request-id"])

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

    @app.get("/v1/requests/{request_id}/stream")
    async def resume_stream(request_id: str, request: Request, after: str | None = None,
                            last_event_id: str | None = Header(None, alias="Last-Event-ID")) -> Response:
        """Resume a stream (from this or any gateway of the stack): the SSE events after the
        position in Last-Event-ID (an event id of the stream: T:C per sample, tokens and characters
        received, `:f` once finished) or ?after=T (tokens per sample, comma-separated), then live."""
        generation = _Generation(backend, request, request_id.startswith("chatcmpl-"), None)
        try:
            return await generation.resume(request_id, last_event_id, after)
        except RequestError:
            generation._end()
            raise
        except grpc.RpcError as exc:
            generation._end()
            raise rpc_error(exc) from exc

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
        from pagedserve.gateway import dashboard
        app.include_router(dashboard.router)
    except ImportError:
        pass
    return app


__all__ = ["Backend", "Metrics", "build_app"]
