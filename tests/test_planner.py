"""The planner's commands: calibrate on the tiny model writes a profile with its fit error; plan
writes bench serve's JSON keys and is deterministic for a seed; traces, the sweep's ranking and
plot, the memory arithmetic, the plan-vs-real page. (The accuracy against real runs on the default
model is a benchmark: `pagedserve plan-accuracy`, docs/planner.md.)"""

from __future__ import annotations

import argparse
import json

import pytest

from pagedserve.cli import main
from pagedserve.planner.cost_model import TERMS, CostModel, Profile, StepShape, fit


@pytest.fixture(scope="module")
def profile_path(tiny_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    assert main(["calibrate", "--model", str(tiny_llama), "--dtype", "float32", "--device", "cpu", "--quick",
                 "--repeats", "1", "--kv-cache-memory", "8MiB", "--step-overhead-ms", "0.5",
                 "--out", str(path)]) == 0
    return path


def test_calibrate_writes_a_profile_with_its_fit_error(profile_path):
    profile = Profile.load(profile_path)
    assert set(profile.cost.coefficients) == set(TERMS)
    assert all(v >= 0 for v in profile.cost.coefficients.values())
    fit_report = profile.cost.fit
    assert fit_report.points == len(profile.samples) > 20
    assert 0 <= fit_report.mean_abs_rel_error <= fit_report.max_abs_rel_error
    assert profile.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, float32
    assert profile.default_kv_cache_bytes == 8 * 2**20
    assert profile.step_overhead_s == pytest.approx(0.0005)
    assert all(s["seconds"] > 0 and s["predicted_seconds"] >= 0 for s in profile.samples)
    # the tiny model's arithmetic for the LoRA term: 2 layers of q/k/v (64 -> 64 + 2 x 32), o (64 -> 64),
    # gate/up (64 -> 2 x 128), down (128 -> 64)
    assert profile.linear_macs_per_token == 2 * (64 * 128 + 64 * 64 + 64 * 256 + 128 * 64)
    assert profile.lora_macs_per_rank == 2 * ((3 * 64 + 128) + (64 + 64) + (2 * 64 + 256) + (128 + 64))
    assert profile.weight_bytes > 0 and profile.dtype_bytes == 4


def test_calibrate_prints_the_fit_error(tiny_llama, tmp_path, capsys):
    main(["calibrate", "--model", str(tiny_llama), "--dtype", "float32", "--device", "cpu", "--quick",
          "--repeats", "1", "--kv-cache-memory", "8MiB", "--out", str(tmp_path / "p.json")])
    out = capsys.readouterr().out
    assert "fit over" in out and "mean |error|" in out and "per_token" in out


def test_the_fit_recovers_a_known_cost_model():
    truth = CostModel(dict(zip(TERMS, (2e-3, 1e-4, 5e-5, 3e-4, 2e-9, 1e-7))), knee=64)
    shapes = []
    for p, cp, d, c in [(p, cp, d, c) for p in (0, 16, 128, 512) for cp in (0, 256) for d in (0, 1, 8, 32)
                        for c in (64, 1024) if p or d]:
        s = StepShape()
        for _ in range(d):
            s.add(1, c, c + 1)
        if p:
            s.add(p, cp, cp + p)
        shapes.append(s)
    model = fit([(s, truth.predict(s)) for s in shapes])
    assert model.fit.max_abs_rel_error < 1e-6
    assert model.knee == 64


def test_the_lora_term_is_the_adapters_arithmetic_at_the_calibrated_rates():
    cost = CostModel(dict(zip(TERMS, (2e-3, 1e-4, 0.0, 0.0, 0.0, 0.0))))
    profile = Profile("m", "cpu", "float32", cost, 64, 256, 1 << 20, linear_macs_per_token=1000,
                      lora_macs_per_rank=10, weight_bytes=4000, dtype_bytes=4)
    lora = profile.lora_cost(16)
    assert lora.seconds_per_row == pytest.approx(1e-4 * 160 / 1000)  # 16 x 10 extra multiply-adds a row
    assert lora.seconds_per_slot == pytest.approx(2e-3 * 160 * 4 / 4000)  # its 160 values' bytes, read once
    shape = StepShape()
    shape.add(1, 10, 11, lora=True)
    shape.add(5, 0, 5)
    shape.lora_slots = 1
    assert profile.step_time(shape, lora) - profile.step_time(shape) == pytest.approx(1.6e-5 + 3.2e-4)
    with pytest.raises(ValueError, match="recalibrate|calibrate"):
        Profile("m", "cpu", "float32", cost, 64, 256, 1 << 20).lora_cost(16)  # a profile from before the term


def plan(profile_path, tmp_path, *flags) -> dict:
    out = tmp_path / f"plan-{len(list(tmp_path.iterdir()))}.json"
    assert main(["plan", "--profile", str(profile_path), "--json", str(out), *flags]) == 0
    return json.loads(out.read_text())


def bench_serve_keys() -> set[str]:
    from pagedserve.bench.serve_client import aggregate
    keys = set(aggregate([], [], 1.0, None, None))
    return keys | {"prefix_cache_hit_rate", "request_rate", "max_concurrency", "model", "dataset", "dataset_path",
                   "num_prompts", "prompt_format", "input_len", "output_len", "range_ratio", "num_prefixes",
                   "suffixes_per_prefix", "prefix_len", "suffix_len", "burstiness", "seed", "slo_ttft_ms",
                   "slo_tpot_ms"}


def test_plan_writes_bench_serves_keys_and_is_deterministic(profile_path, tmp_path):
    flags = ["--dataset", "prefix", "--num-prefixes", "2", "--suffixes-per-prefix", "4", "--prefix-len", "64",
             "--suffix-len", "16", "--output-len", "12", "--request-rate", "50", "--kv-cache-memory", "1MiB",
             "--slo-ttft-ms", "1000", "--slo-tpot-ms", "1000"]
    first = plan(profile_path, tmp_path, *flags, "--seed", "3")
    second = plan(profile_path, tmp_path, *flags, "--seed", "3")
    assert first == second
    assert bench_serve_keys() <= set(first)
    assert first["completed"] == 8 and first["failed"] == 0
    assert first["total_output_tokens"] == 8 * 12 and first["total_input_tokens"] == 8 * 80
    assert first["prefix_cache_hit_rate"] > 0.3  # a prefix is computed once, then found
    assert first["goodput"] is not None and first["ttft_ms"]["median"] > 0 and first["tpot_ms"]["median"] > 0
    extras = first["planner"]
    assert extras["num_steps"] > 0 and extras["kv_usage_over_time"] and 0 < extras["kv_usage_peak"] <= 1
    other_seed = plan(profile_path, tmp_path, *flags, "--seed", "4")
    assert other_seed["ttft_ms"] != first["ttft_ms"]


def test_plan_replays_a_trace_file(profile_path, tmp_path):
    trace = tmp_path / "trace.jsonl"
    lines = [{"arrival_s": 0.0, "prompt_tokens": 40, "output_tokens": 5, "prefix_id": "a", "prefix_tokens": 32},
             {"arrival_s": 0.5, "prompt_tokens": 40, "output_tokens": 7, "prefix_id": "a", "prefix_tokens": 32},
             {"arrival_s": 0.2, "prompt_token_ids": list(range(50, 70)), "output_tokens": 3}]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    result = plan(profile_path, tmp_path, "--trace", str(trace))
    assert result["completed"] == 3 and result["total_output_tokens"] == 15
    assert result["prefix_cache_hit_rate"] == pytest.approx(32 / (40 + 40 + 20))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0, "prompt_tokens": 4}\n')
    assert main(["plan", "--profile", str(profile_path), "--trace", str(bad)]) == 2


def test_the_plan_moves_with_lora_adapters(profile_path, tmp_path):
    flags = ["--num-prompts", "8", "--input-len", "24", "--output-len", "6", "--kv-cache-memory", "1MiB"]
    base = plan(profile_path, tmp_path, *flags)
    lora_on = ["--enable-lora", "--max-loras", "4", "--loras", "4"]
    four = plan(profile_path, tmp_path, *flags, *lora_on)
    wide = plan(profile_path, tmp_path, *flags, *lora_on, "--max-lora-rank", "64")
    assert base["planner"]["num_steps"] == four["planner"]["num_steps"] == wide["planner"]["num_steps"]
    assert base["planner"]["mean_step_ms"] < four["planner"]["mean_step_ms"] < wide["planner"]["mean_step_ms"]
    assert base["output_throughput"] > four["output_throughput"] > wide["output_throughput"]
    assert base["planner"]["lora"] is None and 0 < four["planner"]["lora"]["lora_ms_total"]
    # one adapter per step (--max-loras 1): the real scheduler holds the others back
    one = plan(profile_path, tmp_path, *flags, "--enable-lora", "--max-loras", "1", "--loras", "4")
    assert one["planner"]["num_steps"] > four["planner"]["num_steps"]
    assert main(["plan", "--profile", str(profile_path), *flags, "--loras", "4"]) == 2  # adapters need --enable-lora


def test_the_sweep_ranks_configurations_and_plots(profile_path, tmp_path, capsys):
    out_dir = tmp_path / "sweep"
    assert main(["plan", "--profile", str(profile_path), "--num-prompts", "12", "--input-len", "64",
                 "--output-len", "8", "--kv-cache-memory", "1MiB", "--slo-ttft-ms", "200", "--slo-tpot-ms", "50",
                 "--sweep", "max_num_batched_tokens=32,128", "max_num_seqs=2,8", "--out-dir", str(out_dir)]) == 0
    summary = json.loads((out_dir / "plan_sweep.json").read_text())
    assert len(summary["results"]) == 4 and len(summary["ranked"]) == 4
    assert (out_dir / "plan_sweep.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "winner:" in out and "binding budget:" in out and "the queue forms" in out
    # max_num_seqs=2 with 12 requests at once: the sequence budget binds there.
    two = next(r for r in summary["results"] if r["sweep_overrides"] == {"max_num_batched_tokens": 128,
                                                                          "max_num_seqs": 2})
    reasons = two["planner"]["waiting_request_seconds"]
    assert max(reasons, key=reasons.get) == "seq_budget"
    assert main(["plan", "--profile", str(profile_path), "--sweep", "max_num_tokens=1"]) == 2


def test_memory_arithmetic(profile_path, capsys):
    assert main(["plan", "--memory", "--profile", str(profile_path), "--context-len", "100",
                 "--kv-cache-memory", "1MiB"]) == 0
    out = capsys.readouterr().out
    # 512 bytes per token, 16-token blocks: 128 blocks; 100 tokens take 7 blocks -> 18 requests.
    assert "128" in out and "18" in out
    from pagedserve.planner.memory import memory_table
    table = memory_table(512, 100, 16, [2**20])
    assert table["pools"][0] == {"kv_cache_bytes": 2**20, "num_blocks": 128, "concurrent_requests": 18}
    waste = {row["block_size"]: row["wasted_tokens_at_this_length"] for row in table["block_size_waste"]}
    assert waste[16] == 12 and waste[64] == 28


def test_plan_beside_a_real_run_as_html(profile_path, tmp_path):
    real = plan(profile_path, tmp_path, "--num-prompts", "4", "--input-len", "32", "--output-len", "4")
    real_path = tmp_path / "real.json"
    real_path.write_text(json.dumps(real))
    out_dir = tmp_path / "html"
    assert main(["plan", "--profile", str(profile_path), "--num-prompts", "4", "--input-len", "32",
                 "--output-len", "4", "--compare", str(real_path), "--out-dir", str(out_dir)]) == 0
    page = (out_dir / "plan_vs_real.html").read_text()
    assert "Plan vs real run" in page and "data:image/png;base64," in page and "+0.0%" in page


def test_workload_flags_match_bench_serves():
    from pagedserve.bench.serve import add_serve_parser
    from pagedserve.planner import add_workload_args

    serve = argparse.ArgumentParser()
    add_serve_parser(serve.add_subparsers())
    serve_args = vars(serve.parse_args(["serve"]))
    planner = argparse.ArgumentParser()
    add_workload_args(planner)
    for key, value in vars(planner.parse_args([])).items():
        if key != "trace":
            assert serve_args[key] == value, key


def test_bench_serve_records_a_trace_the_planner_replays(tmp_path):
    from pagedserve.bench.serve import write_trace
    from pagedserve.bench.serve_datasets import BenchRequest
    from pagedserve.planner.trace import load_trace

    requests = [BenchRequest([5, 6, 7, 8], 4, 3), BenchRequest("some words here", 3, 9)]
    result = {"requests": [{"prompt_tokens": 4, "output_tokens": 3}, {"prompt_tokens": 5, "output_tokens": None}]}
    args = argparse.Namespace(request_rate=2.0, seed=1, burstiness=1.0)
    path = tmp_path / "trace.jsonl"
    write_trace(str(path), requests, result, args)
    trace = load_trace(path)
    assert sorted((r.prompt_tokens, r.output_tokens) for r in trace) == [(4, 3), (5, 9)]
    assert [5, 6, 7, 8] in [r.prompt_token_ids for r in trace]
    assert all(r.arrival_s > 0 for r in trace)


def test_plan_on_a_sharegpt_file(profile_path, tmp_path):
    def conv(human: str, gpt: str) -> dict:
        return {"conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]}

    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps([conv("tell me about the sea " * 4, "the sea is wide and deep " * 3),
                                conv("why is the sky blue " * 3, "light scatters in the air " * 2)]))
    result = plan(profile_path, tmp_path, "--dataset", "sharegpt", "--dataset-path", str(data), "--num-prompts", "5")
    assert result["completed"] == 2 and result["dataset"] == "sharegpt"
    assert result["total_output_tokens"] == sum(r["expected_output_tokens"] for r in result["requests"])
