"""Durable request records: Redis, or an in-process stand-in when no Redis is configured.

Layout under the key prefix P (every key but `active` expires):
  P req:<id>        hash: status, prompt (JSON ids), params (JSON), n, priority, timings (JSON),
                    finish_reasons (JSON, one per sample), num_cached_tokens; images (JSON with
                    base64 pixels, common/multimodal.py) only for a prompt with images
  P out:<id>:<i>    list: output token ids of sample i
  P active          set: ids not finished (what a restarted scheduler re-admits); no TTL, so a
                    volatile-* eviction policy never drops it. An engine replica (--replica-id R,
                    docs/scale-out.md) keeps P active:R instead, and its records carry replica=R
  P idem:<key>      string: the request id an Idempotency-Key belongs to
  P <name>          string: a small text kept by put_text (the gateway's gwresume:<id>), at most
                    MAX_TEXT_BYTES

How long: a request's record (and its output lists) lives ttl_s (--redis-ttl, long: a restarted
scheduler must still find an unfinished request) from its creation or its first token, and
retention_s (--request-retention, short; never more than ttl_s) from its finish; idempotency keys
and texts live retention_s from when they were set.

Threads: RedisStore is used from any thread (redis-py's pool); MemoryStore takes its lock on every
call. Invariant of MemoryStore: it holds at most MAX_MEMORY_RECORDS records and MAX_MEMORY_KEYS
idempotency keys (the least recently used go first), and never returns an expired one.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.common.multimodal import ImageInput, images_from_json

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "pagedserve:"
DEFAULT_TTL_S = 24 * 3600  # an unfinished request's record: long enough to resume after a restart
DEFAULT_RETENTION_S = 3600  # a finished request's record, idempotency keys, texts
MAX_TEXT_BYTES = 64 * 1024  # put_text refuses larger texts
MAX_MEMORY_RECORDS = 10_000  # MemoryStore: records kept at most (least recently used dropped first)
MAX_MEMORY_KEYS = 10_000  # MemoryStore: idempotency keys kept at most


@dataclass(slots=True)
class RecordWrite:
    """What one step changes in one request's record: merged into one pipeline per step."""
    request_id: str
    fields: dict[str, str] = field(default_factory=dict)  # hash fields to set
    new_tokens: dict[int, list[int]] = field(default_factory=dict)  # sample index -> tokens to append
    created: bool = False  # add to the active set
    finished: bool = False  # remove from the active set; from now on it lives retention_s
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
    error: str = ""  # set when it failed (the message its client was given)
    error_code: str = ""  # that failure's gRPC status name
    images: tuple[ImageInput, ...] = ()  # a multimodal model's (field "images", only when it has some)


def _decode(request_id: str, fields: dict[str, str], outputs: list[list[int]]) -> StoredRequest:
    n = int(fields.get("n", 1))
    return StoredRequest(
        request_id=request_id, status=fields.get("status", "waiting"),
        prompt_token_ids=json.loads(fields.get("prompt", "[]")), params=json.loads(fields.get("params", "{}")),
        n=n, priority=int(fields.get("priority", 0)), timings=json.loads(fields.get("timings", "{}")),
        finish_reasons=json.loads(fields.get("finish_reasons", "[]")) or [""] * n,
        outputs=outputs, num_cached_tokens=int(fields.get("num_cached_tokens", 0)),
        error=fields.get("error", ""), error_code=fields.get("error_code", ""),
        images=images_from_json(fields.get("images", "")))


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

    def adopt(self, request_id: str, old_replica: str, new_replica: str) -> bool:
        """Move an unfinished request from old_replica's active set to new_replica's, atomically
        (of several adopters one wins); False when it is not in old_replica's set (finished, or
        adopted already). Only a store shared by replicas (Redis) adopts."""
        return False

    def put_text(self, name: str, text: str) -> bool:
        """Keep text under P<name> for the retention, where other processes can read it; False when
        this store keeps no such texts (the in-process store: no other process would see them).
        Raises ValueError, storing nothing, for a text over MAX_TEXT_BYTES (64 KiB) of UTF-8."""
        check_text_size(name, text)
        return False

    def get_text(self, name: str) -> str | None:
        """The text put_text kept under P<name>; None when there is none."""
        return None

    def delete_text(self, name: str) -> None:  # noqa: B027 - a store that keeps no texts has none to forget
        """Forget the text put_text kept under P<name> (none: nothing to do)."""


def check_text_size(name: str, text: str) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_TEXT_BYTES:
        raise ValueError(f"text {name[:64]!r} has {size} bytes; a stored text may have at most {MAX_TEXT_BYTES}")


class RedisStore(RequestStore):
    def __init__(self, url: str, prefix: str = DEFAULT_PREFIX, ttl_s: int = DEFAULT_TTL_S,
                 retention_s: int = DEFAULT_RETENTION_S, replica_id: str = "") -> None:
        import redis

        self.client = redis.Redis.from_url(url, decode_responses=True, socket_timeout=5.0,
                                           socket_connect_timeout=2.0)
        self.prefix, self.ttl_s, self.url = prefix, int(ttl_s), url
        self.retention_s = min(int(retention_s), self.ttl_s)
        self.replica_id = replica_id  # "": a single engine (P active, no replica field)

    def _active(self, replica_id: str | None = None) -> str:
        replica_id = self.replica_id if replica_id is None else replica_id
        return f"{self.prefix}active:{replica_id}" if replica_id else f"{self.prefix}active"

    def _req(self, request_id: str) -> str:
        return f"{self.prefix}req:{request_id}"

    def _out(self, request_id: str, index: int) -> str:
        return f"{self.prefix}out:{request_id}:{index}"

    def write(self, writes: list[RecordWrite]) -> None:
        if not writes:
            return
        pipe = self.client.pipeline(transaction=False)
        active = self._active()
        for w in writes:
            key = self._req(w.request_id)
            fields = w.fields
            if w.created and self.replica_id:
                fields = {**fields, "replica": self.replica_id}
            if fields:
                pipe.hset(key, mapping=fields)
            for index, tokens in w.new_tokens.items():
                if tokens:
                    pipe.rpush(self._out(w.request_id, index), *tokens)
            if w.created or w.finished or w.ttl_samples:
                ttl = self.retention_s if w.finished else self.ttl_s
                pipe.expire(key, ttl)
                for index in range(w.ttl_samples):
                    pipe.expire(self._out(w.request_id, index), ttl)
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
        return sorted(self.client.smembers(self._active()))

    def adopt(self, request_id: str, old_replica: str, new_replica: str) -> bool:
        if not self.client.smove(self._active(old_replica), self._active(new_replica), request_id):
            return False
        self.client.hset(self._req(request_id), "replica", new_replica)
        return True

    def owner(self, request_id: str) -> str:
        """The replica whose active set holds the request per its record ("" for none)."""
        return self.client.hget(self._req(request_id), "replica") or ""

    def claim_idempotency_key(self, key: str, request_id: str) -> str:
        name = f"{self.prefix}idem:{key}"
        if self.client.set(name, request_id, nx=True, ex=self.retention_s):
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
        check_text_size(name, text)
        self.client.set(f"{self.prefix}{name}", text, ex=self.retention_s)
        return True

    def get_text(self, name: str) -> str | None:
        return self.client.get(f"{self.prefix}{name}")

    def delete_text(self, name: str) -> None:
        self.client.delete(f"{self.prefix}{name}")

    def ping(self) -> bool:
        try:
            return bool(self.client.ping())
        except Exception:  # noqa: BLE001 - any failure means "not reachable"
            return False


@dataclass(slots=True)
class _MemoryRecord:
    fields: dict[str, str] = field(default_factory=dict)
    outputs: dict[int, list[int]] = field(default_factory=dict)
    expires: float = float("inf")


class MemoryStore(RequestStore):
    """In-process stand-in: the same contract, lost when the process ends (durability off).
    Bounded: records expire as in Redis (ttl_s, then retention_s once finished) and at most
    max_records records and max_keys idempotency keys are kept, the least recently used dropped
    first. clock: seconds, monotonic (tests inject one)."""

    durable = False

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, retention_s: float = DEFAULT_RETENTION_S,
                 max_records: int = MAX_MEMORY_RECORDS, max_keys: int = MAX_MEMORY_KEYS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.retention_s = ttl_s, min(retention_s, ttl_s)
        self.max_records, self.max_keys = max_records, max_keys
        self.clock = clock
        self.lock = threading.Lock()
        self.records: OrderedDict[str, _MemoryRecord] = OrderedDict()  # least recently used first
        self.active: set[str] = set()
        self.idempotency: OrderedDict[str, tuple[str, float]] = OrderedDict()  # key -> (id, expires)
        self.next_sweep = 0.0

    def _record(self, request_id: str, now: float) -> _MemoryRecord | None:
        record = self.records.get(request_id)
        if record is not None and record.expires <= now:
            self._drop(request_id)
            return None
        if record is not None:
            self.records.move_to_end(request_id)
        return record

    def _drop(self, request_id: str) -> None:
        self.records.pop(request_id, None)
        self.active.discard(request_id)

    def _bound(self, now: float) -> None:
        """Drop the least recently used beyond the caps; now and then, every expired entry."""
        while len(self.records) > self.max_records:
            self._drop(next(iter(self.records)))
        while len(self.idempotency) > self.max_keys:
            self.idempotency.popitem(last=False)
        if now >= self.next_sweep:  # at most once a second: O(entries)
            self.next_sweep = now + 1.0
            for request_id in [r for r, rec in self.records.items() if rec.expires <= now]:
                self._drop(request_id)
            for key in [k for k, (_, expires) in self.idempotency.items() if expires <= now]:
                del self.idempotency[key]

    def write(self, writes: list[RecordWrite]) -> None:
        with self.lock:
            now = self.clock()
            for w in writes:
                record = self._record(w.request_id, now)
                if record is None:
                    record = self.records[w.request_id] = _MemoryRecord(expires=now + self.ttl_s)
                record.fields.update(w.fields)
                for index, tokens in w.new_tokens.items():
                    record.outputs.setdefault(index, []).extend(tokens)
                if w.created or w.finished or w.ttl_samples:
                    record.expires = now + (self.retention_s if w.finished else self.ttl_s)
                if w.created:
                    self.active.add(w.request_id)
                if w.finished:
                    self.active.discard(w.request_id)
            self._bound(now)

    def load(self, request_id: str) -> StoredRequest | None:
        with self.lock:
            record = self._record(request_id, self.clock())
            if record is None:
                return None
            n = int(record.fields.get("n", 1))
            outputs = [list(record.outputs.get(i, [])) for i in range(n)]
            return _decode(request_id, dict(record.fields), outputs)

    def active_ids(self) -> list[str]:
        with self.lock:
            now = self.clock()
            return sorted(r for r in self.active if self._record(r, now) is not None)

    def claim_idempotency_key(self, key: str, request_id: str) -> str:
        with self.lock:
            now = self.clock()
            bound = self.idempotency.get(key)
            if bound is not None and bound[1] > now:
                self.idempotency.move_to_end(key)
                return bound[0]
            self.idempotency[key] = (request_id, now + self.retention_s)
            self.idempotency.move_to_end(key)
            self._bound(now)
            return request_id

    def release_idempotency_key(self, key: str, request_id: str) -> None:
        with self.lock:
            bound = self.idempotency.get(key)
            if bound is not None and bound[0] == request_id:
                del self.idempotency[key]

    def ping(self) -> bool:
        return True


def open_store(url: str | None, prefix: str = DEFAULT_PREFIX, ttl_s: int = DEFAULT_TTL_S,
               retention_s: int = DEFAULT_RETENTION_S, replica_id: str = "") -> RequestStore:
    """url: redis://[:password@]host:port/db, or "memory" / None for the in-process store;
    replica_id: this engine replica's (docs/scale-out.md), which needs Redis."""
    if not url or url in ("memory", "memory://"):
        if replica_id:
            raise ValueError(f"--replica-id {replica_id!r} needs a shared Redis (--redis-url), not the "
                             "in-process store")
        log.warning("no Redis configured: request records are kept in this process only (durability off)")
        return MemoryStore(ttl_s, retention_s)
    return RedisStore(url, prefix, ttl_s, retention_s, replica_id)
