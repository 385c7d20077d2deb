"""What the gateway's front ends (REST and gRPC) share: the stubs of the services behind it, the
API key, the request store, the metrics, and the one table mapping gRPC codes to HTTP."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections import OrderedDict

import grpc
from pagedserve.common import wire
from pagedserve.common.grpc_util import internal_channel
from pagedserve.common.store import MemoryStore, RequestStore
from pagedserve.v1 import generate_pb2, generate_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from pagedserve.gateway.limits import Limits, RateLimiter
from pagedserve.gateway.metrics import Metrics
from pagedserve.gateway.protocol import RequestError
from pagedserve.gateway.responses import timings_object

RPC_TIMEOUT_S = 5.0
MAX_LOCAL_RESUME_RECORDS = 10_000

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


def not_ready_error(cause: str) -> RequestError:
    return RequestError(503, cause, None, "service_unavailable", "model_not_ready", headers={"Retry-After": "5"})


class Backend:
    """Holds the grpc.aio stubs (created on first use, inside the serving event loop)."""

    def __init__(self, tokenizer_addr: str, scheduler_addr: str, api_key: str | list[str] | None = None,
                 store: RequestStore | None = None, metrics: Metrics | None = None,
                 limits: Limits | None = None) -> None:
        self.tokenizer_addr, self.scheduler_addr = tokenizer_addr, scheduler_addr
        keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        # Several keys may be valid; each is compared in constant time (and never logged).
        self.api_keys: list[bytes] = [k.strip().encode() for k in keys if k and k.strip()]
        self.limits = limits or Limits()
        self.rate_limiter = RateLimiter(*self.limits.rate_limit) if self.limits.rate_limit else None
        self.draining = False
        self.inflight: set = set()  # the generations this gateway is serving (app._Generation)
        self.tokens_in_flight = 0   # the sum of their prompt + n * max_tokens
        self._resume_local: OrderedDict[str, str] = OrderedDict()
        # With no Redis the request records are the scheduler's; idempotency keys live here.
        self.store = store if store is not None and store.durable else None
        self.idempotency: RequestStore = store if store is not None else MemoryStore()
        self.metrics = metrics or Metrics()
        self._channels: list[grpc.aio.Channel] = []
        self._tokenizer: generate_pb2_grpc.TokenizerStub | None = None
        self._scheduler: scheduler_pb2_grpc.SchedulerStub | None = None
        self._info: generate_pb2.ModelInfo | None = None

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = internal_channel(address, aio=True)
        self._channels.append(channel)
        return channel

    @property
    def tokenizer(self) -> generate_pb2_grpc.TokenizerStub:
        if self._tokenizer is None:
            self._tokenizer = generate_pb2_grpc.TokenizerStub(self._channel(self.tokenizer_addr))
        return self._tokenizer

    @property
    def scheduler(self) -> scheduler_pb2_grpc.SchedulerStub:
        if self._scheduler is None:
            self._scheduler = scheduler_pb2_grpc.SchedulerStub(self._channel(self.scheduler_addr))
        return self._scheduler

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
        self._channels.clear()
        self._tokenizer = self._scheduler = None

    @property
    def api_key(self) -> str | None:
        """The first key (for callers that need one to pass on); None when no key is required."""
        return self.api_keys[0].decode() if self.api_keys else None

    def key_ok(self, authorization: str | None) -> bool:
        if not self.api_keys:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        given = token.strip().encode()
        ok = False
        for key in self.api_keys:  # every key compared: the time does not tell which one matched
            ok |= hmac.compare_digest(given, key)
        return ok and scheme.lower() == "bearer"

    # -- admission -----------------------------------------------------------------------------
    def reserve_tokens(self, tokens: int) -> bool:
        bound = self.limits.max_tokens_in_flight
        if bound > 0 and self.tokens_in_flight > 0 and self.tokens_in_flight + tokens > bound:
            return False
        self.tokens_in_flight += tokens
        return True

    def release_tokens(self, tokens: int) -> None:
        self.tokens_in_flight = max(0, self.tokens_in_flight - tokens)

    async def abort(self, request_id: str) -> None:
        """Abort a request at the scheduler (its KV blocks are freed); errors are only logged."""
        try:
            await self.scheduler.Abort(scheduler_pb2.AbortRequest(request_id=request_id), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            log.info("abort of request %s failed: %s", request_id, exc.code().name if hasattr(exc, "code") else exc)

    # -- what a resumed stream needs to know (stop strings, chat or completion, ...) ----------
    def _resume_key(self, request_id: str) -> str:
        return f"{getattr(self.idempotency, 'prefix', '')}gwresume:{request_id}"

    async def save_resume_record(self, request_id: str, record: dict) -> None:
        text = json.dumps(record, separators=(",", ":"))
        client = getattr(self.idempotency, "client", None)
        if client is not None:
            try:
                ttl = int(getattr(self.idempotency, "ttl_s", 3600))
                await asyncio.to_thread(client.set, self._resume_key(request_id), text, ex=ttl)
                return
            except Exception as exc:  # noqa: BLE001 - Redis trouble must not fail the request
                log.warning("could not store the resume record of %s: %s", request_id, type(exc).__name__)
        self._resume_local[request_id] = text
        while len(self._resume_local) > MAX_LOCAL_RESUME_RECORDS:
            self._resume_local.popitem(last=False)

    async def load_resume_record(self, request_id: str) -> dict | None:
        text = self._resume_local.get(request_id)
        client = getattr(self.idempotency, "client", None)
        if text is None and client is not None:
            try:
                text = await asyncio.to_thread(client.get, self._resume_key(request_id))
            except Exception as exc:  # noqa: BLE001
                log.warning("could not load the resume record of %s: %s", request_id, type(exc).__name__)
        try:
            return json.loads(text) if text else None
        except ValueError:
            return None

    async def get_record(self, request_id: str) -> scheduler_pb2.RequestRecord:
        try:
            return await self.scheduler.GetRequest(scheduler_pb2.GetRequestRequest(request_id=request_id),
                                                   timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            error = rpc_error(exc)
            if error.status == 404:
                error.message, error.param, error.code = f"no request with id {request_id!r}", "request_id", \
                    "request_not_found"
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
        if info.ready:
            self._info = info
        return info

    async def served_model(self, requested: str | None) -> generate_pb2.ModelInfo:
        """Check the request's model name; raise 404 for another model, 503 while loading."""
        info = await self.model_info()
        if requested and requested != info.model:
            raise RequestError(404, f"The model `{requested}` does not exist.", "model", "invalid_request_error",
                               "model_not_found")
        if not info.ready:
            raise not_ready_error("the model is loading")
        return info

    async def stats(self) -> scheduler_pb2.SchedulerStats:
        return await self.scheduler.GetStats(scheduler_pb2.StatsRequest(), timeout=RPC_TIMEOUT_S)

    async def claim_idempotency_key(self, key: str, request_id: str) -> str:
        return await asyncio.to_thread(self.idempotency.claim_idempotency_key, key, request_id)

    async def request_status(self, request_id: str) -> dict:
        if self.store is not None:
            stored = await asyncio.to_thread(self.store.load, request_id)
            if stored is None:
                raise RequestError(404, f"no request with id {request_id!r}", "request_id", code="request_not_found")
            return status_dict(request_id, stored.status, stored.priority, len(stored.prompt_token_ids),
                               [len(o) for o in stored.outputs], stored.finish_reasons,
                               self.metrics.merged_stamps(request_id, stored.timings), stored.num_cached_tokens)
        record = await self.get_record(request_id)
        timings = self.metrics.merged_stamps(request_id, wire.timings_to_dict(record.timings))
        return status_dict(request_id, record.status, record.priority, len(record.prompt_token_ids),
                           [len(o.ids) for o in record.outputs], list(record.finish_reasons), timings, None)

    async def engine_stats(self, steps: int = 256) -> dict:
        """GET /v1/engine/stats: the scheduler's snapshot as JSON, each recent request's timings
        merged with this gateway's own stamps of it (first_token_streamed and the TTFT breakdown)."""
        steps = max(0, min(int(steps), 512))
        try:
            msg = await self.scheduler.GetEngineStats(scheduler_pb2.EngineStatsRequest(max_steps=max(steps, 1)),
                                                      timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise rpc_error(exc) from exc
        return engine_stats_dict(msg, steps, self.metrics.merged_stamps)


# (stage, from stamp, to stamp): the order a request moves through the pipeline.
STAGES = [("gateway", "gateway_received", "tokenizer_received"),
          ("tokenizer", "tokenizer_received", "tokenized"),
          ("to_scheduler", "tokenized", "scheduler_received"),
          ("queue", "scheduler_received", "first_scheduled"),
          ("prefill", "first_scheduled", "first_token"),
          ("decode", "first_token", "finished"),
          ("detokenize", "finished", "detokenized"),
          ("network", "first_token", "first_token_streamed"),
          ("stream", "first_token_streamed", "last_token_streamed")]


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name)


def status_dict(request_id: str, status: str, priority: int, prompt_tokens: int, output_tokens: list[int],
                finish_reasons: list[str], timings: dict, cached_tokens: int | None) -> dict:
    t = {_snake(k): v for k, v in (timings or {}).items()}
    timeline = []
    for stage, start_key, end_key in STAGES:
        start, end = float(t.get(start_key) or 0), float(t.get(end_key) or 0)
        if start > 0 and end > 0:
            timeline.append({"stage": stage, "start": start, "end": end, "duration_s": round(end - start, 6)})
    reasons = list(finish_reasons) + [""] * (len(output_tokens) - len(finish_reasons))
    out = {"id": request_id, "object": "request", "status": status, "priority": priority,
           "prompt_tokens": prompt_tokens,
           "samples": [{"index": i, "output_tokens": n, "finish_reason": reasons[i] or None}
                       for i, n in enumerate(output_tokens)],
           "timeline": timeline, "timings": timings_object(t),
           "worker_time_s": float(t.get("worker_time_s") or 0), "num_steps": int(t.get("num_steps") or 0),
           "num_preemptions": int(t.get("num_preemptions") or 0), "checked_at": time.time()}
    if cached_tokens is not None:
        out["cached_tokens"] = cached_tokens
    return out


def _plain(msg) -> dict:
    """A message as a dict of plain values (numbers stay numbers, unlike MessageToDict's uint64)."""
    out = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        if field.message_type is not None:
            value = [_plain(v) for v in value] if field.is_repeated else _plain(value)
        elif field.is_repeated:
            value = list(value)
        out[field.name] = value
    return out


def engine_stats_dict(msg: scheduler_pb2.EngineStats, steps: int, merge=None) -> dict:
    """The JSON of GET /v1/engine/stats. merge(request_id, stamps) adds the gateway's stamps."""
    recent = []
    for rec in msg.recent_requests:
        stamps = wire.timings_to_dict(rec.timings)
        if merge is not None:
            stamps = merge(rec.request_id, stamps)
        recent.append({"request_id": rec.request_id, "prompt_tokens": rec.prompt_tokens,
                       "output_tokens": rec.output_tokens, "finish_reason": rec.finish_reason,
                       "finish_reasons": list(rec.finish_reasons), "cached_tokens": rec.cached_tokens,
                       "prefill_chunk_list": [{"time": c.time, "tokens": c.tokens} for c in rec.prefill_chunks],
                       "timings": timings_object(stamps)})
    totals = _plain(msg.totals)
    return {
        "time": msg.time or time.time(), "ready": msg.ready,
        "config": _plain(msg.config),
        "queues": {"waiting": list(msg.waiting), "running": list(msg.running), "swapped": list(msg.swapped)},
        "queue_lengths": {"waiting": msg.num_waiting, "running": msg.num_running, "swapped": msg.num_swapped},
        "kv": {"num_blocks": msg.num_blocks, "states": msg.block_states,
               "tables": {t.request_id: list(t.block_ids) for t in msg.tables}},
        "steps": [_plain(step) for step in msg.steps][-steps:] if steps else [],
        "recent_requests": recent,
        "totals": totals,
    }
