"""The tokenizer's choice of an engine replica per request (docs/scale-out.md, "Routing").

Replicas come from the Redis registry (common/replicas.py), re-read every REFRESH_S; the tokenizer
keeps one scheduler link (one bidi stream) per replica it has used. Policies:

  round_robin   the next healthy replica in turn
  least_load    the fewest tokens queued and running: the larger of what the replica last
                published and what this tokenizer has in flight there (prompt tokens not expected
                from the cache + max_tokens of the requests it routed that have not ended), so a
                burst balances before the next heartbeat
  prefix        the longest expected prefix-cache hit, unless the replicas' loads are out of
                balance (in requests, waiting and running: the busiest has more than BALANCE_ABS
                more than the idlest and more than BALANCE_REL times as many; SGLang's router's
                rule), when least_load decides. The hit is the leading blocks of the prompt's
                block-hash chain (common/prefix_hashes.py) found in the replica's published cache,
                or routed there recently by this tokenizer (a bounded memory: requests of one
                prefix that arrive within a heartbeat stick together); equal hits go to least
                load. A prompt no replica holds any of goes to the replica this tokenizer has sent
                the fewest distinct blocks lately, so that new prefixes spread evenly and each
                replica's cache holds its share of them (not all of them, thrashing); ties go to
                least load, then in turn

A request that already has an owner (its record names a replica: a retry, a resume, a re-attach)
goes to that owner while it lives, whatever the policy: n > 1 samples and resumed streams stay on
the replica that holds them. A dead owner's request goes to the best other replica, which adopts it.

Threads: the tokenizer's event loop only.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from pagedserve.common.grpc_util import internal_channel
from pagedserve.common.inflight import tokens_in_flight
from pagedserve.common.prefix_hashes import block_hashes, image_extras, prefix_salt
from pagedserve.common.replicas import ReplicaInfo, async_reader, cached_prefix_blocks, read_replicas
from pagedserve.tokenizer.scheduler_link import SchedulerLink
from pagedserve.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("pagedserve.tokenizer")

POLICIES = ("prefix", "least_load", "round_robin")
REFRESH_S = 0.5
BALANCE_ABS = 16  # prefix: requests more on the busiest replica than on the idlest ...
BALANCE_REL = 1.5  # ... and this many times as many: then the load decides, not the cache
RECENT_BLOCKS = 65536  # block hash -> replica this tokenizer routed it to, least recent dropped first
DEFAULT_OUTPUT_ESTIMATE = 256  # tokens charged for a request without max_tokens


@dataclass(slots=True)
class Target:
    """Where one request's stream goes: a replica's scheduler ("" id: the single scheduler)."""
    id: str
    addr: str
    link: SchedulerLink
    stub: scheduler_pb2_grpc.SchedulerStub
    channel: object = None
    inflight_tokens: int = 0
    inflight_requests: int = 0
    routed: int = 0  # requests routed here by this tokenizer


@dataclass(slots=True)
class Charge:
    """What one request added to its target's in-flight tokens (released once)."""
    target: Target
    tokens: int
    released: bool = field(default=False)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.target.inflight_tokens -= self.tokens
            self.target.inflight_requests -= 1


class ReplicaRouter:
    def __init__(self, redis_url: str, prefix: str, policy: str = "prefix", local_links: bool = True) -> None:
        if policy not in POLICIES:
            raise ValueError(f"--routing-policy {policy!r}: one of {', '.join(POLICIES)}")
        self.client = async_reader(redis_url)  # a burst waits for a connection instead of failing
        self.prefix, self.policy = prefix, policy
        self.local_links = local_links  # a replica on this host: its Stream over its local socket
        self.replicas: dict[str, ReplicaInfo] = {}
        self.targets: dict[str, Target] = {}
        self.recent: OrderedDict[int, str] = OrderedDict()
        self.remembered: dict[str, int] = {}  # replica -> blocks of `recent` routed there
        self.turn = itertools.count()
        self.refreshed = 0.0
        self._refreshing: asyncio.Task | None = None

    async def close(self) -> None:
        for target in self.targets.values():
            await target.link.close()
            await target.channel.close()
        await self.client.aclose()

    # -- the registry ---------------------------------------------------------------------------
    async def refresh(self, force: bool = False) -> None:
        if not force and time.monotonic() - self.refreshed < REFRESH_S:
            return
        try:
            found = await read_replicas(self.client, self.prefix)
        except Exception as exc:  # noqa: BLE001 - Redis away: route on what was known
            log.warning("cannot read the replica registry (%s); routing on the last known replicas", exc)
            return
        self.refreshed = time.monotonic()
        gone = set(self.replicas) - {r.id for r in found}
        if gone:
            log.info("replica(s) %s left the registry", ", ".join(sorted(gone)))
        self.replicas = {r.id: r for r in found}
        for info in found:
            target = self.targets.get(info.id)
            if target is not None and target.addr != info.addr:  # it moved (a restart elsewhere)
                await target.link.close()
                await target.channel.close()
                del self.targets[info.id]

    def alive(self, replica_id: str) -> bool:
        return replica_id in self.replicas

    def target(self, replica_id: str) -> Target:
        target = self.targets.get(replica_id)
        if target is None:
            addr = self.replicas[replica_id].addr
            channel = internal_channel(addr, aio=True)
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            target = self.targets[replica_id] = Target(replica_id, addr, SchedulerLink(stub, self.local_links),
                                                            stub, channel)
        return target

    # -- the choice -----------------------------------------------------------------------------
    async def pick(self, schedule: scheduler_pb2.ScheduleRequest) -> tuple[Target, int] | None:
        """The replica for this request and the prompt tokens expected from its prefix cache; None
        when no replica is registered."""
        await self.refresh()
        if not self.replicas:
            await self.refresh(force=True)
            if not self.replicas:
                return None
        owner = ""
        hashes: list[int] = []
        block_size = next(iter(self.replicas.values())).block_size
        prompt = schedule.prompt_token_ids
        if self.policy == "prefix" and prompt:
            params = schedule.params  # the proto: its salt as SamplingParams.prefix_salt makes it
            salt = prefix_salt(params.cache_salt, params.lora_name, params.lora_path)
            extras = image_extras(schedule.images, block_size) if schedule.images else None  # (offsets, hashes)
            hashes = block_hashes(prompt, block_size, (len(prompt) - 1) // block_size, salt, extras)
        pipe = self.client.pipeline(transaction=False)
        if schedule.request_id:
            pipe.hget(f"{self.prefix}req:{schedule.request_id}", "replica")
        try:
            if schedule.request_id:
                owner = (await pipe.execute())[0] or ""
        except Exception as exc:  # noqa: BLE001 - route without the owner
            log.info("request %s: owner lookup failed (%s)", schedule.request_id, exc)
        if owner in self.replicas:
            return self.target(owner), 0
        healthy = [r for r in self.replicas.values() if r.healthy] or list(self.replicas.values())
        ids = [r.id for r in healthy]
        hits = {r: 0 for r in ids}
        if self.policy == "round_robin" or len(ids) == 1:
            chosen = ids[next(self.turn) % len(ids)]
        else:
            mine = {r: self.targets.get(r) for r in ids}
            load = {r.id: max(r.load_tokens, mine[r.id].inflight_tokens if mine[r.id] else 0) for r in healthy}
            count = {r.id: max(r.num_waiting + r.num_running, mine[r.id].inflight_requests if mine[r.id] else 0)
                     for r in healthy}
            busiest, idlest = max(count.values()), min(count.values())
            balanced = busiest - idlest <= BALANCE_ABS or busiest <= BALANCE_REL * idlest
            if self.policy == "prefix" and hashes and balanced:
                try:
                    hits = await cached_prefix_blocks(self.client, self.prefix, ids, hashes)
                except Exception as exc:  # noqa: BLE001 - route on load and the local memory
                    log.info("prefix lookup failed (%s)", exc)
                for replica_id, blocks in self._recent_hits(hashes).items():
                    if replica_id in hits:
                        hits[replica_id] = max(hits[replica_id], blocks)
            first = next(self.turn)
            order = {r: (i - first) % len(ids) for i, r in enumerate(ids)}  # ties in turn
            if any(hits.values()):
                chosen = max(ids, key=lambda r: (hits[r], -load[r], -order[r]))
            elif hashes and balanced:  # a new prefix: where this tokenizer sent the fewest blocks
                chosen = min(ids, key=lambda r: (self.remembered.get(r, 0), load[r], order[r]))
            else:
                chosen = min(ids, key=lambda r: (load[r], order[r]))
        if hashes:
            self._remember(hashes, chosen)
        target = self.target(chosen)
        target.routed += 1
        return target, hits.get(chosen, 0) * block_size

    def charge(self, target: Target, schedule: scheduler_pb2.ScheduleRequest, cached_tokens: int = 0) -> Charge:
        """Count the request's work on target until it ends: its prompt tokens not expected from the
        prefix cache, and its output budget."""
        params = schedule.params
        tokens = tokens_in_flight(len(schedule.prompt_token_ids), params.n,
                                  params.max_tokens if params.HasField("max_tokens") else None,
                                  unset_output=DEFAULT_OUTPUT_ESTIMATE, cached_tokens=cached_tokens)
        target.inflight_tokens += tokens
        target.inflight_requests += 1
        return Charge(target, tokens)

    def _recent_hits(self, hashes: list[int]) -> dict[str, int]:
        """replica -> leading blocks of hashes this tokenizer routed there last."""
        first = self.recent.get(hashes[0])
        if first is None:
            return {}
        count = 0
        for h in hashes:
            if self.recent.get(h) != first:
                break
            count += 1
        return {first: count}

    def _remember(self, hashes: list[int], replica_id: str) -> None:
        counts = self.remembered
        for h in hashes:
            before = self.recent.get(h)
            if before != replica_id:
                if before is not None:
                    counts[before] -= 1
                counts[replica_id] = counts.get(replica_id, 0) + 1
            self.recent[h] = replica_id
            self.recent.move_to_end(h)
        while len(self.recent) > RECENT_BLOCKS:
            counts[self.recent.popitem(last=False)[1]] -= 1
