"""The services' refusals on a tiny model (real processes, real Redis): 401 without the API key,
429 when the waiting queue is full, 503 while the model is not loaded; and the scheduler's own
gRPC statuses."""

from __future__ import annotations

import os
import time

import grpc
import httpx
import pytest

from pagedserve.common.grpc_util import free_port
from pagedserve.launcher.processes import ServiceProcess
from service_stack import scheduler_stats, wait_until_idle

pytestmark = pytest.mark.slow  # the tiny model borrows the default model's tokenizer

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def stack(tiny_model, launch_stack):
    return launch_stack(tiny_model, api_key=KEY, max_num_seqs=1, max_waiting_requests=1, kv_cache_memory="16MiB")


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_api_key_is_required(stack):
    body = {"prompt": "hello", "max_tokens": 4}
    with httpx.Client(timeout=60) as http:
        for headers in ({}, auth("wrong-key")):
            reply = http.post(stack.http_url + "/v1/completions", json=body, headers=headers)
            assert reply.status_code == 401, reply.text
            assert "API key" in reply.json()["error"]["message"]
        assert http.post(stack.http_url + "/v1/completions", json=body, headers=auth()).status_code == 200
        assert http.get(stack.http_url + "/v1/models", headers=auth()).status_code == 200
        assert http.get(stack.http_url + "/v1/models").status_code == 401


def test_full_waiting_queue_gets_429(stack):
    """max_num_seqs=1 and max_waiting_requests=1: one runs, one waits, the third is refused."""
    body = {"prompt": "count with me: one two three", "max_tokens": 400, "ignore_eos": True, "stream": True}
    url = stack.http_url + "/v1/completions"
    with httpx.Client(timeout=120) as http, http.stream("POST", url, json=body, headers=auth()) as running:
        assert running.status_code == 200
        lines = running.iter_lines()
        while not next(lines).startswith("data: "):  # a first token: it is running
            pass
        with http.stream("POST", url, json=body, headers=auth()) as waiting:
            assert waiting.status_code == 200  # accepted into the queue
            refused = http.post(url, json={**body, "stream": False}, headers=auth())
            assert refused.status_code == 429, refused.text
            assert "waiting queue" in refused.json()["error"]["message"]
            assert refused.headers.get("retry-after")
    stats = wait_until_idle(stack)
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks


def test_prompt_over_the_context_is_400(stack):
    reply = httpx.post(stack.http_url + "/v1/completions", headers=auth(), timeout=60,
                       json={"prompt": "word " * 2000, "max_tokens": 4})
    assert reply.status_code == 400
    assert "1024" in reply.json()["error"]["message"]  # the tiny model's context


def test_scheduler_statuses(stack):
    from pagedserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
    with grpc.insecure_channel(stack.addresses["scheduler"]) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        cases = [
            (scheduler_pb2.ScheduleRequest(prompt_token_ids=[]), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
            (scheduler_pb2.ScheduleRequest(prompt_token_ids=[10**6]), grpc.StatusCode.INVALID_ARGUMENT,
             "vocabulary"),
            (scheduler_pb2.ScheduleRequest(prompt_token_ids=[5, 6], params=common_pb2.SamplingParams(top_p=2.0)),
             grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
            (scheduler_pb2.ScheduleRequest(request_id="nobody", attach=True, prompt_token_ids=[5]),
             grpc.StatusCode.NOT_FOUND, "nobody"),
        ]
        for request, code, word in cases:
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request, timeout=30))
            assert info.value.code() == code and word in info.value.details()
        # A deadline ends the request and frees its blocks.
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(scheduler_pb2.ScheduleRequest(
                prompt_token_ids=[5, 6, 7], params=common_pb2.SamplingParams(max_tokens=900, ignore_eos=True)),
                timeout=0.5))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until_idle(stack).num_running == 0


def test_model_still_loading_is_503(stack, tmp_path):
    """A scheduler whose worker never comes up: the gateway in front of it answers 503."""
    env = {**os.environ, "PAGEDSERVE_REDIS_PREFIX": stack.redis_prefix}
    scheduler_port, tokenizer_port, http_port, grpc_port = free_port(), free_port(), free_port(), free_port()
    tokenizer_argv = next(p for p in stack.processes if p.name == "tokenizer").argv
    model = tokenizer_argv[tokenizer_argv.index("--model") + 1]
    python = tokenizer_argv[0]
    procs = [
        ServiceProcess("scheduler", [python, "-m", "pagedserve.cli", "scheduler", "--port", str(scheduler_port),
                                     "--worker-addrs", f"127.0.0.1:{free_port()}", "--redis-url", "memory"],
                       env=env, log_path=tmp_path / "scheduler.log"),
        ServiceProcess("tokenizer", [python, "-m", "pagedserve.cli", "tokenizer", "--port", str(tokenizer_port),
                                     "--model", model, "--scheduler-addr", f"127.0.0.1:{scheduler_port}"],
                       f"127.0.0.1:{tokenizer_port}", env=env, log_path=tmp_path / "tokenizer.log"),
        ServiceProcess("gateway", [python, "-m", "pagedserve.cli", "gateway", "--port", str(http_port),
                                   "--grpc-port", str(grpc_port), "--tokenizer-addr", f"127.0.0.1:{tokenizer_port}",
                                   "--scheduler-addr", f"127.0.0.1:{scheduler_port}"],
                       f"127.0.0.1:{grpc_port}", env=env, log_path=tmp_path / "gateway.log"),
    ]
    try:
        for proc in procs:
            proc.start()
        for proc in procs[1:]:
            proc.wait_healthy(120)
        url = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                reply = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert reply.status_code == 503, reply.text
        assert "loading" in reply.json()["error"]["message"]
        assert reply.headers.get("retry-after")
        assert httpx.get(url + "/health", timeout=30).status_code == 503
    finally:
        for proc in reversed(procs):
            proc.stop()
    assert scheduler_stats(stack).ready  # the real stack was not disturbed


def test_readmitted_request_nobody_reattaches_to_is_aborted(stack):
    """The client went down with the scheduler: after the restart its request is re-admitted from
    Redis, and aborted (blocks freed, record finished) once --orphan-timeout passes without a stream."""
    import json
    import signal
    import threading

    import redis

    from pagedserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
    request_id = f"orphan-{time.time_ns()}"
    got_tokens = threading.Event()

    def client() -> None:
        with grpc.insecure_channel(stack.addresses["scheduler"]) as channel:
            stream = scheduler_pb2_grpc.SchedulerStub(channel).Generate(scheduler_pb2.ScheduleRequest(
                request_id=request_id, prompt_token_ids=[5, 6, 7],
                params=common_pb2.SamplingParams(max_tokens=900, ignore_eos=True, temperature=0)))
            try:
                for message in stream:
                    if message.token_ids:
                        got_tokens.set()
            except grpc.RpcError:
                pass  # its scheduler died

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    assert got_tokens.wait(60)
    old = next(p for p in stack.processes if p.name == "scheduler")
    old.signal(signal.SIGKILL)
    old.proc.wait(timeout=30)
    old.stop()
    # --orphan-timeout 0: aborted at the step loop's first turn. With 1 s a quiet machine ran the
    # tiny model to its context (finish_reason "length") before the grace period was over.
    new = ServiceProcess("scheduler", [*old.argv, "--orphan-timeout", "0"], old.health_address, env=old.env,
                         log_path=old.log_path).start()
    stack.processes[stack.processes.index(old)] = new
    new.wait_healthy(120)
    store = redis.Redis.from_url("redis://127.0.0.1:6379/0", decode_responses=True)
    key = f"{stack.redis_prefix}req:{request_id}"
    deadline = time.monotonic() + 30
    while store.hget(key, "status") != "finished" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert store.hget(key, "status") == "finished"
    assert json.loads(store.hget(key, "finish_reasons")) == ["abort"]
    assert 0 < store.llen(f"{stack.redis_prefix}out:{request_id}:0") < 900
    assert request_id not in store.smembers(f"{stack.redis_prefix}active")
    stats = wait_until_idle(stack)
    assert stats.num_running == 0 and stats.num_free_gpu_blocks == stats.num_gpu_blocks
