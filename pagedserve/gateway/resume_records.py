"""What a resumed stream needs to know that the scheduler's record does not hold (chat or
completion, stop strings, n, ...): one small JSON record per streamed request, kept in Redis
(RequestStore.put_text, under P gwresume:<id>, for the store's TTL) so that any gateway of the
stack can resume it, or in this process when there is no Redis or Redis fails.

Threads: called on the serving event loop; the store's blocking calls run in a worker thread
(asyncio.to_thread); the local fallback is touched on the loop only.
Invariants: Redis trouble never fails a request (it is logged, and the local copy is used); the
local copy keeps at most MAX_LOCAL_RESUME_RECORDS records, the oldest dropped first.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict

from pagedserve.common.store import RequestStore

MAX_LOCAL_RESUME_RECORDS = 10_000

log = logging.getLogger("pagedserve.gateway")


def _name(request_id: str) -> str:
    return f"gwresume:{request_id}"


class ResumeRecords:
    def __init__(self, store: RequestStore) -> None:
        self.store = store
        self.local: OrderedDict[str, str] = OrderedDict()

    async def save(self, request_id: str, record: dict) -> None:
        text = json.dumps(record, separators=(",", ":"))
        try:
            if await asyncio.to_thread(self.store.put_text, _name(request_id), text):
                return
        except Exception as exc:  # noqa: BLE001 - Redis trouble must not fail the request
            log.warning("could not store the resume record of %s: %s", request_id, type(exc).__name__)
        self.local[request_id] = text
        while len(self.local) > MAX_LOCAL_RESUME_RECORDS:
            self.local.popitem(last=False)

    async def load(self, request_id: str) -> dict | None:
        text = self.local.get(request_id)
        if text is None:
            try:
                text = await asyncio.to_thread(self.store.get_text, _name(request_id))
            except Exception as exc:  # noqa: BLE001
                log.warning("could not load the resume record of %s: %s", request_id, type(exc).__name__)
        try:
            return json.loads(text) if text else None
        except ValueError:
            return None
