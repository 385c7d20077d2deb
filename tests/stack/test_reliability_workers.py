"""Reliability with real processes and real Redis: a worker killed (-9) mid-decode is restarted by the
launcher's supervisor and every stream resumes by recompute, greedy text equal to an uninterrupted
run; the same for a killed scheduler; honest health (a SIGSTOPped worker, an unreachable Redis) with
/health/live answering throughout."""

from __future__ import annotations

import shutil
import signal
import threading
import time

import httpx
import openai
import pytest

from pagedserve.launcher.processes import private_redis
from service_stack import scheduler_stats, start_test_stack, wait_until_idle

pytestmark = pytest.mark.slow  # the tiny model borrows the default model's tokenizer

PROMPTS = [f"Story number {i}: once upon a time there was a" for i in range(8)]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def supervised(tiny_model, launch_stack):
    """A stack whose supervisor restarts dead children (as `pagedserve serve` does)."""
    return launch_stack(tiny_model, "logs-sup", max_restarts=3, max_num_batched_tokens=64, kv_cache_memory="64MiB")


def proc(stack, name: str):
    return next(p for p in stack.processes if p.name == name)


def health(stack, path: str = "/health") -> httpx.Response:
    return httpx.get(stack.http_url + path, timeout=10)


def run_streams(stack, fault=None) -> tuple[list[str], dict]:
    """8 concurrent greedy streams; fault(stack) runs once every stream has a few tokens. Returns the
    texts and timings: the fault's time and when every stream had a token after it."""
    client = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="none", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    texts = [""] * len(PROMPTS)
    progress = [0] * len(PROMPTS)
    arrivals: list[float] = []  # every token's arrival, all streams
    fault_at: list[float] = []
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            stream = client.completions.create(model=model, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    texts[i] += chunk.choices[0].text
                    progress[i] += 1
                    arrivals.append(time.monotonic())
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    info: dict = {}
    if fault is not None:
        deadline = time.monotonic() + 120
        while min(progress) < 3 and time.monotonic() < deadline and not errors:
            time.sleep(0.01)
        assert min(progress) >= 3, f"the streams did not start: {errors}"
        fault_at.append(time.monotonic())
        info = fault(stack) or {}
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    if fault_at:  # the longest pause in the token flow after the fault: its recovery time
        times = [fault_at[0], *sorted(a for a in arrivals if a >= fault_at[0])]
        info["resumed_s"] = max(b - a for a, b in zip(times, times[1:], strict=False))
    return texts, info


def test_killed_worker_is_restarted_and_streams_resume(supervised):
    baseline, _ = run_streams(supervised)
    assert all(baseline)
    old_pid = proc(supervised, "worker0").pid

    def kill_worker(stack) -> dict:
        proc(stack, "worker0").signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # unhealthy, naming the worker, while it is gone
            reply = health(stack)
            if reply.status_code == 503:
                return {"cause": reply.json()["cause"]}
            time.sleep(0.05)
        return {"cause": None}

    texts, info = run_streams(supervised, kill_worker)
    print(f"\nworker kill -9 -> every stream resumed in {info['resumed_s']:.1f} s")
    assert info["cause"] and "worker" in info["cause"], info
    assert texts == baseline  # nothing lost, nothing twice, greedy text unchanged
    assert proc(supervised, "worker0").pid != old_pid  # restarted by the supervisor
    assert health(supervised).status_code == 200
    stats = wait_until_idle(supervised)
    assert stats.healthy and stats.num_worker_recoveries == 1
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks


def test_killed_scheduler_is_restarted_and_streams_resume(supervised):
    baseline, _ = run_streams(supervised)
    old_pid = proc(supervised, "scheduler").pid

    def kill_scheduler(stack) -> None:
        proc(stack, "scheduler").signal(signal.SIGKILL)

    texts, info = run_streams(supervised, kill_scheduler)
    print(f"\nscheduler kill -9 -> every stream resumed in {info['resumed_s']:.1f} s")
    assert texts == baseline
    assert proc(supervised, "scheduler").pid != old_pid
    assert health(supervised).status_code == 200
    assert health(supervised, "/health/live").status_code == 200


@pytest.fixture(scope="module")
def private(tiny_model, tmp_path_factory):
    """A stack on its own redis-server (so the test can kill it), with a 2 s stall timeout."""
    logs = tmp_path_factory.mktemp("logs-priv")
    redis_proc, url, tmp = private_redis(logs / "redis.log")
    stack = start_test_stack(tiny_model, logs, redis_url=url, stall_timeout=2.0, max_num_batched_tokens=64,
                             kv_cache_memory="64MiB")
    yield stack, redis_proc
    stack.stop()
    redis_proc.stop(2)
    shutil.rmtree(tmp, ignore_errors=True)


def wait_health(stack, code: int, timeout_s: float) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    while True:
        reply = health(stack)
        assert health(stack, "/health/live").status_code == 200
        if reply.status_code == code or time.monotonic() - started > timeout_s:
            return reply, time.monotonic() - started
        time.sleep(0.1)


def test_stopped_worker_turns_health_unhealthy_then_healthy(private):
    stack, _ = private
    assert health(stack).status_code == 200
    baseline, _ = run_streams(stack)
    seen: dict = {}

    def stop_worker(stack) -> None:
        worker = proc(stack, "worker0")
        worker.signal(signal.SIGSTOP)
        try:
            reply, seen["unhealthy_s"] = wait_health(stack, 503, 15)
            seen["cause"] = reply.json().get("cause", "")
            assert reply.status_code == 503, reply.text
            assert scheduler_stats(stack).healthy is False
        finally:
            worker.signal(signal.SIGCONT)
        reply, seen["healthy_s"] = wait_health(stack, 200, 15)
        assert reply.status_code == 200, reply.text

    texts, _ = run_streams(stack, stop_worker)
    print(f"\nSIGSTOP -> 503 in {seen['unhealthy_s']:.1f} s ({seen['cause']}); SIGCONT -> 200 in "
          f"{seen['healthy_s']:.1f} s")
    assert "no progress" in seen["cause"]
    assert seen["unhealthy_s"] < 2.0 + 3.0
    assert texts == baseline  # the requests pending during the stop finished normally


def test_unreachable_redis_turns_health_unhealthy(private):
    """Runs last on this stack: its Redis stays down."""
    stack, redis_proc = private
    assert health(stack).status_code == 200
    redis_proc.kill()
    reply, took = wait_health(stack, 503, 15)
    assert reply.status_code == 503, reply.text
    assert "Redis" in reply.json()["cause"]
    assert health(stack, "/health/ready").status_code == 503
    assert health(stack, "/health/live").status_code == 200
    print(f"\nRedis killed -> 503 in {took:.1f} s")
