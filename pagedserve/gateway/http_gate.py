"""The REST API's gate: a pure ASGI middleware in front of every route. On /v1 paths (and vLLM's
/tokenize, /detokenize) it asks the shared admission (admission.py: draining, API key, rate limit),
checks the body size and leaves the Caller (owners.py: the request's owner) in the request's state;
the API's own description (/docs, /redoc, /openapi.json) wants the operator key (any key when no
operator key is set); it counts every response by endpoint and status (pagedserve:http_requests_total).

It must not wrap `receive` on the way through (a route watching for the client's disconnect
reads it), except to hand on a body it had to read itself: a POST without Content-Length is read
here up to --max-body-bytes and replayed to the route.
Threads: runs on the serving event loop, like every route.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

import grpc

from pagedserve.gateway import images
from pagedserve.gateway.admission import Refusal
from pagedserve.gateway.anthropic_api import error_body as anthropic_error
from pagedserve.gateway.backend import Backend

# Paths that answer without the API key: probes and scrapers do not carry one.
OPEN_PATHS = ("/health", "/metrics", "/ping", "/version")
# The API's description: for operators (it is a map of the attack surface).
DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")
# vLLM's paths outside /v1 that still need the key (vLLM leaves them open; they read the model).
GATED_PATHS = ("/tokenize", "/detokenize", "/score", "/rerank", "/v2/rerank")
KNOWN_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
                   "/v1/responses", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
                   "/v1/models", "/v1/engine/stats", "/v1/embeddings", "/v1/score", "/v1/rerank", "/health",
                   "/metrics", "/dashboard", "/ping", "/version", *GATED_PATHS)
BODY_METHODS = ("POST", "PUT", "PATCH")
ANTHROPIC_PATHS = ("/v1/messages",)  # refused in Anthropic's error shape


def operators_only() -> Refusal:
    return Refusal(403, grpc.StatusCode.PERMISSION_DENIED, "this path wants the operator key (--admin-api-key)",
                   "permission_error", "admin_key_required")


def endpoint_label(path: str) -> str:
    """The endpoint label of the HTTP counter: a bounded set, whatever paths clients send."""
    if path in KNOWN_ENDPOINTS:
        return path
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{id}"
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    return "/v1/requests/{id}" if path.startswith("/v1/requests/") else "other"


class HttpGate:
    """ASGI middleware: admission on /v1 paths (but OPEN_PATHS), responses counted everywhere."""

    def __init__(self, app, backend: Backend) -> None:
        self.app, self.backend = app, backend

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        label = endpoint_label(scope["path"])
        http = self.backend.metrics.http

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                http.labels(label, str(message["status"])).inc()
            await send(message)

        path = scope["path"]
        if ((path.startswith("/v1") or path in GATED_PATHS) and path not in OPEN_PATHS) or path in DOCS_PATHS:
            admission = self.backend.admission
            headers = dict(scope.get("headers") or [])
            client = scope.get("client")
            try:
                caller = await admission.admit(authorization(headers), client[0] if client else None)
                if path in DOCS_PATHS and admission.has_admin and not caller.admin:
                    raise operators_only()
                scope.setdefault("state", {})["caller"] = caller
                limit = await images.body_limit(self.backend) if scope.get("method") in BODY_METHODS else 0
                if limit > 0:
                    length = headers.get(b"content-length")
                    if length is None:
                        # No Content-Length (chunked): read the body here, up to the limit.
                        size, receive = await buffer_body(receive, limit)
                    else:
                        try:
                            size = int(length)
                        except ValueError:
                            size = 0  # a malformed length is not refused here
                    admission.check_body_size(size, limit)
            except Refusal as refusal:
                body = anthropic_error(refusal.status, refusal.message) if path.startswith(ANTHROPIC_PATHS) \
                    else refusal.body()
                response = JSONResponse(body, status_code=refusal.status, headers=refusal.headers)
                await response(scope, receive, counting_send)
                return
        await self.app(scope, receive, counting_send)


def authorization(headers: dict[bytes, bytes]) -> str:
    """The Authorization header, or Anthropic's x-api-key as a bearer token when there is none."""
    given = headers.get(b"authorization", b"").decode("latin-1")
    if not given and headers.get(b"x-api-key"):
        return "Bearer " + headers[b"x-api-key"].decode("latin-1")
    return given


async def buffer_body(receive, limit: int):
    """(size, receive): the bytes read, reading no further once over `limit` (then `receive`
    itself is handed back), else a receive that hands the whole body on, then defers to `receive`."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            return size, receive
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

    return size, replay
