"""The gateway's view of the engine replicas (docs/scale-out.md): which schedulers there are, read
from the Redis registry, and which one owns a request. With no replica registered (a single
engine) every question goes to --scheduler-addr as before.

Threads: the gateway's event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from pagedserve.common.grpc_util import internal_channel
from pagedserve.common.replicas import ReplicaInfo, async_reader, read_replicas, request_owner
from pagedserve.v1 import scheduler_pb2_grpc

log = logging.getLogger("pagedserve.gateway")
REFRESH_S = 1.0


class ReplicaDirectory:
    def __init__(self, redis_url: str, prefix: str) -> None:
        self.client = async_reader(redis_url)  # a burst waits for a connection instead of failing
        self.prefix = prefix
        self.replicas: list[ReplicaInfo] = []
        self.refreshed = 0.0
        self._stubs: dict[str, tuple[str, grpc.aio.Channel, scheduler_pb2_grpc.SchedulerStub]] = {}

    async def list(self) -> list[ReplicaInfo]:
        """The live replicas (re-read at most every REFRESH_S); [] for a single engine."""
        if time.monotonic() - self.refreshed >= REFRESH_S:
            try:
                self.replicas = await read_replicas(self.client, self.prefix)
            except Exception as exc:  # noqa: BLE001 - Redis away: health says so elsewhere
                log.info("cannot read the replica registry: %s", exc)
            self.refreshed = time.monotonic()
        return self.replicas

    def stub(self, info: ReplicaInfo) -> scheduler_pb2_grpc.SchedulerStub:
        known = self._stubs.get(info.id)
        if known is None or known[0] != info.addr:
            if known is not None:
                asyncio.ensure_future(known[1].close())
            channel = internal_channel(info.addr, aio=True)
            known = self._stubs[info.id] = (info.addr, channel, scheduler_pb2_grpc.SchedulerStub(channel))
        return known[2]

    async def owner_stubs(self, request_id: str) -> list[scheduler_pb2_grpc.SchedulerStub]:
        """The stub of the replica that owns the request; every replica's when the owner is not
        known (yet), none for a single engine."""
        replicas = await self.list()
        if not replicas:
            return []
        try:
            owner = await request_owner(self.client, self.prefix, request_id)
        except Exception:  # noqa: BLE001 - ask them all
            owner = ""
        mine = [r for r in replicas if r.id == owner]
        return [self.stub(r) for r in (mine or replicas)]

    async def close(self) -> None:
        for _, channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()
        await self.client.aclose()
