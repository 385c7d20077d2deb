"""The Responses API's stored responses (`store`, true by default): GET and DELETE /v1/responses/{id}
and the records behind them and behind `previous_response_id` (responses_api.py).

A record is {"owner", "response", "conversation"}: the response object and the conversation that led
to it (the chat messages, then its output), kept for --request-retention seconds in Redis under
P gwresponse:<id> (where every gateway reads it), or in this process's memory without Redis or for a
record over the store's size bound (MAX_LOCAL_RECORDS at most, the oldest dropped). Another owner's
id, an expired one or one never stored answers 404 as if it did not exist.

Threads: the gateway's event loop; the store's calls in a worker thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict

from fastapi import Request

from pagedserve.common.store import RequestStore
from pagedserve.gateway.backend import Backend
from pagedserve.gateway.owners import SINGLE_TENANT
from pagedserve.gateway.protocol import RequestError

log = logging.getLogger("pagedserve.gateway")
MAX_LOCAL_RECORDS = 10_000


def _name(response_id: str) -> str:
    return f"gwresponse:{response_id}"


class ResponseRecords:
    """Stored responses: {"owner", "response", "conversation"} per id, for the store's retention."""

    def __init__(self, store: RequestStore) -> None:
        self.store = store
        self.retention_s = float(getattr(store, "retention_s", 600))
        self.local: OrderedDict[str, tuple[float, str]] = OrderedDict()  # id -> (expires, text)

    async def save(self, response_id: str, record: dict) -> None:
        text = json.dumps(record, separators=(",", ":"))
        try:
            if await asyncio.to_thread(self.store.put_text, _name(response_id), text):
                return
        except Exception as exc:  # noqa: BLE001 - Redis trouble or a large record: kept here instead
            log.info("response %s kept in this gateway only: %s", response_id, exc)
        self.local[response_id] = (time.monotonic() + self.retention_s, text)
        while len(self.local) > MAX_LOCAL_RECORDS:
            self.local.popitem(last=False)

    async def load(self, response_id: str, owner: str) -> dict:
        """The owner's record; 404 for anything else (unknown, expired, another owner's)."""
        text = None
        kept = self.local.get(response_id)
        if kept is not None and kept[0] > time.monotonic():
            text = kept[1]
        elif response_id.startswith("resp_") and len(response_id) < 80:
            try:
                text = await asyncio.to_thread(self.store.get_text, _name(response_id))
            except Exception as exc:  # noqa: BLE001
                log.warning("could not load response %s: %s", response_id, type(exc).__name__)
        record = json.loads(text) if text else None
        if record is None or record.get("owner") != owner:
            raise RequestError(404, f"no response with id {response_id!r}", "previous_response_id",
                               code="response_not_found")
        return record

    async def delete(self, response_id: str, owner: str) -> None:
        """Forget the owner's record (404 as load for anything else): no retrieve or previous_response_id
        finds it again, on any gateway."""
        await self.load(response_id, owner)
        self.local.pop(response_id, None)
        await asyncio.to_thread(self.store.delete_text, _name(response_id))


def records(backend: Backend) -> ResponseRecords:
    if backend.response_records is None:
        backend.response_records = ResponseRecords(backend.idempotency)
    return backend.response_records


# ---- the routes ---------------------------------------------------------------------------------
async def retrieve(backend: Backend, request: Request, response_id: str) -> dict:
    """GET /v1/responses/{id}: the caller's stored response object."""
    owner = getattr(request.state, "caller", SINGLE_TENANT).owner
    try:
        return (await records(backend).load(response_id, owner))["response"]
    except RequestError as exc:
        exc.param = None
        raise


async def delete(backend: Backend, request: Request, response_id: str) -> dict:
    """DELETE /v1/responses/{id}: OpenAI's; the caller's stored response is forgotten."""
    owner = getattr(request.state, "caller", SINGLE_TENANT).owner
    try:
        await records(backend).delete(response_id, owner)
    except RequestError as exc:
        exc.param = None
        raise
    return {"id": response_id, "object": "response", "deleted": True}
