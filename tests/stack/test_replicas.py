"""Two engine replicas of a tiny model on loopback (`serve --data-parallel-size 2`, real processes,
real Redis; docs/scale-out.md): prefix-aware routing against round robin on a shared-prefix
workload, and a replica killed with -9 mid-stream whose streams finish on the other replica with
the greedy text of an uninterrupted run."""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import redis

from service_stack import REDIS_URL

pytestmark = pytest.mark.slow  # the tiny model borrows the default model's tokenizer

# Each replica's KV pool holds 136 blocks of 16 tokens (8 KiB each for the tiny model in float32):
# about 4 of the 8 prefixes of 32 blocks. Routed by prefix, each replica keeps its 4 prefixes;
# taking turns, each replica sees all 8 and keeps evicting them.
KV_PER_REPLICA = "1088KiB"
NUM_PREFIXES, SUFFIXES, PREFIX_LEN, SUFFIX_LEN = 8, 16, 512, 16


@pytest.fixture(scope="module")
def stack(tiny_model, launch_stack):
    return launch_stack(tiny_model, "replicas", data_parallel_size=2, kv_cache_memory=KV_PER_REPLICA,
                        max_num_batched_tokens=256)


def proc(stack, name: str):
    return next(p for p in stack.processes if p.name == name)


def use_policy(stack, policy: str) -> None:
    """Restart the tokenizer with --routing-policy policy (the gateway reconnects by itself)."""
    from pagedserve.launcher.processes import ServiceProcess
    old = proc(stack, "tokenizer")
    old.stop()
    argv = [a for a in old.argv]
    if "--routing-policy" in argv:
        i = argv.index("--routing-policy")
        del argv[i:i + 2]
    new = ServiceProcess("tokenizer", [*argv, "--routing-policy", policy], old.health_address, env=old.env,
                         log_path=old.log_path.with_name(f"tokenizer-{policy}.log"))
    new.start()
    stack.processes[stack.processes.index(old)] = new
    new.wait_healthy(120)


def owner(stack, client_id: str) -> str:
    store = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    return store.hget(f"{stack.redis_prefix}req:anon.{client_id}", "replica") or ""


def shared_prefix_run(stack, seed: int) -> tuple[float, dict[int, list[str]]]:
    """8 prefixes x 16 suffixes, shuffled, 4 at a time: (prefix-cache hit rate, prefix -> replicas)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 40000) for _ in range(PREFIX_LEN)] for _ in range(NUM_PREFIXES)]
    work = [(p, [rng.randrange(100, 40000) for _ in range(SUFFIX_LEN)]) for p in range(NUM_PREFIXES)
            for _ in range(SUFFIXES)]
    rng.shuffle(work)
    client = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="none", max_retries=0, timeout=300)
    model = client.models.list().data[0].id

    def one(item):
        p, suffix = item
        reply = client.completions.create(model=model, prompt=prefixes[p] + suffix, max_tokens=2, temperature=0)
        return p, reply.id, reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, work))
    homes: dict[int, list[str]] = {}
    for p, rid, _, _ in results:
        homes.setdefault(p, []).append(owner(stack, rid))
    return sum(r[3] for r in results) / sum(r[2] for r in results), homes


def test_prefix_routing_beats_round_robin_and_keeps_each_prefix_on_one_replica(stack):
    use_policy(stack, "round_robin")
    rr_rate, rr_homes = shared_prefix_run(stack, seed=1)
    use_policy(stack, "prefix")
    prefix_rate, homes = shared_prefix_run(stack, seed=2)
    print(f"\nprefix-cache hit rate: round_robin {rr_rate:.3f}, prefix {prefix_rate:.3f}")
    stats = httpx.get(stack.http_url + "/v1/engine/stats?steps=0", timeout=30).json()
    assert [(r["id"], r["kv"]["num_blocks"]) for r in stats["replicas"]] == [("r0", 136), ("r1", 136)]
    assert all(len(set(r)) == 2 for r in rr_homes.values())  # turns: every prefix on both replicas
    assert prefix_rate >= 1.5 * rr_rate
    for p, replicas in homes.items():
        assert max(replicas.count("r0"), replicas.count("r1")) >= 12, (p, replicas)  # mostly on one
    main = [max(set(r), key=r.count) for r in homes.values()]
    assert main.count("r0") == main.count("r1") == 4  # the prefixes spread evenly


def sse_texts(lines) -> dict[int, str]:
    """sample index -> text of an SSE completion stream (until [DONE])."""
    texts: dict[int, str] = {}
    for line in lines:
        if line == "data: [DONE]":
            break
        if line.startswith("data: "):
            for choice in json.loads(line[6:]).get("choices", []):
                texts[choice["index"]] = texts.get(choice["index"], "") + (choice.get("text") or "")
    return texts


def test_n_samples_and_resumed_streams_stay_on_the_replica_that_holds_them(stack):
    """Round robin would send each new call to the other replica: a request's n = 2 samples run
    on one replica, and GET /v1/requests/{id}/stream (a resume, while the request runs) goes to
    the replica that owns it, replaying both samples whole."""
    use_policy(stack, "round_robin")
    body = {"prompt": "The history of the city", "max_tokens": 160, "n": 2, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=300) as http, http.stream("POST", stack.http_url + "/v1/completions",
                                                        json=body) as first:
        request_id = first.headers["x-request-id"]
        lines = first.iter_lines()
        head = [next(lines) for _ in range(6)]
        home = owner(stack, request_id)
        assert home in ("r0", "r1")
        resumed = [sse_texts(http.get(f"{stack.http_url}/v1/requests/{request_id}/stream?after=0").text.splitlines())
                   for _ in range(3)]
        whole = sse_texts([*head, *lines])
    assert set(whole) == {0, 1} and all(whole.values())
    assert resumed == [whole] * 3
    assert owner(stack, request_id) == home


PROMPT = "Story number {}: once upon a time there was a"
MAX_TOKENS = 400  # long enough that every stream still runs when the replica is killed
STREAMS = 16


def greedy_streams(stack, fault=None) -> tuple[list[str], list[str]]:
    """16 greedy streams, taking turns: 8 on each replica; fault(ids, finished) runs once every
    stream has a few tokens."""
    client = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="none", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    texts, ids, progress, errors = [""] * STREAMS, [""] * STREAMS, [0] * STREAMS, []
    finished = [False] * STREAMS

    def run(i: int) -> None:
        try:
            stream = client.completions.create(model=model, prompt=PROMPT.format(i), max_tokens=MAX_TOKENS,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
            for chunk in stream:
                ids[i] = chunk.id
                if chunk.choices and chunk.choices[0].text:
                    texts[i] += chunk.choices[0].text
                    progress[i] += 1
                if chunk.choices and chunk.choices[0].finish_reason:
                    finished[i] = True
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    if fault is not None:
        deadline = time.monotonic() + 120
        while min(progress) < 3 and time.monotonic() < deadline and not errors:
            time.sleep(0.01)
        assert min(progress) >= 3, f"the streams did not start: {errors}"
        fault(ids, list(finished))
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    return texts, ids


def test_kill_9_of_a_replica_moves_its_streams_to_the_other(stack):
    """Kill -9 replica r0's scheduler and worker while 8 streams run on it: all 8 finish on r1 with
    the greedy text of an uninterrupted run (nothing lost, no token twice)."""
    use_policy(stack, "round_robin")
    expected, _ = greedy_streams(stack)
    on_r0 = []

    def kill_r0(ids, finished) -> None:
        for name in ("scheduler@r0", "worker0@r0"):
            proc(stack, name).signal(signal.SIGKILL)
        on_r0.extend(i for i, rid in enumerate(ids) if owner(stack, rid) == "r0" and not finished[i])

    texts, ids = greedy_streams(stack, kill_r0)
    assert len(on_r0) == 8  # 8 streams ran on r0 when it was killed
    assert texts == expected
    assert [owner(stack, i) for i in ids] == ["r1"] * STREAMS  # r0's 8 were adopted by r1
