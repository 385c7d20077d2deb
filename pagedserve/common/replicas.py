"""The replica registry in Redis: what each engine replica (one scheduler and its worker ranks)
publishes about itself, and how tokenizers and gateways read it. The layout is the contract of
docs/scale-out.md ("Redis keys"):

  P replicas              set of replica ids (no TTL; an id whose info key is gone is dead)
  P replica:<id>          hash: ReplicaInfo's fields; expires --heartbeat-ttl after the last beat
  P replica:<id>:blocks   set of the decimal block hashes the replica's prefix cache holds, at most
                          --published-prefix-blocks; expires with the info key

The publisher sends only the change since its last beat (SADD new hashes, SREM evicted ones), and
rewrites the whole set every FULL_REWRITE_BEATS beats (or when its info key had expired), so a lost
write heals itself. Threads: ReplicaPublisher is used by one thread (the scheduler's heartbeat);
the readers are coroutines on their caller's event loop (redis.asyncio). No torch.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields

log = logging.getLogger(__name__)

REPLICA_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
FULL_REWRITE_BEATS = 30
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
DEFAULT_HEARTBEAT_TTL_S = 5.0
DEFAULT_PUBLISHED_BLOCKS = 16384
# The readers' connections to Redis: a burst of requests waits for one of these (up to the timeout) instead
# of failing. redis-py's own asyncio pool refuses the 101st concurrent command ("Too many connections").
READER_CONNECTIONS = 32
READER_WAIT_S = 10.0


def async_reader(redis_url: str, max_connections: int = READER_CONNECTIONS):
    """A redis.asyncio client for the registry's readers (gateways, tokenizers): at most max_connections
    connections, a command beyond them waiting up to READER_WAIT_S for one (BlockingConnectionPool)."""
    import redis.asyncio
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        redis_url, max_connections=max_connections, timeout=READER_WAIT_S, decode_responses=True,
        socket_timeout=5.0, socket_connect_timeout=2.0)
    return redis.asyncio.Redis.from_pool(pool)  # (aclose closes the pool too)


def check_replica_id(replica_id: str) -> str:
    if not REPLICA_ID.match(replica_id):
        raise ValueError(f"--replica-id {replica_id!r}: use 1 to 64 letters, digits, '-', '_' or '.', "
                         "starting with a letter or digit")
    return replica_id


@dataclass(slots=True)
class ReplicaInfo:
    """One replica as its last heartbeat described it."""
    id: str
    addr: str
    model: str = ""
    healthy: bool = True
    num_gpu_blocks: int = 0
    block_size: int = 16
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    num_waiting: int = 0
    num_running: int = 0
    waiting_tokens: int = 0  # prompt tokens of the waiting requests
    running_tokens: int = 0  # prompt + output tokens of the running requests (their KV)
    pending_tokens: int = 0  # tokens still to prefill (or recompute), waiting and running requests
    kv_usage: float = 0.0  # 0..1
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    started: float = 0.0
    heartbeat: float = 0.0

    def to_fields(self) -> dict[str, str]:
        return {k: str(int(v) if isinstance(v, bool) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_fields(cls, data: dict[str, str]) -> ReplicaInfo:
        kwargs = {}
        for f in fields(cls):
            if f.name not in data:
                continue
            text = data[f.name]
            kind = f.type if isinstance(f.type, type) else {"str": str, "int": int, "float": float,
                                                             "bool": bool}[f.type]
            kwargs[f.name] = bool(int(text)) if kind is bool else kind(text)
        return cls(**kwargs)

    @property
    def load_tokens(self) -> int:
        """Work ahead, in tokens: what is still to prefill, and one token per running sequence."""
        return self.pending_tokens + self.num_running


@dataclass(frozen=True, slots=True)
class RegistryKeys:
    prefix: str

    @property
    def replicas(self) -> str:
        return f"{self.prefix}replicas"

    def info(self, replica_id: str) -> str:
        return f"{self.prefix}replica:{replica_id}"

    def blocks(self, replica_id: str) -> str:
        return f"{self.prefix}replica:{replica_id}:blocks"


class ReplicaPublisher:
    """The scheduler's side: beat() publishes its info and its prefix cache's change; remove()
    takes it out of routing at once (a clean stop)."""

    def __init__(self, client, prefix: str, replica_id: str, ttl_s: float = DEFAULT_HEARTBEAT_TTL_S,
                 max_blocks: int = DEFAULT_PUBLISHED_BLOCKS) -> None:
        self.client, self.keys, self.id = client, RegistryKeys(prefix), check_replica_id(replica_id)
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.max_blocks = max_blocks
        self.published: set[int] = set()
        self.beats = 0

    def beat(self, info: ReplicaInfo, cached_hashes: Iterable[int] | None) -> None:
        """cached_hashes: the prefix cache's hashes, most recently cached last (None: unknown this
        beat, keep what was published)."""
        info.heartbeat = time.time()
        info_key, blocks_key = self.keys.info(self.id), self.keys.blocks(self.id)
        full = self.beats % FULL_REWRITE_BEATS == 0 or not self.client.exists(info_key)
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(info_key, mapping=info.to_fields())
        pipe.pexpire(info_key, self.ttl_ms)
        pipe.sadd(self.keys.replicas, self.id)
        if cached_hashes is not None:
            hashes = list(cached_hashes)
            now = set(hashes[-self.max_blocks:]) if self.max_blocks > 0 else set()
            if full:
                pipe.delete(blocks_key)
                added, removed = now, set()
            else:
                added, removed = now - self.published, self.published - now
            if added:
                pipe.sadd(blocks_key, *added)
            if removed:
                pipe.srem(blocks_key, *removed)
            self.published = now
        pipe.pexpire(blocks_key, self.ttl_ms)
        pipe.execute()
        self.beats += 1

    def remove(self) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.keys.info(self.id), self.keys.blocks(self.id))
        pipe.srem(self.keys.replicas, self.id)
        pipe.execute()


async def read_replicas(client, prefix: str) -> list[ReplicaInfo]:
    """Every live replica (its info key has not expired), sorted by id; client: redis.asyncio."""
    keys = RegistryKeys(prefix)
    ids = sorted(await client.smembers(keys.replicas))
    if not ids:
        return []
    pipe = client.pipeline(transaction=False)
    for replica_id in ids:
        pipe.hgetall(keys.info(replica_id))
    out = []
    for replica_id, data in zip(ids, await pipe.execute()):
        if not data:
            continue  # expired: dead (its id stays in the set; a restart beats under it again)
        try:
            out.append(ReplicaInfo.from_fields({"id": replica_id, **data}))
        except (KeyError, ValueError, TypeError) as exc:
            log.warning("replica %s: unreadable registry entry (%s)", replica_id, exc)
    return out


async def cached_prefix_blocks(client, prefix: str, replica_ids: list[str], hashes: list[int]) -> dict[str, int]:
    """replica id -> how many leading blocks of `hashes` (a prompt's chain) its published prefix
    cache holds; one round trip for all replicas."""
    if not hashes or not replica_ids:
        return {r: 0 for r in replica_ids}
    keys = RegistryKeys(prefix)
    members = [str(h) for h in hashes]
    pipe = client.pipeline(transaction=False)
    for replica_id in replica_ids:
        pipe.smismember(keys.blocks(replica_id), members)
    out = {}
    for replica_id, flags in zip(replica_ids, await pipe.execute()):
        count = 0
        for present in flags:
            if not present:
                break
            count += 1
        out[replica_id] = count
    return out


async def request_owner(client, prefix: str, request_id: str) -> str:
    """The replica that owns a request (the `replica` field of its record), "" when none."""
    return await client.hget(f"{prefix}req:{request_id}", "replica") or ""
