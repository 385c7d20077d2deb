"""`serve(args)`: the REST API (uvicorn) and the public gRPC API on one asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

import grpc
import uvicorn

from pagedserve.grpc_util import SERVER_OPTIONS, add_health_and_reflection, set_serving
from pagedserve.store import open_store
from pagedserve.v1 import generate_pb2_grpc
from services.gateway.app import build_app
from services.gateway.backend import Backend
from services.gateway.grpc_api import SERVICE_NAME, GenerationService

log = logging.getLogger("pagedserve.gateway")


class _Uvicorn(uvicorn.Server):
    # uvicorn re-raises the signals it caught once it stops (so SIGINT would end in
    # KeyboardInterrupt); this loop handles the signals itself and stops both servers.
    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def _serve(args) -> int:
    api_key = args.api_key or os.environ.get("PAGEDSERVE_API_KEY") or None
    redis_url = args.redis_url if args.redis_url not in (None, "", "memory", "memory://") else None
    store = open_store(redis_url, args.redis_prefix, args.redis_ttl) if redis_url else None
    backend = Backend(args.tokenizer_addr, args.scheduler_addr, api_key=api_key, store=store)

    grpc_server = grpc.aio.server(options=SERVER_OPTIONS)
    generate_pb2_grpc.add_GenerationServicer_to_server(GenerationService(backend), grpc_server)
    health = add_health_and_reflection(grpc_server, [SERVICE_NAME])
    try:
        grpc_server.add_insecure_port(f"{args.host}:{args.grpc_port}")
    except RuntimeError as exc:
        log.error("cannot listen on %s:%s for gRPC: %s", args.host, args.grpc_port, exc)
        return 1
    await grpc_server.start()

    http = _Uvicorn(uvicorn.Config(build_app(backend), host=args.host, port=args.port, log_level="warning"))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    http_task = asyncio.create_task(http.serve())
    stop_task = asyncio.create_task(stop.wait())
    await asyncio.sleep(0)
    set_serving(health, [SERVICE_NAME])
    log.info("OpenAI API at http://%s:%s/v1, gRPC at %s:%s%s", args.host, args.port, args.host, args.grpc_port,
             " (API key required)" if api_key else "")

    code = 0
    try:
        done, _ = await asyncio.wait({http_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if http_task in done:
            # uvicorn ended on its own: it could not bind, or failed starting up.
            code = 1
            log.error("the HTTP server stopped: %s", http_task.exception() or "startup failed")
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
        return asyncio.run(_serve(args))
    except SystemExit as exc:
        return int(exc.code or 1) if not isinstance(exc.code, str) else 1
