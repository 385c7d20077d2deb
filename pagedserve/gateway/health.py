"""Readiness of the stack as the gateway sees it (GET /health and /health/ready): asks the
tokenizer for the model and the scheduler for its stats. The routes take no key, so the answer is
shared (shared_answer.SharedAnswer, ~0.5 s): pollers cannot make the gateway ask the services for
every poll.

Threads: runs on the serving event loop. Every answer but "ok" is a 503 with Retry-After and
the cause in words.
"""

from __future__ import annotations

import asyncio

import grpc
from fastapi.responses import JSONResponse

from pagedserve.gateway.backend import Backend, not_ready_error, rpc_error
from pagedserve.gateway.protocol import RequestError
from pagedserve.gateway.shared_answer import SharedAnswer


def _unavailable(status: str, cause: str) -> tuple[int, dict]:
    return 503, {"status": status, "cause": cause}


async def readiness_now(backend: Backend) -> tuple[int, dict]:
    """(503, the cause) while the model loads, a service or worker rank is gone, the engine is
    stalled with work pending, or Redis is unreachable; else (200, the model's name). Asks now."""
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
    return 200, {"status": "ok", "model": info.model}


async def readiness(answer: SharedAnswer[tuple[int, dict]]) -> JSONResponse:
    """The shared readiness answer (answer fetches readiness_now) as a response."""
    status, body = await answer.get()
    return JSONResponse(body, status_code=status, headers={"Retry-After": "5"} if status != 200 else None)
