"""The OpenAI-compatible REST API: `build_app(backend)` wires the routes (completions and chat, embeddings,
their stream resume, models, request status, engine stats, health, metrics, the dashboard) to
the plain code that serves them, behind the admission gate (http_gate.py), and renders every
error in OpenAI's {"error": {...}} shape.

Routes are adapters only: each translates HTTP to one call (completion_call.py, backend.py,
health.py) and back. Threads: uvicorn's one event loop, shared with the public gRPC API.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import grpc
from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.gateway.backend import Backend
from pagedserve.gateway import (anthropic_api, batched_completion, completion_call, embeddings, lora_adapters,
                                response_records, responses_api, scores, tokenization)
from pagedserve.gateway.health import readiness, readiness_now
from pagedserve.gateway.http_gate import HttpGate
from pagedserve.gateway.metrics import Metrics
from pagedserve.gateway.shared_answer import SharedAnswer
from pagedserve.gateway.owners import SINGLE_TENANT, Caller
from pagedserve.gateway.protocol import (ChatCompletionRequest, CompletionRequest, RequestError, error_body,
                                         internal_error)
from pagedserve.gateway.sse import Cursor, ResumeSkip

_Skip = ResumeSkip  # the name older callers import


def caller_of(request: Request) -> Caller:
    """The Caller the HTTP gate admitted (always set on /v1 paths)."""
    return getattr(request.state, "caller", SINGLE_TENANT)


def _error_response(exc: RequestError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _install_error_handlers(app: FastAPI) -> None:
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

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        # A generic message and a correlation id; the exception itself goes to the log only.
        return _error_response(internal_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))


def _operator(request: Request) -> None:
    """Refuse a caller without the operator key (--admin-api-key; anyone when no keys are set)."""
    if not caller_of(request).admin:
        raise RequestError(403, "this path wants the operator key (--admin-api-key)", None, "permission_error",
                           "admin_key_required")


async def _json_body(request: Request):
    try:
        return await request.json()
    except ValueError:
        raise RequestError(400, "the body is not valid JSON") from None


async def _metrics_text(backend: Backend) -> bytes:
    try:
        per_replica = await backend.replica_stats()
    except grpc.RpcError:
        per_replica = []
    stats = per_replica[0][1] if len(per_replica) == 1 and not per_replica[0][0] else None
    return backend.metrics.render(stats, per_replica if stats is None else None)



def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("pagedserve")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"

def build_app(backend: Backend) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await backend.close()

    docs = backend.limits.api_docs  # off: --disable-fastapi-docs (vLLM's)
    app = FastAPI(title="pagedserve", version="0.1.0", lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.state.backend = backend
    app.add_middleware(HttpGate, backend=backend)
    if backend.limits.cors_origins:  # off unless --cors-origins; outermost, so preflights need no key
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=backend.limits.cors_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-request-id"])
    _install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        backend.check_runner("Completions API")
        if batched_completion.is_batched(body):  # a list of prompts
            return await batched_completion.run_batched(backend, request, body)
        return await completion_call.run_completion(backend, request, False, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        backend.check_runner("Chat Completions API")
        return await completion_call.run_completion(backend, request, True, body)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        """OpenAI's Responses API (responses_api.py)."""
        backend.check_runner("Responses API")
        return await responses_api.create(backend, request, await _json_body(request))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> dict:
        """The caller's stored response (another owner's: 404)."""
        return await response_records.retrieve(backend, request, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict:
        """OpenAI's: forget the caller's stored response (another owner's: 404)."""
        return await response_records.delete(backend, request, response_id)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API (anthropic_api.py); errors in Anthropic's shape."""
        try:
            backend.check_runner("Messages API")
            body = await request.json()
        except RequestError as exc:
            return anthropic_api.error_response(exc)
        except ValueError:
            return anthropic_api.error_response(RequestError(400, "the body is not valid JSON"))
        return await anthropic_api.run_messages(backend, request, body)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return anthropic_api.error_response(RequestError(400, "the body is not valid JSON"))
        return await anthropic_api.count_tokens(backend, body)

    @app.post("/v1/embeddings")
    async def create_embeddings(request: Request) -> Response:
        """OpenAI's embeddings, with --runner pooling (embeddings.py)."""
        return await embeddings.create(backend, request, await _json_body(request))

    @app.post("/v1/score")
    @app.post("/score")
    async def create_score(request: Request) -> Response:
        """vLLM's Score API, with --runner pooling (scores.py)."""
        return await scores.score(backend, request, await _json_body(request))

    @app.post("/v1/rerank")
    @app.post("/rerank")
    @app.post("/v2/rerank")
    async def create_rerank(request: Request) -> Response:
        """Jina's and Cohere's rerank, as vLLM serves them, with --runner pooling (scores.py)."""
        return await scores.rerank(backend, request, await _json_body(request))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        return await tokenization.tokenize(backend, await _json_body(request))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        return await tokenization.detokenize(backend, await request.body())  # bounded before it is parsed

    async def model_cards() -> list[dict]:
        info = await backend.model_info()
        await backend.loras.sync()
        return [*({"id": name, "object": "model", "created": 0, "owned_by": "pagedserve", "root": info.model,
                   "parent": None, "max_model_len": info.max_model_len, "ready": info.ready}
                  for name in (info.model, *info.aliases)),  # --served-model-name's names, as vLLM lists them
                *backend.loras.model_cards(info.model, info.max_model_len, info.ready)]

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": await model_cards()}

    @app.get("/v1/models/{model:path}")
    async def model_card(model: str) -> dict:
        """OpenAI's retrieve (`client.models.retrieve`): one entry of /v1/models, or 404 as OpenAI says it."""
        for card in await model_cards():
            if card["id"] == model:
                return card
        raise RequestError(404, f"The model '{model}' does not exist", "model", code="model_not_found")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        """vLLM's: {"lora_name", "lora_path"} (a PEFT folder); the operator key only."""
        _operator(request)
        return PlainTextResponse(await lora_adapters.load_from_body(backend.loras, await _json_body(request)))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        """vLLM's: {"lora_name"}; the operator key only."""
        _operator(request)
        return PlainTextResponse(await lora_adapters.unload_from_body(backend.loras, await _json_body(request)))

    @app.get("/v1/requests/{request_id}")
    async def request_status(request_id: str, request: Request) -> dict:
        """The caller's own request (another owner's answers 404, as if it did not exist)."""
        return await backend.request_status(request_id, caller_of(request))

    @app.get("/v1/requests/{request_id}/stream")
    async def resume_stream(request_id: str, request: Request, after: str | None = None,
                            last_event_id: str | None = Header(None, alias="Last-Event-ID")) -> Response:
        """Resume a stream (from this or any gateway of the stack): the SSE events after the
        position in Last-Event-ID (an event id of the stream: T:C per sample, tokens and characters
        received, `:f` once finished) or ?after=T (tokens per sample, comma-separated), then live."""
        return await completion_call.resume_stream(backend, request, request_id, last_event_id, after)

    @app.get("/v1/engine/stats")
    async def engine_stats(request: Request, steps: int = 256, replica: str = "") -> dict:
        """The engine snapshot; an ordinary key sees only its own requests in it. With engine
        replicas: `replica` picks whose snapshot (default the first); `replicas` lists them all."""
        return await backend.engine_stats(steps, caller_of(request), replica)

    # Open routes (no key): one answer per ~0.5 s, shared by every poller (shared_answer.py).
    health_answer = SharedAnswer(lambda: readiness_now(backend))
    metrics_answer = SharedAnswer(lambda: _metrics_text(backend))

    @app.get("/health")
    async def health() -> JSONResponse:
        """Readiness: 503 with the cause while the model loads, a service or worker rank is gone, the
        engine is stalled with work pending, or Redis is unreachable (answers shared ~0.5 s)."""
        return await readiness(health_answer)

    @app.get("/health/ready")
    async def health_ready() -> JSONResponse:
        """Kubernetes readiness probe: the same conditions as /health."""
        return await readiness(health_answer)

    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> JSONResponse:
        """vLLM's (and SageMaker's) health route: /health's answer."""
        return await readiness(health_answer)

    @app.get("/version")
    async def version() -> dict:
        """vLLM's: the server's version."""
        return {"version": package_version()}

    @app.get("/health/live")
    async def health_live() -> JSONResponse:
        """Kubernetes liveness probe: this process answers (it asks no other service)."""
        return JSONResponse({"status": "alive"})

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text (answers shared ~0.5 s)."""
        return Response(await metrics_answer.get(), media_type=CONTENT_TYPE_LATEST)

    try:  # the live dashboard (its own module; the API works without it)
        from pagedserve.gateway import dashboard
        app.include_router(dashboard.router)
    except ImportError:
        pass
    return app


__all__ = ["Backend", "Cursor", "Metrics", "build_app"]
