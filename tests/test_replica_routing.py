"""The replica registry and the tokenizer's routing policies against a real Redis (a fresh key
prefix per test): what a replica publishes (incrementally, bounded, with a TTL), the block-hash
chain the router computes (equal to the block manager's), and each policy's choice. The replicas
here are registry entries only: picking a replica opens no connection."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from pagedserve.common.prefix_hashes import block_hashes
from pagedserve.common.replicas import ReplicaInfo, ReplicaPublisher, read_replicas
from pagedserve.scheduler.core.block_manager import BlockManager, hash_block
from pagedserve.v1 import scheduler_pb2

REDIS_URL = "redis://127.0.0.1:6379/0"
redis = pytest.importorskip("redis")


@pytest.fixture
def prefix(redis_prefix):
    return redis_prefix


def sync_client():
    return redis.Redis.from_url(REDIS_URL, decode_responses=True)


def test_block_hashes_are_the_block_managers():
    rng = random.Random(0)
    tokens = [rng.randrange(50000) for _ in range(100)]
    bm = BlockManager(num_blocks=16, block_size=16)
    assert block_hashes(tokens, 16) == bm._extend_hashes("s", tokens, 96)
    parent = None
    for i, h in enumerate(block_hashes(tokens, 16, max_blocks=3)):
        parent = hash_block(parent, tokens[i * 16:(i + 1) * 16])
        assert h == parent
    assert len(block_hashes(tokens, 16, max_blocks=3)) == 3 and block_hashes(tokens[:15], 16) == []


def test_salted_hashes_are_the_block_managers_and_another_salt_names_other_blocks():
    """Issue 42 row 5: the salt (the owner, gateway/owners.cache_salt) names the first block, so
    the whole chain; the router and the block manager agree under any salt."""
    tokens = list(range(100, 164))
    bm = BlockManager(num_blocks=16, block_size=16)
    mine = block_hashes(tokens, 16, salt="o1234")
    assert mine == bm._extend_hashes("s", tokens, 64, "o1234")
    assert not set(mine) & set(block_hashes(tokens, 16, salt="o5678"))
    assert not set(mine) & set(block_hashes(tokens, 16))
    assert block_hashes(tokens, 16, salt="o1234") == mine  # deterministic, no PYTHONHASHSEED


def test_block_names_are_not_pythons_tuple_hash():
    """CVE-2025-25183 (vLLM): hash() of a tuple of ints can be collided on purpose (and hash(-1) ==
    hash(-2)), and a collision serves one prompt another's KV. The names are 128 bits of sha256:
    wider than hash() and unrelated to it."""
    block = list(range(16))
    assert hash_block(None, block) != hash((None, tuple(block)))
    assert hash_block(None, block).bit_length() > 64 or hash_block(5, block).bit_length() > 64
    assert hash_block(None, block) != hash_block(None, block[:-1] + [block[-1] + 1])
    assert hash_block(1, block) != hash_block(2, block)


def test_publisher_sends_changes_bounded_and_expires(prefix):
    client = sync_client()
    pub = ReplicaPublisher(client, prefix, "r0", ttl_s=1.0, max_blocks=3)
    pub.beat(ReplicaInfo("r0", "127.0.0.1:1", num_running=2), [1, 2, 3, 4])
    assert client.smembers(f"{prefix}replica:r0:blocks") == {"2", "3", "4"}  # the most recent 3
    pub.beat(ReplicaInfo("r0", "127.0.0.1:1"), [3, 4, 5])
    assert client.smembers(f"{prefix}replica:r0:blocks") == {"3", "4", "5"}
    pub.beat(ReplicaInfo("r0", "127.0.0.1:1"), None)  # load only: the set stays
    assert client.smembers(f"{prefix}replica:r0:blocks") == {"3", "4", "5"}
    assert 0 < client.pttl(f"{prefix}replica:r0") <= 1000 and 0 < client.pttl(f"{prefix}replica:r0:blocks") <= 1000
    found = asyncio.run(_read(prefix))
    assert [(r.id, r.addr) for r in found] == [("r0", "127.0.0.1:1")]
    client.delete(f"{prefix}replica:r0")  # as if its TTL ran out: out of routing
    assert asyncio.run(_read(prefix)) == []
    pub.remove()
    assert not client.exists(f"{prefix}replica:r0:blocks") and not client.smembers(f"{prefix}replicas")


async def _read(prefix):
    import redis.asyncio
    client = redis.asyncio.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        return await read_replicas(client, prefix)
    finally:
        await client.aclose()


def test_a_burst_of_lookups_waits_for_a_connection_instead_of_failing(prefix):
    """300 lookups at once (a drain aborting hundreds of requests asks each one's owner; so do the tokenizers'
    routes of a burst): the readers' client queues them on its 32 connections. redis-py's own asyncio client
    refuses the 101st concurrent command ("Too many connections"), as it did on the gateway."""
    import redis.asyncio

    from pagedserve.common.replicas import async_reader, request_owner
    sync_client().hset(f"{prefix}req:a", "replica", "r1")

    async def burst(client):
        try:
            return await asyncio.gather(*(request_owner(client, prefix, "a" if i % 2 else f"b{i}") for i in range(300)),
                                        return_exceptions=True)
        finally:
            await client.aclose()
    owners = asyncio.run(burst(async_reader(REDIS_URL)))
    assert owners == ["", "r1"] * 150
    plain = asyncio.run(burst(redis.asyncio.Redis.from_url(REDIS_URL, decode_responses=True)))
    assert any(isinstance(o, redis.exceptions.MaxConnectionsError) for o in plain)  # what the gateway met


def _schedule(prompt, max_tokens=8, request_id="", salt=""):
    msg = scheduler_pb2.ScheduleRequest(request_id=request_id, prompt_token_ids=prompt)
    msg.params.max_tokens = max_tokens
    msg.params.cache_salt = salt
    return msg


def _register(prefix, ids=("r0", "r1"), blocks=None):
    client = sync_client()
    for rid in ids:
        ReplicaPublisher(client, prefix, rid, ttl_s=30).beat(
            ReplicaInfo(rid, f"127.0.0.1:{1000 + int(rid[1:])}", block_size=16), (blocks or {}).get(rid, []))


def _route(prefix, policy, requests, release_after=None):
    """Route requests (ScheduleRequests) in order; returns [replica id], and the in-flight tokens of
    each replica after every pick (nothing finishes unless release_after says after how many)."""
    from pagedserve.tokenizer.replica_router import ReplicaRouter

    async def run():
        router = ReplicaRouter(REDIS_URL, prefix, policy)
        chosen, loads, charges = [], [], []
        try:
            for i, schedule in enumerate(requests):
                target, cached = await router.pick(schedule)
                charges.append(router.charge(target, schedule, cached))
                chosen.append(target.id)
                loads.append({t.id: t.inflight_tokens for t in router.targets.values()})
                if release_after and i + 1 >= release_after:
                    charges.pop(0).release()
        finally:
            await router.close()
        return chosen, loads
    return asyncio.run(run())


def test_round_robin_takes_turns(prefix):
    _register(prefix)
    chosen, _ = _route(prefix, "round_robin", [_schedule([1] * 40) for _ in range(6)])
    assert chosen in (["r0", "r1"] * 3, ["r1", "r0"] * 3)


def test_least_load_keeps_the_replicas_within_one_request_of_each_other(prefix):
    """An unbalanced load: every fourth request is 30x longer. Round robin piles the long ones on
    one replica; least_load keeps the in-flight tokens (prompt + max_tokens) of the two replicas
    within the largest single request's after every pick while none ends, within twice that while
    they end (the stated bounds)."""
    _register(prefix)
    sizes = [(20, 300) if i % 4 == 0 else (20, 10) for i in range(40)]
    requests = [_schedule(list(range(1, p + 1)), m) for p, m in sizes]
    bound = max(p + m for p, m in sizes)
    _, loads = _route(prefix, "least_load", requests)
    for load in loads[1:]:
        assert abs(load.get("r0", 0) - load.get("r1", 0)) <= bound, load
    _, rr_loads = _route(prefix, "round_robin", requests)
    assert abs(rr_loads[-1]["r0"] - rr_loads[-1]["r1"]) > 3 * bound  # the workload is unbalanced indeed
    # With requests ending (the oldest after the next 6 arrive), an ending can open the gap by one
    # more request: the bound is then twice the largest request.
    _, loads = _route(prefix, "least_load", requests, release_after=6)
    assert all(abs(x.get("r0", 0) - x.get("r1", 0)) <= 2 * bound for x in loads[1:])


def test_prefix_routing_follows_the_published_cache_and_its_own_recent_routes(prefix):
    rng = random.Random(1)
    shared = [rng.randrange(1, 40000) for _ in range(128)]
    # r1 published the shared prefix's first 6 blocks: a request with that prefix goes there.
    _register(prefix, blocks={"r1": block_hashes(shared, 16)[:6]})
    chosen, _ = _route(prefix, "prefix", [_schedule(shared + [7] * 20)])
    assert chosen == ["r1"]
    # Prefixes no replica has published yet: each prefix's requests stay together (the router's
    # memory), and the prefixes spread over both replicas.
    prefixes = [[rng.randrange(1, 40000) for _ in range(96)] for _ in range(8)]
    work = [(p, [rng.randrange(1, 40000) for _ in range(16)]) for p in range(8) for _ in range(16)]
    rng.shuffle(work)
    chosen, _ = _route(prefix, "prefix", [_schedule(prefixes[p] + s, 2) for p, s in work], release_after=8)
    homes = {}
    for (p, _), rid in zip(work, chosen):
        homes.setdefault(p, []).append(rid)
    for p, rids in homes.items():
        assert max(rids.count("r0"), rids.count("r1")) >= 14, (p, rids)  # mostly on one replica
    main = [max(set(r), key=r.count) for r in homes.values()]
    assert main.count("r0") == main.count("r1") == 4  # new prefixes spread evenly


def test_prefix_routing_works_per_owner(prefix):
    """An owner's requests follow its own cached prefix (the salt in the chain); another owner's
    request with the same tokens finds no replica holding them and is routed on load."""
    rng = random.Random(2)
    shared = [rng.randrange(1, 40000) for _ in range(128)]
    _register(prefix, blocks={"r1": block_hashes(shared, 16, salt="oaaaa")[:6]})
    prompt = shared + [7] * 20
    chosen, loads = _route(prefix, "prefix", [_schedule(prompt, salt="oaaaa")])
    # In-flight tokens: the prompt less the 6 blocks expected from r1's cache, plus max_tokens.
    assert chosen == ["r1"] and loads[-1]["r1"] == len(prompt) - 96 + 8
    for salt in ("obbbb", ""):
        _, loads = _route(prefix, "prefix", [_schedule(prompt, salt=salt)])
        assert sum(loads[-1].values()) == len(prompt) + 8, (salt, loads)  # nothing expected cached


def test_prefix_routing_salts_an_adapters_request_as_the_scheduler_does(prefix):
    """A LoRA request's blocks are salted by its adapter too (SamplingParams.prefix_salt): the
    router hashes the proto's fields the same way, so it finds the replica that cached them."""
    from pagedserve.common.sampling_params import SamplingParams

    rng = random.Random(3)
    shared = [rng.randrange(1, 40000) for _ in range(128)]
    salt = SamplingParams(cache_salt="oaaaa", lora_name="sql", lora_path="/adapters/sql").prefix_salt
    _register(prefix, blocks={"r1": block_hashes(shared, 16, salt=salt)[:6]})
    schedule = _schedule(shared + [7] * 20, salt="oaaaa")
    schedule.params.lora_name, schedule.params.lora_path = "sql", "/adapters/sql"
    chosen, loads = _route(prefix, "prefix", [schedule])
    assert chosen == ["r1"] and loads[-1]["r1"] == len(shared) + 20 - 96 + 8


def test_a_request_with_an_owner_goes_to_it_while_it_lives(prefix):
    _register(prefix)
    client = sync_client()
    client.hset(f"{prefix}req:abc", mapping={"replica": "r1"})
    chosen, _ = _route(prefix, "round_robin", [_schedule([5] * 40, request_id="abc") for _ in range(3)])
    assert chosen == ["r1"] * 3
    client.delete(f"{prefix}replica:r1")  # r1 stopped heart-beating
    time.sleep(0.01)
    chosen, _ = _route(prefix, "round_robin", [_schedule([5] * 40, request_id="abc")])
    assert chosen == ["r0"]


def test_metrics_carry_a_replica_label_and_bench_reads_the_hit_rate_per_replica():
    from prometheus_client.parser import text_string_to_metric_families

    from pagedserve.bench.serve_client import prefix_hit_rates
    from pagedserve.gateway.metrics import Metrics
    a = scheduler_pb2.SchedulerStats(prefix_cache_hits=30, prefix_cache_queries=40, num_gpu_blocks=8, num_running=2)
    b = scheduler_pb2.SchedulerStats(prefix_cache_hits=10, prefix_cache_queries=40, num_gpu_blocks=8)
    metrics = Metrics()
    text = metrics.render(None, [("r0", a), ("r1", b)]).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    running = families["pagedserve:num_requests_running"].samples
    assert {(s.labels["replica"], s.value) for s in running} == {("r0", 2.0), ("r1", 0.0)}
    single = metrics.render(a).decode()
    assert "replica=" not in single and 'pagedserve:num_requests_running{model_name=""} 2.0' in single
    before = {"r0": (10.0, 20.0), "r1": (0.0, 0.0)}
    overall, per = prefix_hit_rates(before, {"r0": (30.0, 40.0), "r1": (10.0, 40.0)})
    assert overall == 30 / 60 and per == {"r0": 1.0, "r1": 0.25}
    assert prefix_hit_rates({"": (0.0, 10.0)}, {"": (5.0, 20.0)}) == (0.5, {})


def test_prefix_routing_gives_way_to_load_when_the_replicas_are_out_of_balance(prefix):
    rng = random.Random(3)
    shared = [rng.randrange(1, 40000) for _ in range(128)]
    client = sync_client()
    ReplicaPublisher(client, prefix, "r0", ttl_s=30).beat(
        ReplicaInfo("r0", "127.0.0.1:1000", num_waiting=40, pending_tokens=40 * 128), block_hashes(shared, 16))
    ReplicaPublisher(client, prefix, "r1", ttl_s=30).beat(ReplicaInfo("r1", "127.0.0.1:1001", num_waiting=10), [])
    chosen, _ = _route(prefix, "prefix", [_schedule(shared + [9] * 8)])
    assert chosen == ["r1"]  # 40 against 10 requests: the load decides
    ReplicaPublisher(client, prefix, "r1", ttl_s=30).beat(ReplicaInfo("r1", "127.0.0.1:1001", num_waiting=30), [])
    chosen, _ = _route(prefix, "prefix", [_schedule(shared + [9] * 8)])
    assert chosen == ["r0"]  # 40 against 30: within the balance, the cache decides
