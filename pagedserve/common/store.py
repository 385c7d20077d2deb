"""Durable request records: Redis, or an in-process stand-in when no Redis is configured.

Layout under the key prefix P (every key expires after the TTL):
  P req:<id>        hash: status, prompt (JSON ids), params (JSON), n, priority, timings (JSON),
                    finish_reasons (JSON, one per sample), num_cached_tokens
  P out:<id>:<i>    list: output token ids of sample i
  P active          set: ids not finished (what a restarted scheduler re-admits)
  P idem:<key>      string: the request id an Idempotency-Key belongs to
  P <name>          string: a small text kept by put_text (the gateway's gwresume:<id>)
"""

from __future__ import annotations

import json
import logging
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "pagedserve:"
DEFAULT_TTL_S = 24 * 3600


@dataclass(slots=True)
class RecordWrite:
    """What one step changes in one request's record: merged into one pipeline per step."""
    request_id: str
    fields: dict[str, str] = field(default_factory=dict)  # hash fields to set
    new_tokens: dict[int, list[int]] = field(default_factory=dict)  # sample index -> tokens to append
    created: bool = False  # add to the active set
    finished: bool = False  # remove from the active set
    # (Re)start the TTL of the record and of these samples' output lists: done when a key is
    # created and at the finish, not on every step (a step then costs one RPUSH per sample).
    ttl_samples: int = 0


@dataclass(slots=True)
class StoredRequest:
    request_id: str
    status: str
    prompt_token_ids: list[int]
    params: dict
    n: int
    priority: int
    timings: dict
    finish_reasons: list[str]
    outputs: list[list[int]]
    num_cached_tokens: int = 0


def _decode(request_id: str, fields: dict[str, str], outputs: list[list[int]]) -> StoredRequest:
    n = int(fields.get("n", 1))
    return StoredRequest(
        request_id=request_id, status=fields.get("status", "waiting"),
        prompt_token_ids=json.loads(fields.get("prompt", "[]")), params=json.loads(fields.get("params", "{}")),
        n=n, priority=int(fields.get("priority", 0)), timings=json.loads(fields.get("timings", "{}")),
        finish_reasons=json.loads(fields.get("finish_reasons", "[]")) or [""] * n,
        outputs=outputs, num_cached_tokens=int(fields.get("num_cached_tokens", 0)))


class RequestStore(ABC):
    """Contract: write() applies all its RecordWrites in one round trip; readers see whole steps."""

    durable = True

    @abstractmethod
    def write(self, writes: list[RecordWrite]) -> None: ...

    @abstractmethod
    def load(self, request_id: str) -> StoredRequest | None: ...

    @abstractmethod
    def active_ids(self) -> list[str]: ...

    @abstractmethod
    def claim_idempotency_key(self, key: str, request_id: str) -> str:
        """Bind key to request_id unless it is bound already; return the id it is bound to."""

    @abstractmethod
    def release_idempotency_key(self, key: str, request_id: str) -> None:
        """Unbind key if it is bound to request_id (the claimer's request was refused)."""

    @abstractmethod
    def ping(self) -> bool: ...

    def put_text(self, name: str, text: str) -> bool:
        """Keep text under P<name> for the TTL, where other processes can read it; False when this
        store keeps no such texts (the in-process store: no other process would see them)."""
        return False

    def get_text(self, name: str) -> str | None:
        """The text put_text kept under P<name>; None when there is none."""
        return None


class RedisStore(RequestStore):
    def __init__(self, url: str, prefix: str = DEFAULT_PREFIX, ttl_s: int = DEFAULT_TTL_S) -> None:
        import redis

        self.client = redis.Redis.from_url(url, decode_responses=True, socket_timeout=5.0,
                                           socket_connect_timeout=2.0)
        self.prefix, self.ttl_s, self.url = prefix, ttl_s, url

    def _req(self, request_id: str) -> str:
        return f"{self.prefix}req:{request_id}"

    def _out(self, request_id: str, index: int) -> str:
        return f"{self.prefix}out:{request_id}:{index}"

    def write(self, writes: list[RecordWrite]) -> None:
        if not writes:
            return
        pipe = self.client.pipeline(transaction=False)
        active = f"{self.prefix}active"
        for w in writes:
            key = self._req(w.request_id)
            if w.fields:
                pipe.hset(key, mapping=w.fields)
            for index, tokens in w.new_tokens.items():
                if tokens:
                    pipe.rpush(self._out(w.request_id, index), *tokens)
            if w.created or w.finished or w.ttl_samples:
                pipe.expire(key, self.ttl_s)
                for index in range(w.ttl_samples):
                    pipe.expire(self._out(w.request_id, index), self.ttl_s)
            if w.created:
                pipe.sadd(active, w.request_id)
            if w.finished:
                pipe.srem(active, w.request_id)
        pipe.execute()

    def load(self, request_id: str) -> StoredRequest | None:
        fields = self.client.hgetall(self._req(request_id))
        if not fields:
            return None
        n = int(fields.get("n", 1))
        pipe = self.client.pipeline(transaction=False)
        for index in range(n):
            pipe.lrange(self._out(request_id, index), 0, -1)
        outputs = [[int(t) for t in tokens] for tokens in pipe.execute()]
        return _decode(request_id, fields, outputs)

    def active_ids(self) -> list[str]:
        return sorted(self.client.smembers(f"{self.prefix}active"))

    def claim_idempotency_key(self, key: str, request_id: str) -> str:
        name = f"{self.prefix}idem:{key}"
        if self.client.set(name, request_id, nx=True, ex=self.ttl_s):
            return request_id
        return self.client.get(name) or request_id

    def release_idempotency_key(self, key: str, request_id: str) -> None:
        name = f"{self.prefix}idem:{key}"
        with self.client.pipeline() as pipe:  # delete only our own claim
            try:
                pipe.watch(name)
                if pipe.get(name) == request_id:
                    pipe.multi()
                    pipe.delete(name)
                    pipe.execute()
            except Exception:  # noqa: BLE001 - the claim then simply expires with the TTL
                pass

    def put_text(self, name: str, text: str) -> bool:
        self.client.set(f"{self.prefix}{name}", text, ex=int(self.ttl_s))
        return True

    def get_text(self, name: str) -> str | None:
        return self.client.get(f"{self.prefix}{name}")

    def ping(self) -> bool:
        try:
            return bool(self.client.ping())
        except Exception:  # noqa: BLE001 - any failure means "not reachable"
            return False


class MemoryStore(RequestStore):
    """In-process stand-in: the same contract, lost when the process ends (durability off)."""

    durable = False

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.hashes: dict[str, dict[str, str]] = {}
        self.outputs: dict[tuple[str, int], list[int]] = {}
        self.active: set[str] = set()
        self.idempotency: dict[str, str] = {}

    def write(self, writes: list[RecordWrite]) -> None:
        with self.lock:
            for w in writes:
                self.hashes.setdefault(w.request_id, {}).update(w.fields)
                for index, tokens in w.new_tokens.items():
                    self.outputs.setdefault((w.request_id, index), []).extend(tokens)
                if w.created:
                    self.active.add(w.request_id)
                if w.finished:
                    self.active.discard(w.request_id)

    def load(self, request_id: str) -> StoredRequest | None:
        with self.lock:
            fields = self.hashes.get(request_id)
            if fields is None:
                return None
            n = int(fields.get("n", 1))
            outputs = [list(self.outputs.get((request_id, i), [])) for i in range(n)]
            return _decode(request_id, dict(fields), outputs)

    def active_ids(self) -> list[str]:
        with self.lock:
            return sorted(self.active)

    def claim_idempotency_key(self, key: str, request_id: str) -> str:
        with self.lock:
            return self.idempotency.setdefault(key, request_id)

    def release_idempotency_key(self, key: str, request_id: str) -> None:
        with self.lock:
            if self.idempotency.get(key) == request_id:
                del self.idempotency[key]

    def ping(self) -> bool:
        return True


def open_store(url: str | None, prefix: str = DEFAULT_PREFIX, ttl_s: int = DEFAULT_TTL_S) -> RequestStore:
    """url: redis://host:port/db, or "memory" / None for the in-process store."""
    if not url or url in ("memory", "memory://"):
        log.warning("no Redis configured: request records are kept in this process only (durability off)")
        return MemoryStore()
    return RedisStore(url, prefix, ttl_s)
