"""The engine's introspection without processes: the gateway's "timings" object (the TTFT and its
breakdown by stage, with stamps missing or out of order) and GET /v1/engine/stats' JSON from the
scheduler's message. On the real services: tests/stack/test_engine_stats_stack.py."""

from __future__ import annotations

import json

import pytest

STAGES = ("gateway", "tokenizer", "queue", "prefill", "network")


def test_timings_object_partitions_the_ttft_even_with_stamps_missing_or_out_of_order():
    from pagedserve.gateway.timings import timings_object
    t0 = 1_700_000_000.0
    full = {"gateway_received": t0, "tokenizer_received": t0 + 0.001, "tokenized": t0 + 0.002,
            "scheduler_received": t0 + 0.003, "first_scheduled": t0 + 0.010, "first_token": t0 + 0.030,
            "first_token_streamed": t0 + 0.032, "finished": t0 + 0.5, "prefill_chunks": 2, "num_steps": 9}
    t = timings_object(full)
    assert t["ttft_ms"] == pytest.approx(32.0, abs=1e-3) and t["prefill_chunks"] == 2 and t["num_preemptions"] == 0
    assert t["ttft_breakdown_ms"] == pytest.approx({"gateway": 1.0, "tokenizer": 2.0, "queue": 7.0, "prefill": 20.0,
                                                    "network": 2.0}, abs=1e-3)
    # A missing stamp gives its stage 0; a stamp behind the previous one (another machine's clock) too.
    odd = {**full, "scheduler_received": 0.0, "first_scheduled": t0 + 0.0005}
    t = timings_object(odd)
    b = t["ttft_breakdown_ms"]
    assert b["tokenizer"] == 0.0 and b["queue"] == 0.0 and all(v >= 0 for v in b.values())
    assert sum(b[s] for s in STAGES) == t["ttft_ms"] and t["ttft_ms"] == pytest.approx(32.0, abs=1e-3)
    # Not streamed yet (or not through this gateway): no TTFT.
    t = timings_object({**full, "first_token_streamed": 0.0})
    assert t["ttft_ms"] is None and t["ttft_breakdown_ms"] is None


def test_engine_stats_json_from_the_scheduler_message():
    from pagedserve.v1 import common_pb2, scheduler_pb2
    from pagedserve.gateway.backend import engine_stats_dict
    msg = scheduler_pb2.EngineStats(
        time=5.0, ready=True, config=scheduler_pb2.EngineConfig(max_num_batched_tokens=512, max_num_seqs=8,
                                                                block_size=16, num_gpu_blocks=4, max_model_len=64),
        waiting=["w"], running=["r"], num_blocks=4, block_states="uuc.",
        tables=[scheduler_pb2.BlockTable(request_id="r", block_ids=[1, 0])],
        steps=[scheduler_pb2.StepStats(step=i, scheduled_tokens=i) for i in range(1, 6)],
        recent_requests=[scheduler_pb2.RecentRequest(
            request_id="x", prompt_tokens=3, output_tokens=2, finish_reason="stop",
            timings=common_pb2.Timings(gateway_received=1.0, first_token=1.5))])
    msg.totals.waiting_reasons.no_blocks = 7
    gateway_stamps = {"x": {"first_token_streamed": 1.6}}
    out = engine_stats_dict(msg, 2, lambda rid, stamps: {**stamps, **gateway_stamps.get(rid, {})})
    assert out["config"]["num_gpu_blocks"] == 4 and out["queues"] == {"waiting": ["w"], "running": ["r"], "swapped": []}
    assert out["kv"] == {"num_blocks": 4, "states": "uuc.", "tables": {"r": [1, 0]}}
    assert [s["step"] for s in out["steps"]] == [4, 5]
    assert set(out["steps"][0]["waiting_reasons"]) == {"no_blocks", "seq_budget", "token_budget"}
    assert out["totals"]["waiting_reasons"]["no_blocks"] == 7 and isinstance(out["totals"]["num_steps"], int)
    timings = out["recent_requests"][0]["timings"]
    assert timings["ttft_ms"] == pytest.approx(600.0)
    assert timings["ttft_breakdown_ms"]["prefill"] == pytest.approx(500.0)
    json.dumps(out)
