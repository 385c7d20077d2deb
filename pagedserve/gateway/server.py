"""`serve(args)`: the REST API (uvicorn) and the public gRPC API on one asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import time

import grpc
import h11
import uvicorn
import uvloop
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedserve.common import https
from pagedserve.common.grpc_util import (SERVER_OPTIONS, MalformedRequestInterceptor, add_health_and_reflection,
                                         set_serving)
from pagedserve.common.replicas import async_reader
from pagedserve.common.store import MemoryStore, open_store
from pagedserve.v1 import generate_pb2_grpc
from pagedserve.common.lora import DEFAULT_MAX_LORA_RANK, parse_lora_modules
from pagedserve.gateway.lora_adapters import LoraAdapters, SharedAdapters
from pagedserve.gateway.app import build_app
from pagedserve.gateway.backend import Backend
from pagedserve.gateway.grpc_api import SERVICE_NAME, GenerationService
from pagedserve.gateway.images import image_room, media_policy
from pagedserve.gateway.limits import Limits, parse_origins, parse_rate_limit
from pagedserve.gateway.owners import parse_key_line

log = logging.getLogger("pagedserve.gateway")


class _Uvicorn(uvicorn.Server):
    # uvicorn re-raises the signals it caught once it stops (so SIGINT would end in
    # KeyboardInterrupt); this loop handles the signals itself and stops both servers.
    @contextlib.contextmanager
    def capture_signals(self):
        yield


DRAIN_FLUSH_S = 5.0  # after the aborts, how long the aborted streams get to send their last events
# A connection must send a whole request head within this (and may idle this long between
# requests): 300 connections trickling header bytes must not hold the server.
HEADER_TIMEOUT_S = 10.0
# Connections and requests in flight beyond which uvicorn answers 503 at once.
LIMIT_CONCURRENCY = 4096


class HeaderTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request head (uvicorn has none: its
    keep-alive timer is cancelled by any byte received). Armed when the connection opens and after
    each response; when it fires while the client is still sending a head (h11 keeps the peer
    IDLE until the whole head is parsed), the connection is closed."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_deadline()

    def _arm_head_deadline(self) -> None:
        self.loop.call_later(self.timeout_keep_alive, self._head_deadline)

    def _head_deadline(self) -> None:
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def admin_keys(args) -> list[str]:
    """--admin-api-key (repeatable) and PAGEDSERVE_ADMIN_API_KEY (comma-separated)."""
    keys: list[str] = []
    given = getattr(args, "admin_api_key", None)
    for item in ([given] if isinstance(given, str) else given or []):
        keys += [k.strip() for k in item.split(",")]
    keys += [k.strip() for k in os.environ.get("PAGEDSERVE_ADMIN_API_KEY", "").split(",")]
    return list(dict.fromkeys(k for k in keys if k))


def api_keys(args) -> list[str]:
    """--api-key (repeatable, or one string), --api-key-file (one a line) and PAGEDSERVE_API_KEY
    (comma-separated)."""
    keys: list[str] = []
    given = getattr(args, "api_key", None)
    for item in ([given] if isinstance(given, str) else given or []):
        keys += [k.strip() for k in item.split(",")]
    keys += list(key_file_priorities(args))
    keys += [k.strip() for k in os.environ.get("PAGEDSERVE_API_KEY", "").split(",")]
    return list(dict.fromkeys(k for k in keys if k))


def key_file_priorities(args) -> dict[str, int | None]:
    """--api-key-file's keys, each with the min_priority its line gives (None: the default, 0)."""
    path = getattr(args, "api_key_file", None)
    if not path:
        return {}
    with open(path, encoding="utf-8") as f:
        entries = [parse_key_line(line) for line in f]
    return {key: floor for key, floor in (e for e in entries if e is not None)}


def limits_from_args(args) -> Limits:
    defaults = Limits()
    return Limits(max_body_bytes=getattr(args, "max_body_bytes", defaults.max_body_bytes),
                  max_n=getattr(args, "max_n", defaults.max_n),
                  max_tokens_in_flight=getattr(args, "max_tokens_in_flight", 0) or 0,
                  rate_limit=parse_rate_limit(getattr(args, "rate_limit", None)),
                  shutdown_timeout_s=getattr(args, "shutdown_timeout", defaults.shutdown_timeout_s),
                  resume_grace_s=getattr(args, "resume_grace", defaults.resume_grace_s),
                  cors_origins=parse_origins(getattr(args, "cors_origins", "")),
                  api_docs=not getattr(args, "disable_fastapi_docs", False))


async def drain(backend: Backend, timeout_s: float) -> int:
    """Refuse new requests (503), wait up to timeout_s for those in flight, abort the rest (their
    streams end with finish_reason "abort" and an error event saying the server shut down).
    Returns how many were aborted."""
    backend.admission.draining = True
    deadline = time.monotonic() + max(0.0, timeout_s)
    while backend.inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    left = list(backend.inflight)
    if left:
        log.info("shutdown: %d requests still in flight after %g s; aborting them", len(left), timeout_s)
        for call in left:
            call.abort_for_shutdown()
        flush_until = time.monotonic() + DRAIN_FLUSH_S
        while backend.inflight and time.monotonic() < flush_until:
            await asyncio.sleep(0.05)
    return len(left)


def is_loopback(host: str | None) -> bool:
    """Whether only this machine reaches host ('localhost', 127.0.0.0/8, ::1)."""
    if not host or host == "localhost":
        return bool(host)
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def unauthenticated_public(args, keys: list[str]) -> str | None:
    """Why this gateway must not start: a non-loopback address and no API key at all (unless
    --allow-unauthenticated), else None."""
    address = getattr(args, "published_address", None) or args.host
    if keys or getattr(args, "allow_unauthenticated", False) or is_loopback(address):
        return None
    return (f"refusing to serve {address} without an API key: anyone who reaches it could use it. Set --api-key "
            "(or PAGEDSERVE_API_KEY / --api-key-file), or --allow-unauthenticated to serve it open anyway")


async def _serve(args) -> int:
    try:
        keys, admins = api_keys(args), admin_keys(args)
        floors = {k: v for k, v in key_file_priorities(args).items() if v is not None}
        limits = limits_from_args(args)
        if getattr(args, "enable_auto_tool_choice", False) and not getattr(args, "tool_call_parser", None):
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (as vLLM's)")
        tls = (getattr(args, "ssl_keyfile", None), getattr(args, "ssl_certfile", None),
               getattr(args, "ssl_ca_certs", None), getattr(args, "ssl_cert_reqs", 0) or 0)
        if https.problem(*tls):
            raise ValueError(https.problem(*tls))
        media = media_policy(getattr(args, "limit_mm_per_prompt", None), getattr(args, "allowed_media_domains", None),
                             getattr(args, "media_fetch_timeout", 5.0))
    except (OSError, ValueError) as exc:
        log.error("bad gateway settings: %s", exc)
        return 2
    refusal = unauthenticated_public(args, keys + admins)
    if refusal:
        log.error("%s", refusal)
        return 2
    redis_url = args.redis_url if args.redis_url not in (None, "", "memory", "memory://") else None
    retention = args.request_retention
    store = open_store(redis_url, args.redis_prefix, args.redis_ttl, retention) if redis_url else \
        MemoryStore(args.redis_ttl, retention)  # idempotency keys and resume records, in this process
    backend = Backend(args.tokenizer_addr, args.scheduler_addr, api_key=keys, store=store, limits=limits,
                      admin_keys=admins, min_priorities=floors,
                      tool_call_parser=getattr(args, "tool_call_parser", None),
                      reasoning_parser=getattr(args, "reasoning_parser", None),
                      local_links=getattr(args, "service_transport", "auto") == "auto",
                      prefix_cache_scope=getattr(args, "prefix_cache_scope", "owner"),
                      runner=getattr(args, "runner", "auto"), pooler=getattr(args, "pooler", "last"))
    backend.return_tokens_as_token_ids = getattr(args, "return_tokens_as_token_ids", False)
    backend.media = media  # images in requests: --limit-mm-per-prompt, --allowed-media-domains (images.py)
    # Engine replicas, LoRA adapters and the rate limit's buckets are this Redis's, for every gateway
    reader = async_reader(store.url) if store.durable and getattr(store, "url", None) else None
    backend.loras = LoraAdapters(getattr(args, "enable_lora", False),
                                 parse_lora_modules(getattr(args, "lora_modules", None)),
                                 getattr(args, "max_lora_rank", DEFAULT_MAX_LORA_RANK),
                                 SharedAdapters(reader, args.redis_prefix) if reader else None)
    if reader:
        backend.admission.share_rate(reader, args.redis_prefix)
    await backend.loras.publish()
    if reader:
        from pagedserve.gateway.replicas import ReplicaDirectory
        backend.replicas = ReplicaDirectory(store.url, args.redis_prefix)

    # The public API's messages are bounded like REST bodies (--max-body-bytes, with room for images:
    # images.image_room): gRPC refuses a larger one with RESOURCE_EXHAUSTED before it is parsed; a text
    # model's requests are held to --max-body-bytes once parsed (grpc_api._model_info).
    options = [o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length" or not limits.max_body_bytes]
    if limits.max_body_bytes:
        options.append(("grpc.max_receive_message_length", image_room(limits.max_body_bytes, media, False)))
    grpc_server = grpc.aio.server(options=options, interceptors=[MalformedRequestInterceptor()])
    generate_pb2_grpc.add_GenerationServicer_to_server(GenerationService(backend), grpc_server)
    health = add_health_and_reflection(grpc_server, [SERVICE_NAME])
    try:
        grpc_server.add_insecure_port(f"{args.host}:{args.grpc_port}")
    except RuntimeError as exc:
        log.error("cannot listen on %s:%s for gRPC: %s", args.host, args.grpc_port, exc)
        return 1
    await grpc_server.start()

    http = _Uvicorn(uvicorn.Config(build_app(backend), host=args.host, port=args.port,
                                   log_level=getattr(args, "uvicorn_log_level", "warning"),
                                   timeout_graceful_shutdown=DRAIN_FLUSH_S, http=HeaderTimeoutH11,
                                   timeout_keep_alive=HEADER_TIMEOUT_S, limit_concurrency=LIMIT_CONCURRENCY,
                                   **https.uvicorn_kwargs(*tls)))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    http_task = asyncio.create_task(http.serve())
    stop_task = asyncio.create_task(stop.wait())
    await asyncio.sleep(0)
    set_serving(health, [SERVICE_NAME])
    log.info("OpenAI API at %s://%s:%s/v1, gRPC at %s:%s%s", https.scheme(tls[1]), args.host, args.port, args.host,
             args.grpc_port,
             f" ({len(keys)} API key(s) accepted)" if keys else "")

    code = 0
    try:
        done, _ = await asyncio.wait({http_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if http_task in done:
            # uvicorn ended on its own: it could not bind, or failed starting up.
            code = 1
            log.error("the HTTP server stopped: %s", http_task.exception() or "startup failed")
        else:
            # SIGTERM/SIGINT: drain (a second signal cuts the wait short).
            set_serving(health, [SERVICE_NAME], serving=False)
            stop.clear()
            stop_task = asyncio.create_task(stop.wait())
            drainer = asyncio.create_task(drain(backend, limits.shutdown_timeout_s))
            await asyncio.wait({drainer, stop_task}, return_when=asyncio.FIRST_COMPLETED)
            if not drainer.done():
                drainer.cancel()
                for call in list(backend.inflight):
                    call.abort_for_shutdown()
    except SystemExit as exc:
        code = int(exc.code or 1)
    finally:
        set_serving(health, [SERVICE_NAME], serving=False)
        stop_task.cancel()
        await grpc_server.stop(grace=2.0)
        http.should_exit = True
        if not http_task.done():
            with contextlib.suppress(Exception, SystemExit):
                await http_task
        await backend.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return code


def serve(args) -> int:
    try:
        return uvloop.run(_serve(args))  # asyncio on libuv: less CPU per message than asyncio's own loop
    except SystemExit as exc:
        return int(exc.code or 1) if not isinstance(exc.code, str) else 1
