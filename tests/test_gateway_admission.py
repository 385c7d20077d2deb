"""The gateway's one admission function (pagedserve/gateway/admission.py): driven directly, then
through both front ends, where REST and the public gRPC API must refuse alike (the same message,
the HTTP status and the gRPC status of the same Refusal) in front of the fake services of
tests/fake_services.py."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest

from fake_services import KEY, Stack
from pagedserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from pagedserve.gateway.admission import (Admission, Refusal, bad_api_key, body_too_large, rate_limited, shutting_down,
                                          too_many_samples, too_many_tokens)
from pagedserve.common.replicas import async_reader
from pagedserve.gateway.grpc_api import peer_host
from pagedserve.gateway.limits import Limits
from pagedserve.gateway.owners import owner_of_key
from pagedserve.gateway.protocol import RequestError

REDIS_URL = "redis://127.0.0.1:6379/0"
AUTH = {"Authorization": f"Bearer {KEY}"}
METADATA = (("authorization", f"Bearer {KEY}"),)


def refusal_of(check, *args) -> Refusal:
    with pytest.raises(Refusal) as info:
        result = check(*args)
        if asyncio.iscoroutine(result):
            asyncio.run(result)
    return info.value


def admit(admission: Admission, *args):
    """Admission.admit, from a test without a loop."""
    return asyncio.run(admission.admit(*args))


# ---- the admission, driven directly -----------------------------------------------------------
def test_caller_checks_in_order():
    admission = Admission(["k1", "k2"])
    admit(admission, "Bearer k1", None)
    admit(admission, "bearer k2", "10.0.0.1")
    for authorization in (None, "", "Bearer k3", "k1", "Basic k1"):
        refusal = refusal_of(admission.admit, authorization, None)
        assert (refusal.status, refusal.grpc_code, refusal.code) == (401, grpc.StatusCode.UNAUTHENTICATED,
                                                                     "invalid_api_key")
        assert refusal.headers == {"WWW-Authenticate": "Bearer"}
    admission.draining = True  # draining comes first: even a wrong key hears it
    refusal = refusal_of(admission.admit, "Bearer nope", None)
    assert (refusal.status, refusal.grpc_code, refusal.code) == (503, grpc.StatusCode.UNAVAILABLE,
                                                                 "server_shutting_down")
    assert refusal.headers == {"Retry-After": "5"}
    admit(Admission(), None, None)  # no keys: open


def test_failed_keys_are_throttled_per_address():
    from pagedserve.gateway.admission import FAILED_AUTH_BURST
    admission = Admission(["k1"])
    for _ in range(FAILED_AUTH_BURST):
        assert refusal_of(admission.admit, "Bearer guess", "10.0.0.9").status == 401
    # Beyond the burst the address gets 429 before any key is compared, the right one included...
    for authorization in ("Bearer guess", "Bearer k1"):
        refusal = refusal_of(admission.admit, authorization, "10.0.0.9")
        assert (refusal.status, refusal.code) == (429, "auth_throttled") and int(refusal.headers["Retry-After"]) >= 1
    # ...while other addresses are not concerned.
    assert admit(admission, "Bearer k1", "10.0.0.10").owner == owner_of_key("k1")


def test_owners_and_operators():
    admission = Admission(["k1", "k2"], admin_keys=["op"])
    one, two, operator = (admit(admission, f"Bearer {k}", None) for k in ("k1", "k2", "op"))
    assert len({one.owner, two.owner, operator.owner}) == 3 and operator.admin and not one.admin
    assert one.internal_id("cmpl-1") != two.internal_id("cmpl-1")
    assert one.client_id(one.internal_id("cmpl-1")) == "cmpl-1" and two.client_id(one.internal_id("cmpl-1")) is None
    assert not two.sees(one.internal_id("cmpl-1")) and operator.sees(one.internal_id("cmpl-1#0"))
    assert operator.shown_id(one.internal_id("x")) == one.internal_id("x")
    assert "k1" not in one.owner and admit(Admission(), None, None).admin  # no keys: one anonymous operator


def test_rate_limit_per_key_or_address():
    admission = Admission(["k1", "k2"], Limits(rate_limit=(0.01, 2.0)))
    admit(admission, "Bearer k1", "10.0.0.1")
    admit(admission, "Bearer k1", "10.0.0.2")  # the key's bucket, whatever the address
    refusal = refusal_of(admission.admit, "Bearer k1", "10.0.0.3")
    assert (refusal.status, refusal.grpc_code, refusal.type, refusal.code) == (
        429, grpc.StatusCode.RESOURCE_EXHAUSTED, "rate_limit_error", "rate_limit_exceeded")
    assert int(refusal.headers["Retry-After"]) >= 50 and "0.01 requests/s (burst 2)" in refusal.message
    admit(admission, "Bearer k2", "10.0.0.1")  # another key has its own bucket
    refusal_of(admission.admit, "Bearer wrong", "10.0.0.1")  # a wrong key is refused before its bucket is used
    open_gateway = Admission(None, Limits(rate_limit=(0.01, 1.0)))
    admit(open_gateway, None, "10.0.0.1")
    refusal_of(open_gateway.admit, "Bearer anything", "10.0.0.1")  # no keys: per address
    admit(open_gateway, None, "10.0.0.2")


def gateways_sharing(prefix: str, rate: tuple[float, float], url: str = REDIS_URL, count: int = 2) -> list[Admission]:
    """The admissions of `count` gateways of one deployment, each with its own Redis client."""
    gateways = [Admission(["k1", "k2"], Limits(rate_limit=rate)) for _ in range(count)]
    for gateway in gateways:
        gateway.share_rate(async_reader(url), prefix)
    return gateways


def test_gateways_sharing_redis_share_each_keys_rate(redis_prefix):
    """Helm runs several gateways behind one Service: with Redis a key's --rate-limit is for all of them
    together (it was each gateway's, N times the rate), a batch is all or none, and no key is stored."""
    async def run():
        a, b = gateways_sharing(redis_prefix, (0.01, 3.0))
        await a.admit("Bearer k1", "10.0.0.1")
        await b.admit("Bearer k1", "10.0.0.2")
        await a.admit_more("Bearer k1", None, 1)  # the burst of 3 is spent, across both gateways
        for gateway in (a, b):
            with pytest.raises(Refusal) as refused:
                await gateway.admit("Bearer k1", None)
            assert refused.value.status == 429 and int(refused.value.headers["Retry-After"]) >= 50
        await b.admit("Bearer k2", None)  # another key: its own bucket
        with pytest.raises(Refusal, match="counts as 4"):
            await a.admit_more("Bearer k2", None, 3)  # 2 left, 3 more asked: all or none
        await a.admit_more("Bearer k2", None, 2)
        with pytest.raises(Refusal):
            await b.admit("Bearer wrong", None)  # a wrong key never reaches a bucket
        return [key async for key in a.shared_rate.client.scan_iter(redis_prefix + "*")]
    keys = asyncio.run(run())
    assert len(keys) == 2 and not any("k1" in k or "k2" in k for k in keys)  # digests, never the keys


def test_the_shared_buckets_refill_at_the_rate(redis_prefix):
    async def run():
        a, b = gateways_sharing(redis_prefix, (20.0, 1.0))
        await a.admit("Bearer k1", None)
        with pytest.raises(Refusal):
            await b.admit("Bearer k1", None)
        await asyncio.sleep(0.2)  # 4 tokens' time at 20/s, one kept: the burst
        await b.admit("Bearer k1", None)
        with pytest.raises(Refusal):
            await a.admit("Bearer k1", None)
    asyncio.run(run())


def test_redis_away_the_gateways_own_buckets_decide(redis_prefix):
    async def run():
        (alone,) = gateways_sharing(redis_prefix, (0.01, 1.0), url="redis://127.0.0.1:1/0", count=1)
        await alone.admit("Bearer k1", None)
        with pytest.raises(Refusal) as refused:
            await alone.admit("Bearer k1", None)
        assert refused.value.status == 429
    asyncio.run(run())


def test_n_body_and_tokens_in_flight():
    admission = Admission(None, Limits(max_n=4, max_body_bytes=100, max_tokens_in_flight=100))
    admission.check_n(4)
    refusal = refusal_of(admission.check_n, 5)
    assert (refusal.status, refusal.grpc_code, refusal.param, refusal.code) == (400, grpc.StatusCode.INVALID_ARGUMENT,
                                                                                "n", None)
    assert refusal.message == "n=5 exceeds the limit of 4 samples per request (--max-n)"
    admission.check_body_size(100)
    refusal = refusal_of(admission.check_body_size, 101)
    assert (refusal.status, refusal.grpc_code, refusal.code) == (413, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                                 "request_too_large")
    # prompt + n * min(max_tokens, context); unset max_tokens: up to the context. Alone: always admitted.
    assert admission.reserve(10, 2, None, 50) == 10 + 2 * 40
    refusal = refusal_of(admission.reserve, 3, 1, 10, 50)
    assert (refusal.status, refusal.grpc_code, refusal.code) == (429, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                                 "too_many_tokens_in_flight")
    assert "needs 13" in refusal.message and "90 of 100" in refusal.message and refusal.headers == {"Retry-After": "1"}
    admission.release(90)
    assert admission.tokens_in_flight == 0
    assert admission.reserve(3, 1, 1000, 500) == 503  # max_tokens past the context counts the context
    admission.release(10_000)
    assert admission.tokens_in_flight == 0  # never below 0


def test_a_refusal_is_an_openai_error():
    for refusal in (shutting_down(), bad_api_key(), rate_limited((1.0, 2.0), 0.2), body_too_large(10),
                    too_many_samples(5, 4), too_many_tokens(10, 95, 100)):
        assert isinstance(refusal, RequestError) and isinstance(refusal.grpc_code, grpc.StatusCode)
        assert set(refusal.body()["error"]) == {"message", "type", "param", "code"}
        assert refusal.body()["error"]["message"] == refusal.message


def test_peer_host():
    assert peer_host("ipv4:127.0.0.1:5555") == "127.0.0.1"
    assert peer_host("ipv6:[::1]:5555") == "::1"
    assert peer_host("ipv6:%5B::1%5D:5555") == "::1"
    assert peer_host("unix:/tmp/socket") == "unix:/tmp/socket"
    assert peer_host("") is None


# ---- REST and gRPC refuse alike -------------------------------------------------------------
def rest_refusal(stack: Stack, body: dict, headers: dict | None = None) -> tuple[int, str]:
    r = httpx.post(stack.url + "/v1/completions", json=body, headers=AUTH if headers is None else headers, timeout=10)
    assert r.status_code >= 400, r.text
    return r.status_code, r.json()["error"]["message"]


def grpc_refusal(stack: Stack, request: generate_pb2.GenerateRequest,
                 metadata=METADATA) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(generate_pb2_grpc.GenerationStub(channel).Generate(request, metadata=metadata, timeout=10))
    return info.value.code(), info.value.details()


def assert_refused_alike(rest: tuple[int, str], rpc: tuple[grpc.StatusCode, str], expected: Refusal) -> None:
    assert rest[0] == expected.status and rpc[0] == expected.grpc_code, (rest, rpc)
    assert rest[1] == rpc[1], (rest, rpc)


def wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def prompt(text: str, **params) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(prompt=text, params=common_pb2.SamplingParams(**params))


@pytest.fixture(scope="module")
def limited():
    stack = Stack(Limits(max_n=2, max_tokens_in_flight=110))
    yield stack
    stack.close()


def test_key_and_n_refused_alike(limited):
    assert_refused_alike(rest_refusal(limited, {"prompt": "hi"}, {"Authorization": "Bearer wrong"}),
                         grpc_refusal(limited, prompt("hi"), (("authorization", "Bearer wrong"),)), bad_api_key())
    assert_refused_alike(rest_refusal(limited, {"prompt": "hi"}, {}), grpc_refusal(limited, prompt("hi"), ()),
                         bad_api_key())
    assert_refused_alike(rest_refusal(limited, {"prompt": "hi", "n": 3}), grpc_refusal(limited, prompt("hi", n=3)),
                         too_many_samples(3, 2))


@pytest.mark.parametrize("holder", ["rest", "grpc"])
def test_tokens_in_flight_refused_alike(limited, holder):
    """A stream holding 3 + 100 tokens of the 110: a request for 3 + 10 more is refused by both
    front ends, whichever front end the holder came through; every reservation is released."""
    admission = limited.backend.admission
    limited.tokenizer.cancelled.clear()
    with grpc.insecure_channel(f"127.0.0.1:{limited.grpc_port}") as channel, httpx.Client(timeout=10) as http:
        if holder == "rest":
            hold = http.stream("POST", limited.url + "/v1/completions", headers=AUTH,
                               json={"prompt": "slow", "stream": True, "max_tokens": 100})
            lines = hold.__enter__().iter_lines()  # kept: a dropped line iterator closes the response
            while "tick" not in next(lines):
                pass
        else:
            call = generate_pb2_grpc.GenerationStub(channel).Generate(prompt("slow", max_tokens=100),
                                                                      metadata=METADATA, timeout=30)
            next(call)
            next(call)
        assert admission.tokens_in_flight == 103
        rest = rest_refusal(limited, {"prompt": "hi", "max_tokens": 10})
        rpc = grpc_refusal(limited, prompt("hi", max_tokens=10))
        assert_refused_alike(rest, rpc, too_many_tokens(13, 103, 110))
        assert "needs 13" in rest[1] and "103 of 110" in rest[1]
        assert admission.tokens_in_flight == 103
        if holder == "rest":
            hold.__exit__(None, None, None)
        else:
            call.cancel()
        assert limited.tokenizer.cancelled.wait(20)
    wait_for(lambda: admission.tokens_in_flight == 0)


def test_rate_limit_refused_alike():
    stack = Stack(Limits(rate_limit=(0.01, 2.0)))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
            msgs = list(generate_pb2_grpc.GenerationStub(channel).Generate(prompt("hi"), metadata=METADATA,
                                                                           timeout=10))
        assert msgs[-1].finish_reason
        assert httpx.post(stack.url + "/v1/completions", json={"prompt": "hi"}, headers=AUTH).status_code == 200
        # The key's burst of 2 is spent, by both front ends together.
        rest, rpc = rest_refusal(stack, {"prompt": "hi"}), grpc_refusal(stack, prompt("hi"))
        assert_refused_alike(rest, rpc, rate_limited((0.01, 2.0), 1.0))
    finally:
        stack.close()


def test_draining_refused_alike():
    stack = Stack()
    try:
        stack.backend.admission.draining = True
        assert_refused_alike(rest_refusal(stack, {"prompt": "hi"}), grpc_refusal(stack, prompt("hi")), shutting_down())
        r = httpx.get(stack.url + "/v1/models", headers=AUTH)
        with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
            with pytest.raises(grpc.RpcError) as info:
                generate_pb2_grpc.GenerationStub(channel).GetModelInfo(generate_pb2.ModelInfoRequest(),
                                                                       metadata=METADATA, timeout=10)
        assert (r.status_code, info.value.code()) == (503, grpc.StatusCode.UNAVAILABLE)
        assert r.json()["error"]["message"] == info.value.details()
    finally:
        stack.close()


def test_client_timings_are_dropped_and_ids_checked_on_grpc(limited):
    request = prompt("hi", max_tokens=2)
    request.timings.first_token = 1.0  # a client's stamp would corrupt the metrics
    with grpc.insecure_channel(f"127.0.0.1:{limited.grpc_port}") as channel:
        replies = list(generate_pb2_grpc.GenerationStub(channel).Generate(request, metadata=METADATA, timeout=10))
    forwarded = limited.tokenizer.requests[-1]
    assert forwarded.timings.first_token == 0 and forwarded.timings.gateway_received > 0
    assert forwarded.request_id.startswith(owner_of_key(KEY) + ".")
    assert {r.request_id for r in replies} == {forwarded.request_id.split(".", 1)[1]}
    code, message = grpc_refusal(limited, generate_pb2.GenerateRequest(prompt="hi", request_id="a/b"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "request_id must match" in message


def test_a_request_head_must_arrive_in_time():
    """uvicorn has no header timeout: the gateway's protocol arms the keep-alive timer at connect,
    so a connection that trickles its head is closed (here after 0.3 s, asserted under 5 s)."""
    import asyncio
    import socket
    import threading

    import uvicorn

    from pagedserve.common.grpc_util import free_port
    from pagedserve.gateway.server import HeaderTimeoutH11

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=HeaderTimeoutH11,
                                          timeout_keep_alive=0.3, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=asyncio.run, args=(server.serve(),), daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as slow:
            slow.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # never finished
            start = time.monotonic()
            assert slow.recv(1024) == b""  # closed by the server
            assert time.monotonic() - start < 5
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).text == "ok"  # a whole head is served
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_public_address_without_any_key_is_refused():
    from argparse import Namespace

    from pagedserve.gateway.server import unauthenticated_public
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert unauthenticated_public(Namespace(host=host), []) is None
    assert "without an API key" in unauthenticated_public(Namespace(host="0.0.0.0"), [])
    assert unauthenticated_public(Namespace(host="0.0.0.0"), ["k"]) is None
    assert unauthenticated_public(Namespace(host="0.0.0.0", allow_unauthenticated=True), []) is None
    # compose: the container listens on 0.0.0.0, the host publishes on loopback
    assert unauthenticated_public(Namespace(host="0.0.0.0", published_address="127.0.0.1"), []) is None
    assert unauthenticated_public(Namespace(host="0.0.0.0", published_address="10.1.2.3"), [])
