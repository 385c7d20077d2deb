"""What the gateway's front ends (REST and gRPC) share: the stubs of the services behind it, the
admission state (admission.py), the request store, the resume records, the metrics, and the one
table mapping gRPC codes to HTTP.

Threads: one Backend per gateway process, used on the serving event loop only (the REST and gRPC
servers share that loop); the stubs are created on first use, inside it.
Invariants: `inflight` holds exactly the REST completion calls accepted and not yet ended (the
drain on SIGTERM waits for it to empty); the model info is cached only once the model is ready.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

import grpc
import httpx
from pagedserve.common import wire
from pagedserve.common.grpc_util import internal_channel
from pagedserve.common.local_calls import LocalOrGrpcCall, LocalSocketPath
from pagedserve.common.request_checks import other_model
from pagedserve.common.store import MemoryStore, RequestStore
from pagedserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from pagedserve.gateway.lora_adapters import LoraAdapters
from pagedserve.gateway.admission import Admission
from pagedserve.gateway.images import MediaPolicy
from pagedserve.gateway.limits import Limits
from pagedserve.gateway.metrics import Metrics
from pagedserve.gateway.owners import SINGLE_TENANT, Caller, valid_client_id
from pagedserve.gateway.protocol import RequestError, internal_error
from pagedserve.gateway.request_views import engine_stats_dict, status_dict
from pagedserve.gateway.resume_records import ResumeRecords

RPC_TIMEOUT_S = 5.0
STATS_CACHE_S = 0.5   # how long one engine-stats snapshot serves every poller
MAX_STATS_STEPS = 512

log = logging.getLogger("pagedserve.gateway")

# gRPC status -> (HTTP status, OpenAI error type, Retry-After seconds or None).
# UNAVAILABLE and FAILED_PRECONDITION are what a service says while the model is still loading.
GRPC_TO_HTTP: dict[grpc.StatusCode, tuple[int, str, int | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", None),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", None),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", 1),
    grpc.StatusCode.FAILED_PRECONDITION: (503, "service_unavailable", 5),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable", 5),
    grpc.StatusCode.CANCELLED: (503, "service_unavailable", 1),
    grpc.StatusCode.ABORTED: (503, "service_unavailable", 1),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout", None),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error", None),
}


def rpc_error(exc: grpc.RpcError) -> RequestError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    status, kind, retry_after = GRPC_TO_HTTP.get(code, (500, "server_error", None))
    details = (exc.details() if hasattr(exc, "details") else "") or str(code)
    if code == grpc.StatusCode.UNAVAILABLE:
        details = f"the model is not available yet (loading, or a service is down): {details}"
    param = None
    if status == 400 and "prompt" in details.lower():
        param = "prompt"
    headers = {"Retry-After": str(retry_after)} if retry_after else {}
    return RequestError(status, details, param, kind, code.name.lower(), headers=headers)


def as_request_error(exc: Exception) -> RequestError:
    """Any failure before a response's headers, as the HTTP error to answer with: a RequestError as
    it is, a gRPC error by GRPC_TO_HTTP, anything else a 500 with a correlation id."""
    if isinstance(exc, RequestError):
        return exc
    if isinstance(exc, grpc.RpcError):
        return rpc_error(exc)
    return internal_error(exc)


def not_ready_error(cause: str) -> RequestError:
    return RequestError(503, cause, None, "service_unavailable", "model_not_ready", headers={"Retry-After": "5"})


class TokenizerCalls:
    """The tokenizer's stub, whose Generate goes over the tokenizer's local socket when it has one
    this process can reach (common/local_calls.py; --service-transport auto), else over gRPC; the
    other calls are the stub's."""

    def __init__(self, stub: generate_pb2_grpc.TokenizerStub, local: bool) -> None:
        self.stub = stub
        self.where = LocalSocketPath(self._ask_local_socket if local else None)

    def _ask_local_socket(self):
        return self.stub.GetLocalSocket(common_pb2.LocalSocketRequest(), timeout=RPC_TIMEOUT_S)

    def Generate(self, request: generate_pb2.GenerateRequest, timeout: float | None = None,  # noqa: N802 - the stub's name
                 metadata=None) -> LocalOrGrpcCall:
        return LocalOrGrpcCall(self.where, "Generate", generate_pb2.GenerateResponse,
                               lambda: self.stub.Generate(request, timeout=timeout, metadata=metadata),
                               request=request, metadata=metadata, timeout=timeout)

    def __getattr__(self, name: str):
        return getattr(self.stub, name)


class Backend:
    """Holds the grpc.aio stubs (created on first use, inside the serving event loop)."""

    def check_runner(self, api: str, pooling: bool = False) -> None:
        """vLLM's answer to an endpoint the --runner does not serve: 400 "The model does not support
        <api>" (embeddings need --runner pooling; generation needs the generate runner)."""
        if (self.runner == "pooling") != pooling:
            hint = "--runner pooling" if pooling else "the generate runner (this server runs --runner pooling)"
            raise RequestError(400, f"The model does not support {api}: it needs {hint}", code="model_not_supported")

    def __init__(self, tokenizer_addr: str, scheduler_addr: str, api_key: str | list[str] | None = None,
                 store: RequestStore | None = None, metrics: Metrics | None = None,
                 limits: Limits | None = None, admin_keys: list[str] | None = None,
                 min_priorities: dict[str, int] | None = None, tool_call_parser: str | None = None,
                 local_links: bool = True, reasoning_parser: str | None = None,
                 prefix_cache_scope: str = "owner", runner: str = "auto", pooler: str = "last") -> None:
        self.tokenizer_addr, self.scheduler_addr = tokenizer_addr, scheduler_addr
        self.local_links = local_links  # --service-transport auto: Generate over the tokenizer's local socket
        self.tool_call_parser = tool_call_parser  # --tool-call-parser: reads tool_choice "auto" outputs
        self.reasoning_parser = reasoning_parser  # --reasoning-parser: a chat's reasoning_content
        self.return_tokens_as_token_ids = False  # --return-tokens-as-token-ids: a request's default
        self.prefix_cache_scope = prefix_cache_scope  # --prefix-cache-scope: owners.cache_salt
        self.runner, self.pooler = runner, pooler  # --runner pooling: embeddings only, pooled by --pooler
        self.loras = LoraAdapters()  # --enable-lora: the adapters requests may name as their model
        self.media = MediaPolicy()  # images in requests (images.py); their URLs are fetched with media_client
        self._media_client: httpx.AsyncClient | None = None
        self.admission = Admission(api_key, limits, admin_keys, min_priorities)
        self.limits = self.admission.limits
        self.inflight: set = set()  # the REST calls this gateway is serving (completion_call.CompletionCall)
        # With no Redis the request records are the scheduler's; idempotency keys live here.
        self.store = store if store is not None and store.durable else None
        self.idempotency: RequestStore = store if store is not None else MemoryStore()
        self.resume_records = ResumeRecords(self.idempotency)
        self.response_records = None  # response_records.ResponseRecords, made on first use
        self.metrics = metrics or Metrics()
        self._channels: list[grpc.aio.Channel] = []
        self._tokenizer: TokenizerCalls | None = None
        self._scheduler: scheduler_pb2_grpc.SchedulerStub | None = None
        self._info: generate_pb2.ModelInfo | None = None
        # replica id ("": the one scheduler) -> (when, snapshot), and the fetch in flight shared by its waiters
        self._stats_by_replica: dict[str, tuple[float, scheduler_pb2.EngineStats]] = {}
        self._fetches: dict[str, asyncio.Future] = {}
        # Engine replicas (gateway/replicas.py, set by the server when it has Redis): None, or no
        # replica registered, is a single engine at scheduler_addr.
        self.replicas = None

    # -- the admission state's old names on Backend (admission.py owns it) --------------------
    @property
    def draining(self) -> bool:
        return self.admission.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.admission.draining = value

    def key_ok(self, authorization: str | None) -> bool:
        return self.admission.key_ok(authorization)

    def reserve_tokens(self, tokens: int) -> bool:
        return self.admission.reserve_tokens(tokens)

    def release_tokens(self, tokens: int) -> None:
        self.admission.release(tokens)

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = internal_channel(address, aio=True)
        self._channels.append(channel)
        return channel

    @property
    def tokenizer(self) -> TokenizerCalls:
        if self._tokenizer is None:
            stub = generate_pb2_grpc.TokenizerStub(self._channel(self.tokenizer_addr))
            self._tokenizer = TokenizerCalls(stub, self.local_links)
        return self._tokenizer

    @property
    def scheduler(self) -> scheduler_pb2_grpc.SchedulerStub:
        if self._scheduler is None:
            self._scheduler = scheduler_pb2_grpc.SchedulerStub(self._channel(self.scheduler_addr))
        return self._scheduler

    async def schedulers_of(self, request_id: str) -> list:
        """The scheduler(s) that may hold the request: its replica's (every replica's while the owner is
        not recorded yet), or the one scheduler."""
        stubs = await self.replicas.owner_stubs(request_id) if self.replicas is not None else []
        return stubs or [self.scheduler]

    async def replica_stubs(self) -> list[tuple[str, scheduler_pb2_grpc.SchedulerStub]]:
        """(replica id, stub) of every live replica; [("", the one scheduler)] without replicas."""
        replicas = await self.replicas.list() if self.replicas is not None else []
        return [(r.id, self.replicas.stub(r)) for r in replicas] or [("", self.scheduler)]

    def media_client(self) -> httpx.AsyncClient:
        if self._media_client is None:
            self._media_client = httpx.AsyncClient(follow_redirects=False)
        return self._media_client

    async def close(self) -> None:
        if self.replicas is not None:
            await self.replicas.close()
        if self._media_client is not None:
            await self._media_client.aclose()
            self._media_client = None
        for channel in self._channels:
            await channel.close()
        self._channels.clear()
        self._tokenizer = self._scheduler = None

    async def abort(self, request_id: str) -> None:
        """Abort a request at the scheduler (its KV blocks are freed); errors are only logged."""
        for scheduler in await self.schedulers_of(request_id):
            try:
                await scheduler.Abort(scheduler_pb2.AbortRequest(request_id=request_id), timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as exc:
                log.info("abort of request %s failed: %s", request_id,
                         exc.code().name if hasattr(exc, "code") else exc)

    async def get_record(self, request_id: str, shown_id: str | None = None) -> scheduler_pb2.RequestRecord:
        """The scheduler's record of the request with internal id request_id; 404 naming shown_id
        (the client's id) when there is none."""
        try:
            scheduler = (await self.schedulers_of(request_id))[0]
            return await scheduler.GetRequest(scheduler_pb2.GetRequestRequest(request_id=request_id),
                                              timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            error = rpc_error(exc)
            if error.status == 404:
                error.message, error.param, error.code = f"no request with id {shown_id or request_id!r}", \
                    "request_id", "request_not_found"
            raise error from exc

    async def model_info(self) -> generate_pb2.ModelInfo:
        """The served model. Cached once ready: its name and context length never change."""
        try:
            return await self.model_info_rpc()
        except grpc.RpcError as exc:
            raise rpc_error(exc) from exc

    async def model_info_rpc(self, timeout_s: float = RPC_TIMEOUT_S) -> generate_pb2.ModelInfo:
        """model_info, raising grpc.RpcError (for the gRPC front end, which passes codes on)."""
        return self._info if self._info is not None else await self.fresh_model_info(timeout_s)

    async def fresh_model_info(self, timeout_s: float = RPC_TIMEOUT_S) -> generate_pb2.ModelInfo:
        """Ask the tokenizer now (health checks must see it answer); raises grpc.RpcError."""
        info = await self.tokenizer.GetModelInfo(generate_pb2.ModelInfoRequest(), timeout=timeout_s)
        if info.model:
            self.metrics.model_name = info.model
        if info.ready:
            self._info = info
        return info

    async def served_model(self, requested: str | None) -> generate_pb2.ModelInfo:
        """Check the request's model name; raise 404 for another model, 503 while loading."""
        info = await self.model_info()
        if other_model(requested, info):
            await self.loras.sync(requested)
        if other_model(requested, info) and self.loras.path_of(requested) is None:
            raise RequestError(404, f"The model `{requested}` does not exist.", "model", "invalid_request_error",
                               "model_not_found")
        if not info.ready:
            raise not_ready_error("the model is loading")
        return info

    async def stats(self) -> scheduler_pb2.SchedulerStats:
        """The scheduler's stats; with replicas, a ready and healthy one's if any (the engine serves
        while one does), else the first's."""
        per_replica = await self.replica_stats()
        if not per_replica:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "no engine replica answered")
        return next((s for _, s in per_replica if s.ready and not s.unhealthy_cause), per_replica[0][1])

    async def replica_stats(self) -> list[tuple[str, scheduler_pb2.SchedulerStats]]:
        """(replica id, GetStats) of every replica that answers; [("", stats)] for a single engine
        (whose error is raised)."""
        stubs = await self.replica_stubs()
        if len(stubs) == 1 and not stubs[0][0]:
            return [("", await stubs[0][1].GetStats(scheduler_pb2.StatsRequest(), timeout=RPC_TIMEOUT_S))]
        answers = await asyncio.gather(*(stub.GetStats(scheduler_pb2.StatsRequest(), timeout=RPC_TIMEOUT_S)
                                         for _, stub in stubs), return_exceptions=True)
        return [(rid, a) for (rid, _), a in zip(stubs, answers) if isinstance(a, scheduler_pb2.SchedulerStats)]

    async def claim_idempotency_key(self, owner: str, key: str, client_id: str, body_digest: str) -> str:
        """The client id of the generation an Idempotency-Key names for this owner: client_id when
        this call claims it first. The same key with another body is refused (422), as Stripe and
        the IETF draft do: it is a client bug, not a retry."""
        name = f"{owner}:{hashlib.sha256(key.encode()).hexdigest()[:32]}"
        mine = f"{client_id} {body_digest}"
        bound = await asyncio.to_thread(self.idempotency.claim_idempotency_key, name, mine)
        bound_id, _, bound_digest = bound.partition(" ")
        if bound_digest != body_digest:
            raise RequestError(422, "this Idempotency-Key was used with a different request body", None,
                               code="idempotency_key_reused")
        return bound_id

    async def release_idempotency_key(self, owner: str, key: str, client_id: str, body_digest: str) -> None:
        name = f"{owner}:{hashlib.sha256(key.encode()).hexdigest()[:32]}"
        await asyncio.to_thread(self.idempotency.release_idempotency_key, name, f"{client_id} {body_digest}")

    async def request_status(self, client_id: str, caller: Caller = SINGLE_TENANT) -> dict:
        """GET /v1/requests/{id}: the caller's own request only (another owner's: 404)."""
        if not valid_client_id(client_id):
            raise RequestError(404, f"no request with id {client_id!r}", "request_id", code="request_not_found")
        request_id = caller.internal_id(client_id)
        if self.store is not None:
            stored = await asyncio.to_thread(self.store.load, request_id)
            if stored is None:
                raise RequestError(404, f"no request with id {client_id!r}", "request_id", code="request_not_found")
            return status_dict(client_id, stored.status, stored.priority, len(stored.prompt_token_ids),
                               [len(o) for o in stored.outputs], stored.finish_reasons,
                               self.metrics.merged_stamps(request_id, stored.timings), stored.num_cached_tokens)
        record = await self.get_record(request_id, client_id)
        timings = self.metrics.merged_stamps(request_id, wire.timings_to_dict(record.timings))
        return status_dict(client_id, record.status, record.priority, len(record.prompt_token_ids),
                           [len(o.ids) for o in record.outputs], list(record.finish_reasons), timings, None)

    async def engine_stats(self, steps: int = 256, caller: Caller = SINGLE_TENANT, replica: str = "") -> dict:
        """GET /v1/engine/stats: the scheduler's snapshot as JSON, each recent request's timings
        merged with this gateway's own stamps of it (first_token_streamed and the TTFT breakdown);
        the caller sees its own requests (an operator all). The snapshot is shared by every poller
        for STATS_CACHE_S, fetched once however many ask at the same time: pollers never add load
        to the scheduler's step loop beyond one snapshot per interval.

        With engine replicas the JSON is one replica's (`replica`, default the first) and adds
        `replica` (its id) and `replicas`: every replica's id, address, queues and KV usage."""
        steps = max(0, min(int(steps), MAX_STATS_STEPS))
        stubs = await self.replica_stubs()
        if len(stubs) == 1 and not stubs[0][0]:
            return engine_stats_dict(await self._engine_snapshot(), steps, self.metrics.merged_stamps, caller)
        answers = await asyncio.gather(*(self._engine_snapshot(rid, stub) for rid, stub in stubs),
                                       return_exceptions=True)
        infos = {r.id: r for r in self.replicas.replicas}
        listed, chosen = [], None
        for (rid, _), msg in zip(stubs, answers):
            entry = {"id": rid, "ready": False}
            if caller.admin:  # where the internal services listen: the operator's to know
                entry["addr"] = infos[rid].addr if rid in infos else ""
            if isinstance(msg, scheduler_pb2.EngineStats):
                view = engine_stats_dict(msg, 0, None, caller)
                used = sum(1 for c in msg.block_states if c == "u")
                totals = view["totals"]
                entry |= {"ready": msg.ready, "queue_lengths": view["queue_lengths"], "queues": view["queues"],
                          "kv": {"num_blocks": msg.num_blocks, "usage": used / msg.num_blocks if msg.num_blocks
                                 else 0.0},
                          "prefix_cache_queries": totals.get("prefix_cache_queries", 0),
                          "prefix_cache_hits": totals.get("prefix_cache_hits", 0)}
                if chosen is None or rid == replica:
                    chosen = (rid, msg)
            else:
                entry["error"] = ((rpc_error(msg).message if isinstance(msg, grpc.RpcError) else str(msg))
                                  if caller.admin else "unavailable")  # raw errors name internal addresses
            listed.append(entry)
        if chosen is None:
            raise RequestError(503, "no engine replica answered", None, "service_unavailable")
        out = engine_stats_dict(chosen[1], steps, self.metrics.merged_stamps, caller)
        out["replica"], out["replicas"] = chosen[0], listed
        return out

    async def _engine_snapshot(self, replica: str = "", stub=None) -> scheduler_pb2.EngineStats:
        """One scheduler's GetEngineStats, cached STATS_CACHE_S and fetched once for every waiter."""
        now = time.monotonic()
        cached = self._stats_by_replica.get(replica)
        if cached is not None and now - cached[0] <= STATS_CACHE_S:
            return cached[1]
        fetch = self._fetches.get(replica)
        if fetch is None:
            fetch = self._fetches[replica] = asyncio.ensure_future((stub or self.scheduler).GetEngineStats(
                scheduler_pb2.EngineStatsRequest(max_steps=MAX_STATS_STEPS), timeout=RPC_TIMEOUT_S))
            fetch.add_done_callback(lambda f: self._stats_fetched(replica, f))
        try:
            return await asyncio.shield(fetch)
        except grpc.RpcError as exc:
            if not replica:
                raise rpc_error(exc) from exc
            raise

    def _stats_fetched(self, replica: str, fetch: asyncio.Future) -> None:
        self._fetches.pop(replica, None)
        if not fetch.cancelled() and fetch.exception() is None:
            self._stats_by_replica[replica] = (time.monotonic(), fetch.result())
