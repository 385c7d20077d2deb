"""`pagedserve bench services` end to end: the services as processes against the engine in process,
on a tiny model with the default model's tokenizer (the services need a real one)."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from pagedserve.bench import add_bench_parser


@pytest.mark.slow  # the services' tokenizer needs a real tokenizer: the default model's
def test_bench_services_tiny_model(tmp_path, tiny_model):
    out = tmp_path / "bench.json"
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "services", "--model", str(tiny_model), "--dtype", "float32", "--device", "cpu",
                              "--workload", "random", "--num-prompts", "6", "--input-len", "20",
                              "--output-len", "8", "--concurrency", "3", "--repeats", "2",
                              "--kv-cache-memory", "16MiB", "--redis-url", "redis://127.0.0.1:6379/0",
                              "--json", str(out)])
    result = args.func(args)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["output_tokens"] == 6 * 8 and len(result["runs"]) == 2
    for run in result["runs"]:
        for side in ("in_process", "services"):
            assert run[side]["output_tok_s"] > 0 and run[side]["ttft_median_ms"] > 0
        assert run["ratio"] == run["services"]["output_tok_s"] / run["in_process"]["output_tok_s"]
        assert run["tpot_ratio"] == run["services"]["tpot_median_ms"] / run["in_process"]["tpot_median_ms"]
    assert result["step_rtt_median_ms"] > 0
    # Every service process's CPU per output token is counted; the worker does the model's work.
    cpu = result["services_cpu_ms_per_token"]
    assert {"gateway", "tokenizer", "scheduler"} <= set(cpu) and any(n.startswith("worker") for n in cpu)
    assert all(ms > 0 for ms in cpu.values()) and result["in_process_cpu_ms_per_token"] > 0
    front = sum(ms for name, ms in cpu.items() if not name.startswith("worker"))
    assert result["front_end_cpu_ms_per_token"] == pytest.approx(front) and front > cpu["gateway"]
    cores_ms = (os.cpu_count() or 1) * 1e3 / result["in_process"]["output_tok_s"]
    assert result["front_end_share"] == pytest.approx(front / cores_ms)
