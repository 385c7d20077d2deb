"""A soak of the real stack (every service a process, real Redis) on a tiny model.

2,100 short requests at concurrency 32 (the first 100 a warm-up): a third disconnected at random
points (a stream closed after a random number of events, or a non-streamed request cancelled after
a random delay), about one in ten with invalid parameters that must get a 4xx, the rest ordinary
streamed or non-streamed completions and chat completions that must get a 200 and a finished answer.

Afterwards:
- every KV block is free (reusable prefix-cache blocks count as free) and nothing runs or waits;
- no request record under the stack's Redis prefix is left "running" or "waiting", and the active
  set is empty;
- a greedy request answers exactly what it answered before the soak;
- memory bound: the RSS (VmRSS) of each service process after the soak is at most
  RSS_BOUND_MIB (150 MiB) above its RSS after the warm-up of 100 requests;
- the gateway has no request left in flight: it stops on SIGTERM at once, with exit code 0.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import httpx
import pytest
import redis

from service_stack import REDIS_URL, scheduler_stats, wait_until_idle

pytestmark = pytest.mark.slow  # the tiny model borrows the default model's tokenizer

CONCURRENCY = 32
WARMUP = 100
SOAK = 2000
RSS_BOUND_MIB = 150
SEED = 20261130
WORDS = ("the quick brown fox jumps over a lazy dog while seven red birds sing about rain and "
         "cold tea in the old stone house near the river").split()
GREEDY = {"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0, "ignore_eos": True}

# (body or raw bytes, path): every one must be refused with a 4xx.
INVALID = [
    ({"prompt": "hello there", "max_tokens": 4, "temperature": -1}, "/v1/completions"),
    ({"prompt": "hello there", "max_tokens": 0}, "/v1/completions"),
    ({"prompt": "hello there", "max_tokens": 10**12}, "/v1/completions"),
    ({"prompt": "hello there", "max_tokens": 4, "model": "no-such-model"}, "/v1/completions"),
    (b'{"prompt": "hello there", "max_tokens": 4', "/v1/completions"),  # bad JSON
    ({"prompt": "hello there", "max_tokens": 4, "top_p": 2}, "/v1/completions"),
    ({"prompt": "hello there", "max_tokens": 4, "n": 0}, "/v1/completions"),
    ({"max_tokens": 4}, "/v1/completions"),  # no prompt
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, "/v1/chat/completions"),
    ({"messages": "not a list", "max_tokens": 4}, "/v1/chat/completions"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": -1, "stream": True},
     "/v1/chat/completions"),
]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def service_rss(stack) -> dict[str, float]:
    return {f"{p.name}[{p.pid}]": rss_mib(p.pid) for p in stack.processes}


@pytest.fixture(scope="module")
def stack(tiny_model, launch_stack):
    return launch_stack(tiny_model)


def make_case(rng: random.Random, i: int) -> dict:
    """One request of the mix: kind is 'ok', 'disconnect' or 'invalid'."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))
    max_tokens = rng.randint(4, 16)
    chat = rng.random() < 0.3
    if chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}
    else:
        path, body = "/v1/completions", {"prompt": prompt}
    body.update(max_tokens=max_tokens, temperature=rng.choice([0, 0.7, 1.0]), seed=rng.randint(0, 10**6))
    if i % 3 == 0:
        stream = rng.random() < 0.7
        body["stream"] = stream
        body["ignore_eos"] = True  # long enough to be cut
        return {"kind": "disconnect", "path": path, "body": body, "stream": stream,
                "after_events": rng.randint(0, max_tokens), "after_s": rng.uniform(0.0, 0.3)}
    if i % 10 == 1:
        body, path = INVALID[(i // 10) % len(INVALID)]
        return {"kind": "invalid", "path": path, "body": body}
    body["stream"] = rng.random() < 0.5
    return {"kind": "ok", "path": path, "body": body, "stream": body["stream"]}


async def run_case(client: httpx.AsyncClient, case: dict, outcome: dict) -> None:
    path, body = case["path"], case["body"]
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    if case["kind"] == "invalid":
        reply = await client.post(path, **kwargs)
        assert 400 <= reply.status_code < 500, (case, reply.status_code, reply.text)
        outcome["invalid"] += 1
        return
    if case["kind"] == "disconnect" and not case["stream"]:
        try:
            await asyncio.wait_for(client.post(path, **kwargs), timeout=case["after_s"])
            outcome["disconnect_too_late"] += 1
        except asyncio.TimeoutError:
            outcome["disconnected"] += 1
        return
    if case["stream"]:
        events, done = 0, False
        async with client.stream("POST", path, **kwargs) as reply:
            assert reply.status_code == 200, (case, reply.status_code, await reply.aread())
            async for line in reply.aiter_lines():
                if case["kind"] == "disconnect" and events >= case["after_events"]:
                    break  # leaving the block closes the connection mid-stream
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                assert "error" not in chunk, (case, chunk)
                events += 1
        if case["kind"] == "disconnect":
            outcome["disconnected" if not done else "disconnect_too_late"] += 1
        else:
            assert done, case
            outcome["ok"] += 1
        return
    reply = await client.post(path, **kwargs)
    assert reply.status_code == 200, (case, reply.status_code, reply.text)
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "length"), (case, choice)
    outcome["ok"] += 1


async def run_load(base_url: str, cases: list[dict]) -> dict:
    outcome = {"ok": 0, "invalid": 0, "disconnected": 0, "disconnect_too_late": 0}
    queue: asyncio.Queue = asyncio.Queue()
    for case in cases:
        queue.put_nowait(case)
    limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=CONCURRENCY)

    async def user(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            await run_case(client, queue.get_nowait(), outcome)

    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        await asyncio.gather(*(user(client) for _ in range(CONCURRENCY)))
    return outcome


def redis_leftovers(prefix: str) -> tuple[list[tuple[str, str]], set[str]]:
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        unfinished = []
        for key in client.scan_iter(match=f"{prefix}req:*", count=1000):
            status = client.hget(key, "status")
            if status != "finished":
                unfinished.append((key, status))
        return unfinished, client.smembers(f"{prefix}active")
    finally:
        client.close()


def test_soak(stack):
    greedy_before = httpx.post(stack.http_url + "/v1/completions", json=GREEDY, timeout=120)
    assert greedy_before.status_code == 200, greedy_before.text
    rng = random.Random(SEED)
    cases = [make_case(rng, i) for i in range(WARMUP + SOAK)]

    warm = asyncio.run(run_load(stack.http_url, cases[:WARMUP]))
    stats = wait_until_idle(stack, 60)
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks, stats
    rss_before = service_rss(stack)

    start = time.monotonic()
    outcome = asyncio.run(run_load(stack.http_url, cases[WARMUP:]))
    elapsed = time.monotonic() - start
    stats = wait_until_idle(stack, 60)
    rss_after = service_rss(stack)

    print(f"\nsoak: {SOAK} requests at concurrency {CONCURRENCY} in {elapsed:.1f} s "
          f"({SOAK / elapsed:.1f} requests/s); warm-up {warm}; soak {outcome}")
    for name in rss_before:
        print(f"  RSS {name}: {rss_before[name]:.0f} MiB -> {rss_after[name]:.0f} MiB "
              f"({rss_after[name] - rss_before[name]:+.0f} MiB)")
    print(f"  scheduler: {stats.num_free_gpu_blocks}/{stats.num_gpu_blocks} blocks free, "
          f"{stats.num_cached_blocks} cached, {stats.requests_finished_total} finished")

    assert sum(outcome.values()) == SOAK
    assert outcome["disconnected"] >= SOAK // 4, outcome  # most of the third were cut before the end
    assert outcome["invalid"] >= SOAK // 20, outcome
    assert stats.num_running == stats.num_waiting == 0, stats
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks, stats
    unfinished, active = redis_leftovers(stack.redis_prefix)
    assert not unfinished, unfinished[:10]
    assert not active, sorted(active)[:10]

    greedy_after = httpx.post(stack.http_url + "/v1/completions", json=GREEDY, timeout=120)
    assert greedy_after.status_code == 200, greedy_after.text
    assert greedy_after.json()["choices"][0]["text"] == greedy_before.json()["choices"][0]["text"]
    assert scheduler_stats(stack).num_free_gpu_blocks == stats.num_gpu_blocks

    grown = {name: rss_after[name] - rss_before[name] for name in rss_before
             if rss_after[name] - rss_before[name] > RSS_BOUND_MIB}
    assert not grown, f"RSS grew more than {RSS_BOUND_MIB} MiB: {grown}"

    # Nothing is left on the gateway's books either: on SIGTERM it finds no request in flight and
    # stops at once (a call its client left while the gateway read its answer once stayed there:
    # the drain waited out its 30 s, then the gateway hung and was killed).
    stack.stop()
    gateway = next(p for p in stack.processes if p.name == "gateway")
    log_text = gateway.log_path.read_text()
    assert "still in flight" not in log_text, log_text[-2000:]
    assert gateway.proc.returncode == 0, log_text[-2000:]
