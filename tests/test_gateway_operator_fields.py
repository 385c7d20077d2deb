"""What only an operator key may see or claim (issue 42 row 9): the engine replicas' internal
addresses and raw errors in /v1/engine/stats, and a `priority` below a key's floor (lower runs
earlier under --scheduling-policy priority). Real gRPC (the fake scheduler of fake_services.py
behind a replica registry in the real Redis), the real gateway app in process."""

from __future__ import annotations

import asyncio
import types
import uuid
from concurrent import futures

import grpc
import httpx
import pytest

from fake_services import FakeScheduler
from pagedserve.common.replicas import ReplicaInfo, ReplicaPublisher
from pagedserve.gateway.admission import Admission, Refusal
from pagedserve.gateway.app import build_app
from pagedserve.gateway.backend import Backend
from pagedserve.gateway.owners import parse_key_line
from pagedserve.gateway.server import api_keys, key_file_priorities
from pagedserve.v1 import scheduler_pb2_grpc

REDIS_URL = "redis://127.0.0.1:6379/0"
redis = pytest.importorskip("redis")
KEY, OPERATOR = "sk-ordinary", "sk-operator"


@pytest.fixture
def replicas():
    """Two registered replicas under a fresh key prefix: r0 a (fake) scheduler that answers, r1
    an address nobody listens on."""
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(FakeScheduler(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    prefix = f"pstest-{uuid.uuid4().hex[:8]}:"
    for rid, addr in (("r0", f"127.0.0.1:{port}"), ("r1", "127.0.0.1:9")):
        ReplicaPublisher(client, prefix, rid, ttl_s=30).beat(ReplicaInfo(rid, addr, block_size=16), [])
    yield prefix, f"127.0.0.1:{port}"
    server.stop(0)
    keys = list(client.scan_iter(prefix + "*"))
    if keys:
        client.delete(*keys)


def test_replica_addresses_and_errors_are_the_operators(replicas):
    from pagedserve.gateway.replicas import ReplicaDirectory
    prefix, addr = replicas

    async def main():
        backend = Backend("127.0.0.1:9", "127.0.0.1:9", api_key=[KEY], admin_keys=[OPERATOR])
        backend.replicas = ReplicaDirectory(REDIS_URL, prefix)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(backend)),
                                         base_url="http://gw") as http:
                views = {}
                for key in (KEY, OPERATOR):
                    r = await http.get("/v1/engine/stats", headers={"Authorization": f"Bearer {key}"})
                    assert r.status_code == 200, r.text
                    views[key] = {e["id"]: e for e in r.json()["replicas"]}
        finally:
            await backend.replicas.close()
        return views

    views = asyncio.run(main())
    ordinary, operator = views[KEY], views[OPERATOR]
    assert set(ordinary) == set(operator) == {"r0", "r1"}
    assert operator["r0"]["addr"] == addr and operator["r1"]["addr"] == "127.0.0.1:9"
    assert "127.0.0.1:9" in operator["r1"]["error"] or operator["r1"]["error"]
    assert all("addr" not in e for e in ordinary.values()), ordinary
    assert ordinary["r1"]["error"] == "unavailable" and ordinary["r0"]["ready"]
    assert addr not in str(ordinary) and "127.0.0.1" not in str(ordinary)


def test_priority_floor_per_key(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team keys\nsk-batch\nsk-urgent min_priority=-10\n\n")
    args = types.SimpleNamespace(api_key=[KEY], api_key_file=str(path))
    assert api_keys(args) == [KEY, "sk-batch", "sk-urgent"]
    assert key_file_priorities(args) == {"sk-batch": None, "sk-urgent": -10}
    for bad in ("sk-x priority=3", "sk-x min_priority=high"):
        with pytest.raises(ValueError):
            parse_key_line(bad)
    admission = Admission([KEY, "sk-batch", "sk-urgent"], admin_keys=[OPERATOR], min_priorities={"sk-urgent": -10})
    callers = {k: admission.caller(f"Bearer {k}") for k in (KEY, "sk-urgent", OPERATOR)}
    admission.check_priority(callers[KEY], 0)
    admission.check_priority(callers[KEY], 7)  # later than others: anybody may
    admission.check_priority(callers["sk-urgent"], -10)
    admission.check_priority(callers[OPERATOR], -1000)
    for key, priority in ((KEY, -1), ("sk-urgent", -11)):
        with pytest.raises(Refusal) as refused:
            admission.check_priority(callers[key], priority)
        assert refused.value.status == 400 and refused.value.param == "priority"
    Admission().check_priority(asyncio.run(Admission().admit(None, None)), -5)  # no keys: one operator


def test_an_ordinary_key_cannot_jump_the_queue_over_rest_and_grpc():
    """A REST or gRPC request with a priority below its key's floor is refused before anything is
    sent on (no service behind this gateway)."""
    from pagedserve.gateway.grpc_api import GenerationService
    from pagedserve.v1 import generate_pb2, generate_pb2_grpc

    async def main():
        backend = Backend("127.0.0.1:9", "127.0.0.1:9", api_key=[KEY], admin_keys=[OPERATOR])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(backend)),
                                     base_url="http://gw") as http:
            r = await http.post("/v1/completions", json={"prompt": "hi", "priority": -1},
                                headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
            r = await http.post("/v1/completions", json={"prompt": "hi", "priority": -1},
                                headers={"Authorization": f"Bearer {OPERATOR}"})
            assert r.json()["error"].get("param") != "priority"  # past the check (no engine here: 503)
        server = grpc.aio.server()
        generate_pb2_grpc.add_GenerationServicer_to_server(GenerationService(backend), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = generate_pb2_grpc.GenerationStub(channel)
                call = stub.Generate(generate_pb2.GenerateRequest(prompt="hi", priority=-1),
                                     metadata=(("authorization", f"Bearer {KEY}"),), timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call.read()
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "priority" in refused.value.details()
        finally:
            await server.stop(0)

    asyncio.run(main())
