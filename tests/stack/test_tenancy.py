"""Tenancy against the real stack (real processes, real Redis, two API keys and an operator key):
the attacks of issue 13, each tried as a client with an ordinary key would, and what they get
now. docs/security.md lists them with these tests."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
import redis

from pagedserve.gateway.owners import owner_of_key
from pagedserve.v1 import generate_pb2, generate_pb2_grpc
from service_stack import REDIS_URL, wait_until_idle

pytestmark = pytest.mark.slow  # the tiny model borrows the default model's tokenizer

K1, K2, ADMIN = "sk-tenant-one", "sk-tenant-two", "sk-operator"
GREEDY = {"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack(tiny_model, launch_stack):
    return launch_stack(tiny_model, api_key=[K1, K2], admin_api_key=[ADMIN], kv_cache_memory="32MiB")


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def grpc_generate(stack, key: str, request: generate_pb2.GenerateRequest, timeout: float = 60):
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        return list(stub.Generate(request, metadata=(("authorization", f"Bearer {key}"),), timeout=timeout))


def grpc_text(replies) -> dict[int, str]:
    out: dict[int, str] = {}
    for msg in replies:
        out[msg.index] = out.get(msg.index, "") + msg.text
    return out


def test_keys_travel_by_environment_never_on_a_command_line(stack):
    for proc in stack.processes:
        cmdline = Path(f"/proc/{proc.proc.pid}/cmdline").read_bytes()
        for key in (K1, K2, ADMIN):
            assert key.encode() not in cmdline, proc.name
    with httpx.Client(timeout=60) as http:
        for key in (K1, K2, ADMIN):
            assert http.post(stack.http_url + "/v1/completions", json={**GREEDY, "max_tokens": 2},
                             headers=auth(key)).status_code == 200
    for key in (K1, K2):
        request = generate_pb2.GenerateRequest(prompt="hello")
        request.params.max_tokens = 2
        assert grpc_generate(stack, key, request)[-1].finish_reason == "length"


def test_grpc_id_collision_leaves_other_streams_whole(stack):
    """Sending `X#1`, then `X` with n=2, once crashed the step (the scheduler's forked samples are
    `X#i`) and aborted every client's stream."""
    with httpx.Client(timeout=120) as http:
        reference = http.post(stack.http_url + "/v1/completions", json=GREEDY, headers=auth(K2)).json()
    expected = reference["choices"][0]["text"]
    result: dict = {}

    def victim() -> None:
        with httpx.Client(timeout=120) as http:
            result["reply"] = http.post(stack.http_url + "/v1/completions", json={**GREEDY, "max_tokens": 48},
                                        headers=auth(K2)).json()

    thread = threading.Thread(target=victim)
    thread.start()
    time.sleep(0.3)
    with pytest.raises(grpc.RpcError) as refused:
        grpc_generate(stack, K1, generate_pb2.GenerateRequest(request_id="X#1", prompt="attack"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in refused.value.details()
    attack = generate_pb2.GenerateRequest(request_id="X", prompt="attack")
    attack.params.n, attack.params.max_tokens = 2, 4
    replies = grpc_generate(stack, K1, attack)
    assert {m.request_id for m in replies} == {"X"}  # the client's own id comes back, never the internal one
    assert sorted(grpc_text(replies)) == [0, 1]
    with pytest.raises(grpc.RpcError) as too_long:
        grpc_generate(stack, K1, generate_pb2.GenerateRequest(request_id="y" * 129, prompt="attack"))
    assert too_long.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    thread.join(120)
    choice = result["reply"]["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"].startswith(expected)


def test_another_keys_request_does_not_exist(stack):
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", stack.http_url + "/v1/completions", json={**GREEDY, "stream": True},
                         headers=auth(K1)) as r:
            request_id = r.headers["x-request-id"]
            text = "".join(r.iter_lines())
        assert "[DONE]" in text
        own = http.get(f"{stack.http_url}/v1/requests/{request_id}", headers=auth(K1))
        assert own.status_code == 200 and own.json()["id"] == request_id
        for path in (f"/v1/requests/{request_id}", f"/v1/requests/{request_id}/stream"):
            other = http.get(stack.http_url + path, headers=auth(K2))
            assert other.status_code == 404, (path, other.text)
            assert request_id in other.json()["error"]["message"]
        # The stats: K2 sees none of K1's requests; K1 sees its own by its id; the operator all.
        deadline = time.monotonic() + 10
        while True:
            mine = http.get(stack.http_url + "/v1/engine/stats", headers=auth(K1)).json()
            if any(r["request_id"] == request_id for r in mine["recent_requests"]) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert any(r["request_id"] == request_id for r in mine["recent_requests"])
        others = http.get(stack.http_url + "/v1/engine/stats", headers=auth(K2))
        assert others.status_code == 200 and request_id not in others.text
        everything = http.get(stack.http_url + "/v1/engine/stats", headers=auth(ADMIN)).json()
        internal = owner_of_key(K1) + "." + request_id
        assert any(r["request_id"] == internal for r in everything["recent_requests"])
        # The API's description is the operator's.
        assert http.get(stack.http_url + "/openapi.json").status_code == 401
        assert http.get(stack.http_url + "/openapi.json", headers=auth(K2)).status_code == 403
        assert http.get(stack.http_url + "/openapi.json", headers=auth(ADMIN)).status_code == 200
    # A gRPC Generate naming K1's id is K2's own new request: it replays nothing of K1's.
    attach = generate_pb2.GenerateRequest(request_id=request_id, prompt="something else entirely")
    attach.params.max_tokens = 3
    replies = grpc_generate(stack, K2, attach)
    assert replies[0].usage.prompt_tokens != own.json()["prompt_tokens"]
    assert sum(len(m.token_ids) for m in replies) == 3


def test_idempotency_key_is_the_owners_and_bound_to_the_body(stack):
    body = {**GREEDY, "max_tokens": 4}
    with httpx.Client(timeout=120) as http:
        url, key = stack.http_url + "/v1/completions", {"Idempotency-Key": "same-key"}
        first = http.post(url, json=body, headers={**auth(K1), **key}).json()
        retry = http.post(url, json=body, headers={**auth(K1), **key}).json()
        other = http.post(url, json=body, headers={**auth(K2), **key}).json()
        assert first["id"] == retry["id"] != other["id"]
        changed = http.post(url, json={**body, "max_tokens": 5}, headers={**auth(K1), **key})
        assert changed.status_code == 422 and "different request body" in changed.json()["error"]["message"]


def test_oversized_input_is_refused_at_once_and_others_go_on(stack):
    big = "a " * (3 << 20)  # 6 MiB: over the gRPC message limit (--max-body-bytes, 1 MiB)
    short = {**GREEDY, "max_tokens": 4}
    done: dict = {}

    def other_client() -> None:
        with httpx.Client(timeout=120) as http:
            start = time.monotonic()
            done["status"] = http.post(stack.http_url + "/v1/completions", json=short, headers=auth(K2)).status_code
            done["seconds"] = time.monotonic() - start

    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as refused:
        grpc_generate(stack, K1, generate_pb2.GenerateRequest(prompt=big))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert time.monotonic() - start < 5
    thread = threading.Thread(target=other_client)
    thread.start()
    # Under the byte limit but far over what the context holds: refused on its length in
    # characters, before anybody tokenizes it.
    with httpx.Client(timeout=120) as http:
        start = time.monotonic()
        reply = http.post(stack.http_url + "/v1/completions", json={"prompt": "b " * 400_000, "max_tokens": 1},
                          headers=auth(K1))
        assert reply.status_code == 400 and "characters" in reply.json()["error"]["message"]
        assert time.monotonic() - start < 5
    thread.join(120)
    assert done["status"] == 200 and done["seconds"] < 30


def test_refused_requests_leave_nothing_in_redis(stack):
    wait_until_idle(stack)
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    before = set(client.scan_iter(match=stack.redis_prefix + "*", count=1000))
    with httpx.Client(timeout=60) as http:
        for body in ({**GREEDY, "stream": True, "stop": [f"s{i}" for i in range(40)]},
                     {**GREEDY, "stream": True, "temperature": float("inf")},
                     {"prompt": "caf\ud800", "stream": True, "max_tokens": 2}):
            # json.dumps as Python writes it: Infinity, and a lone surrogate as a \\ud800 escape.
            reply = http.post(stack.http_url + "/v1/completions", content=json.dumps(body).encode(),
                              headers={**auth(K1), "Content-Type": "application/json"})
            assert reply.status_code == 400, reply.text
            assert "Traceback" not in reply.text
    assert set(client.scan_iter(match=stack.redis_prefix + "*", count=1000)) == before
