"""Readiness of the stack as the gateway sees it (GET /health and /health/ready): asks the
tokenizer for the model and the scheduler for its stats, now (no cached answer).

Threads: runs on the serving event loop. Every answer but "ok" is a 503 with Retry-After and
the cause in words.
"""

from __future__ import annotations

import asyncio

import grpc
from fastapi.responses import JSONResponse

from pagedserve.gateway.backend import Backend, not_ready_error, rpc_error
from pagedserve.gateway.protocol import RequestError

def _unavailable(status: str, cause: str) -> JSONResponse:
    return JSONResponse({"status": status, "cause": cause}, status_code=503, headers={"Retry-After": "5"})


async def readiness(backend: Backend) -> JSONResponse:
    """503 with the cause while the model loads, a service or worker rank is gone, the engine is
    stalled with work pending, or Redis is unreachable; else 200 with the model's name."""
    try:
        info, stats = await asyncio.gather(backend.fresh_model_info(), backend.stats())
    except grpc.RpcError as exc:
        return _unavailable("unavailable", rpc_error(exc).message)
    except RequestError as exc:
        return _unavailable("unavailable", exc.message)
    if not (info.ready and stats.ready):
        return _unavailable("loading", not_ready_error("the model is loading").message)
    if stats.unhealthy_cause:
        return _unavailable("unhealthy", stats.unhealthy_cause)
    return JSONResponse({"status": "ok", "model": info.model})
