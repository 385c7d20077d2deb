"""Per-request timings and the engine's introspection, on the real services with a tiny model and a
KV pool of 12 blocks: "timings": true (streamed and not) and its TTFT breakdown against the TTFT a
client measures; preemptions and "no blocks" waits in /metrics and GET /v1/engine/stats; the KV
pool's block states and tables with requests in flight and after. Without processes:
tests/test_engine_stats.py."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from pagedserve.gateway.backend import STATS_CACHE_S
from pagedserve.scheduler.service import STATS_SNAPSHOT_S

from service_stack import wait_until_idle

STAGES = ("gateway", "tokenizer", "queue", "prefill", "network")
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4  # about 40 tokens
OUTPUT_TOKENS = 120  # with the prompt, 10 of the tiny pool's 12 blocks: each request fits alone


# The stack tests are slow: the tiny model borrows the default model's tokenizer.
@pytest.fixture(scope="module")
def stack(tiny_model, launch_stack):
    # 8 KiB per block (float32, 2 layers, 2 KV heads of 16): 12 blocks of 16 tokens.
    return launch_stack(tiny_model, kv_cache_memory="96KiB")


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.http_url, timeout=120) as client:
        yield client


def check_timings(t: dict) -> None:
    for key in ("gateway_received", "tokenizer_received", "tokenized", "scheduler_received", "first_scheduled",
                "first_token", "first_token_streamed", "finished"):
        assert t[key] > 1e9, key
    assert t["gateway_received"] <= t["first_token_streamed"]
    assert t["prefill_chunks"] >= 1 and t["num_steps"] >= 1 and t["num_preemptions"] >= 0
    breakdown = t["ttft_breakdown_ms"]
    assert set(breakdown) == set(STAGES)
    assert all(v >= 0 for v in breakdown.values()), breakdown
    assert abs(sum(breakdown[s] for s in STAGES) - t["ttft_ms"]) < 1e-6
    assert abs(t["ttft_ms"] - (t["first_token_streamed"] - t["gateway_received"]) * 1000) < 1e-3


def stream_ttft(http: httpx.Client, body: dict) -> tuple[float, dict, list[dict]]:
    """(the client's time to the first content chunk in ms, the final chunk's timings, all chunks)"""
    started = time.perf_counter()
    first = None
    chunks = []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            chunks.append(chunk)
            if first is None and any(c.get("text") for c in chunk["choices"]):
                first = (time.perf_counter() - started) * 1000
    with_timings = [c for c in chunks if "timings" in c]
    assert len(with_timings) == 1 and with_timings[0] is chunks[-1], "timings come in the final chunk only"
    return first, chunks[-1]["timings"], chunks


@pytest.mark.slow
def test_timings_in_responses_add_up_to_the_measured_ttft(http):
    body = {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "temperature": 0, "timings": True}
    reply = http.post("/v1/completions", json={**body, "timings": False})  # warm up; no timings unless asked
    assert reply.status_code == 200 and "timings" not in reply.json()
    reply = http.post("/v1/completions", json=body).json()
    check_timings(reply["timings"])
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                                   "timings": True}).json()
    check_timings(chat["timings"])
    # Streaming: in the finish_reason chunk, or in the usage chunk when usage is asked for.
    _, timings, chunks = stream_ttft(http, {**body, "stream_options": {"include_usage": True}})
    assert "usage" in chunks[-1]
    check_timings(timings)
    misses = []
    for _ in range(3):
        client_ttft, timings, chunks = stream_ttft(http, body)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        check_timings(timings)
        server_ttft = timings["ttft_ms"]
        assert server_ttft <= client_ttft + 1.0  # one process's clock vs another's: a ms of slack
        misses.append(client_ttft - server_ttft > max(0.1 * client_ttft, 5.0))
    assert not all(misses), "the server's TTFT breakdown misses more than 10% of the client's TTFT"
    # The request's record has the same object, the gateway's stamps included.
    record = http.get(f"/v1/requests/{chunks[-1]['id']}").json()
    check_timings(record["timings"])
    assert record["timings"]["ttft_ms"] == pytest.approx(timings["ttft_ms"])
    metrics = http.get("/metrics").text
    for stage in STAGES:
        assert any(line.startswith("pagedserve:request_stage_seconds_count{") and f'stage="ttft_{stage}"' in line
                   for line in metrics.splitlines()), stage


def _run_concurrently(http: httpx.Client, n: int, max_tokens: int) -> tuple[list[threading.Thread], list]:
    results = []

    def one(i: int) -> None:
        reply = http.post("/v1/completions", json={"prompt": f"{i} {PROMPT}", "max_tokens": max_tokens,
                                                   "ignore_eos": True, "temperature": 0, "timings": True})
        results.append(reply)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    return threads, results


@pytest.mark.slow
def test_tiny_pool_preempts_and_the_stats_show_it(stack, http):
    stats = http.get("/v1/engine/stats").json()
    cfg = stats["config"]
    assert cfg["num_gpu_blocks"] == 12 and cfg["block_size"] == 16
    assert cfg["max_num_seqs"] >= 1 and cfg["max_num_batched_tokens"] >= 1 and cfg["max_model_len"] == 1024
    # Eight requests of ~160 tokens (10 blocks each) into 12 blocks: most of them wait or are
    # preempted. Long enough (about a thousand steps) that snapshots up to STATS_CACHE_S +
    # STATS_SNAPSHOT_S old still catch blocks in use: four requests of 80 tokens ran out in under
    # that on a quiet machine, and the test saw none.
    threads, results = _run_concurrently(http, 8, OUTPUT_TOKENS)
    in_flight = []
    while any(t.is_alive() for t in threads):
        snap = http.get("/v1/engine/stats", params={"steps": 8}).json()
        if "u" in snap["kv"]["states"]:
            in_flight.append(snap)
        time.sleep(0.02)
    for thread in threads:
        thread.join()
    assert all(r.status_code == 200 for r in results), [r.text for r in results]
    assert in_flight, "never saw a block in use"
    for snap in in_flight:
        kv = snap["kv"]
        assert len(kv["states"]) == kv["num_blocks"] == 12 and set(kv["states"]) <= set(".uc")
        in_tables = {b for ids in kv["tables"].values() for b in ids}
        assert in_tables <= {i for i, c in enumerate(kv["states"]) if c == "u"}
        assert set(kv["tables"]) <= set(snap["queues"]["running"])
        assert len(snap["steps"]) <= 8
    assert any(snap["kv"]["tables"] for snap in in_flight)

    wait_until_idle(stack)
    time.sleep(STATS_CACHE_S + STATS_SNAPSHOT_S)  # the gateway and the scheduler each share a snapshot a while
    stats = http.get("/v1/engine/stats").json()
    assert "u" not in stats["kv"]["states"] and not stats["kv"]["tables"]
    assert not any(stats["queues"].values())
    totals = stats["totals"]
    assert totals["num_preemptions"] > 0 and totals["waiting_reasons"]["no_blocks"] > 0
    steps = stats["steps"]
    assert steps and steps == sorted(steps, key=lambda s: s["step"])
    assert any(s["preemptions"] > 0 for s in steps)
    assert any(s["waiting_reasons"]["no_blocks"] > 0 for s in steps)
    for s in steps:
        assert s["blocks_used"] + s["blocks_cached"] + s["blocks_free"] == 12
        assert s["scheduled_tokens"] == s["prefill_tokens"] + s["decode_tokens"] <= s["token_budget"]
        assert s["num_seqs"] <= s["seq_budget"] and sum(s["waiting_reasons"].values()) == s["waiting"]
        assert s["duration_s"] > 0 and s["time"] > 1e9
    # The recent requests: newest last, with the gateway's TTFT breakdown merged in.
    recent = {r["request_id"]: r for r in stats["recent_requests"]}
    for reply in results:
        body = reply.json()
        entry = recent[body["id"]]
        assert entry["output_tokens"] == OUTPUT_TOKENS and entry["finish_reason"] == "length"
        assert entry["prompt_tokens"] == body["usage"]["prompt_tokens"]
        check_timings(entry["timings"])
        assert entry["timings"]["ttft_ms"] == pytest.approx(body["timings"]["ttft_ms"])
    assert sum(r.json()["timings"]["num_preemptions"] for r in results) > 0
    metrics = http.get("/metrics").text
    preemptions = [line for line in metrics.splitlines() if line.startswith("pagedserve:num_preemptions_total")]
    assert preemptions and float(preemptions[0].split()[-1]) > 0
    for name in ("pagedserve:waiting_reasons_total{", "pagedserve:kv_blocks_used",
                 "pagedserve:kv_blocks_cached", "pagedserve:kv_blocks_free", "pagedserve:step_scheduled_tokens_bucket",
                 "pagedserve:step_token_budget_utilization_bucket", "pagedserve:scheduled_prefill_tokens_total",
                 "pagedserve:scheduled_decode_tokens_total"):
        assert name in metrics, name
    no_blocks = next(line for line in metrics.splitlines()
                     if line.startswith("pagedserve:waiting_reasons_total{") and 'reason="no_blocks"' in line)
    assert float(no_blocks.split()[-1]) > 0
