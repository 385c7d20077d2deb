"""The request store's bounds (issue 13, finding 5): finished requests are kept only for the
retention, unfinished ones for the (longer) TTL; texts have a size cap; the in-process store
expires entries like Redis and keeps at most a fixed number of them. Redis is the real one, under
a fresh key prefix."""

from __future__ import annotations

import uuid

import pytest
import redis

from pagedserve.common.store import MAX_TEXT_BYTES, MemoryStore, RecordWrite, RedisStore

REDIS_URL = "redis://127.0.0.1:6379/0"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def created(request_id: str) -> RecordWrite:
    return RecordWrite(request_id, {"status": "waiting", "n": "1", "prompt": "[1, 2]"}, created=True)


def finished(request_id: str) -> RecordWrite:
    return RecordWrite(request_id, {"status": "finished"}, {0: [7]}, finished=True, ttl_samples=1)


def test_memory_store_expires_like_redis():
    clock = Clock()
    store = MemoryStore(ttl_s=100, retention_s=10, clock=clock)
    store.write([created("run"), created("done")])
    store.write([finished("done")])
    assert store.claim_idempotency_key("k", "done") == "done"
    clock.now += 9
    assert store.load("done").outputs == [[7]] and store.claim_idempotency_key("k", "other") == "done"
    clock.now += 2  # past the retention: the finished one and the key are gone, the running one is not
    assert store.load("done") is None and store.load("run").status == "waiting"
    assert store.active_ids() == ["run"]
    assert store.claim_idempotency_key("k", "other") == "other"
    clock.now += 100  # past the TTL: an unfinished record goes too
    assert store.load("run") is None and store.active_ids() == []
    store.write([created("later")])  # and the sweep drops what nobody asked for again
    assert set(store.records) == {"later"} and list(store.idempotency) == []


def test_memory_store_keeps_at_most_its_caps_least_recently_used_first():
    store = MemoryStore(max_records=3, max_keys=2)
    store.write([created(f"r{i}") for i in range(3)])
    assert store.load("r0") is not None  # r0 used: r1 is now the least recently used
    store.write([created("r3"), created("r4")])
    assert sorted(store.records) == ["r0", "r3", "r4"] and store.load("r1") is None
    assert store.active_ids() == ["r0", "r3", "r4"]
    for i in range(4):
        store.claim_idempotency_key(f"k{i}", f"r{i}")
    assert list(store.idempotency) == ["k2", "k3"]
    assert store.claim_idempotency_key("k0", "new") == "new"  # forgotten: bound afresh
    store.release_idempotency_key("k0", "other")  # not its claim: kept
    assert store.claim_idempotency_key("k0", "newer") == "new"
    store.release_idempotency_key("k0", "new")
    assert store.claim_idempotency_key("k0", "newer") == "newer"
    assert store.put_text("gwresume:r0", "{}") is False  # no other process would read it
    with pytest.raises(ValueError, match="at most"):
        store.put_text("gwresume:r0", "x" * (MAX_TEXT_BYTES + 1))  # the same refusal as Redis'


def test_retention_text_cap_and_ttls_in_redis():
    prefix = f"pstest-{uuid.uuid4().hex[:8]}:"
    store = RedisStore(REDIS_URL, prefix, ttl_s=600, retention_s=30)
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        store.write([created("a")])
        assert 30 < client.ttl(f"{prefix}req:a") <= 600  # unfinished: kept for a restart to resume
        store.write([finished("a")])
        assert 0 < client.ttl(f"{prefix}req:a") <= 30 and 0 < client.ttl(f"{prefix}out:a:0") <= 30
        store.claim_idempotency_key("key", "a")
        assert 0 < client.ttl(f"{prefix}idem:key") <= 30
        assert store.put_text("gwresume:a", "x" * MAX_TEXT_BYTES)
        assert 0 < client.ttl(f"{prefix}gwresume:a") <= 30
        with pytest.raises(ValueError, match=f"65537 bytes; a stored text may have at most {MAX_TEXT_BYTES}"):
            store.put_text("gwresume:b", "x" * (MAX_TEXT_BYTES + 1))
        with pytest.raises(ValueError, match="at most"):
            store.put_text("gwresume:c", "é" * (MAX_TEXT_BYTES // 2 + 1))  # bytes, not characters
        assert not client.exists(f"{prefix}gwresume:b", f"{prefix}gwresume:c")
        assert RedisStore(REDIS_URL, prefix, ttl_s=20, retention_s=3600).retention_s == 20  # never past the TTL
    finally:
        keys = client.keys(f"{prefix}*")
        if keys:
            client.delete(*keys)
        client.close()
