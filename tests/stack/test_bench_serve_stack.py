"""`pagedserve bench serve` against the real services (a tiny model with the default model's
tokenizer). Its helpers without a network: tests/test_bench_serve.py."""

from __future__ import annotations

import json

import pytest

from service_stack import wait_until_idle

STAGES = ("gateway", "tokenizer", "queue", "prefill", "network")
METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")


@pytest.fixture(scope="module")
def stack(tiny_model, launch_stack):
    stack = launch_stack(tiny_model, kv_cache_memory="64MiB")
    stack.model_path = tiny_model
    return stack


def bench(stack, *argv: str) -> dict:
    from pagedserve.cli import build_parser

    args = build_parser().parse_args(["bench", "serve", "--base-url", stack.http_url, "--disable-tqdm", *argv])
    return args.func(args)


@pytest.mark.slow
def test_random_run_reports_every_metric(stack, tmp_path):
    out = tmp_path / "result.json"
    result = bench(stack, "--tokenizer", str(stack.model_path), "--num-prompts", "20", "--input-len", "32",
                   "--output-len", "16", "--max-concurrency", "4",
                   "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--json", str(out))
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["failed"] == 0 and result["completed"] == 20, result["errors"]
    assert result["prompt_format"] == "token_ids"
    assert all(r["output_tokens"] == 16 == r["expected_output_tokens"] for r in result["requests"])
    assert all(r["prompt_tokens"] == 32 for r in result["requests"])  # token ids: the length is exact
    assert result["total_output_tokens"] == 320 and result["total_input_tokens"] == 640
    for key in ("duration_s", "request_throughput", "output_throughput", "total_token_throughput", "goodput"):
        assert result[key] > 0, key
    assert result["goodput"] == pytest.approx(result["request_throughput"])  # generous SLOs: all good
    assert result["output_throughput"] == pytest.approx(16 * result["request_throughput"])
    for key in METRICS:
        s = result[key]
        assert set(s) == {"mean", "median", "p90", "p99"}
        assert 0 < s["median"] <= s["p90"] <= s["p99"], (key, s)
    assert result["ttft_ms"]["median"] <= result["e2el_ms"]["median"]
    assert result["max_concurrency"] == 4 and result["request_rate"] == "inf"
    assert result["model"] and result["base_url"] == stack.http_url and result["seed"] == 0
    assert "prefix_cache_hit_rate" in result
    assert "ttft_breakdown_ms" in result
    wait_until_idle(stack)
    # "Where did my first token go": the server's stages add up to its TTFT, and with the client's
    # share beyond them to the TTFT the client measured.
    breakdown = result["ttft_breakdown_ms"]
    assert set(breakdown) == {*STAGES, "client_overhead"}, breakdown
    assert all(breakdown[stage] >= 0 for stage in STAGES), breakdown
    stages = sum(breakdown[stage] for stage in STAGES)
    assert stages == pytest.approx(result["server_ttft_ms"]["mean"], rel=0.10)
    assert stages + breakdown["client_overhead"] == pytest.approx(result["ttft_ms"]["mean"], rel=0.01)
    assert result["server_ttft_ms"]["mean"] <= result["ttft_ms"]["mean"]


@pytest.mark.slow
def test_poisson_rate_and_chat_endpoint(stack):
    result = bench(stack, "--num-prompts", "6", "--input-len", "16", "--output-len", "8", "--request-rate", "20",
                   "--endpoint", "chat", "--seed", "3")
    assert result["failed"] == 0 and result["completed"] == 6, result["errors"]
    assert result["request_rate"] == 20.0 and result["goodput"] is None
    assert all(r["output_tokens"] == 8 for r in result["requests"])
    wait_until_idle(stack)


@pytest.mark.slow
def test_sharegpt_file_with_a_tokenizer(stack, tmp_path):
    from transformers import AutoTokenizer

    replies = ["The sea is wide and the sky above it is blue.", "Once upon a time a dragon slept on gold.",
               "Paged attention keeps the KV cache in fixed-size blocks."]
    chats = [{"conversations": [{"from": "human", "value": f"Question number {i}: please tell me something."},
                                {"from": "gpt", "value": reply}]} for i, reply in enumerate(replies)]
    path = tmp_path / "sharegpt.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in chats))
    result = bench(stack, "--tokenizer", str(stack.model_path), "--dataset", "sharegpt", "--dataset-path", str(path),
                   "--num-prompts", "10")
    assert result["failed"] == 0 and result["completed"] == 3 and result["num_prompts"] == 3, result["errors"]
    tok = AutoTokenizer.from_pretrained(stack.model_path)
    expected = sorted(len(tok(r, add_special_tokens=False).input_ids) for r in replies)
    assert sorted(r["expected_output_tokens"] for r in result["requests"]) == expected
    assert all(r["output_tokens"] == r["expected_output_tokens"] for r in result["requests"])
    wait_until_idle(stack)


@pytest.mark.slow
def test_prefix_workload_hits_the_prefix_cache(stack):
    result = bench(stack, "--tokenizer", str(stack.model_path), "--dataset", "prefix", "--num-prefixes", "2",
                   "--suffixes-per-prefix", "6",
                   "--prefix-len", "128", "--suffix-len", "8", "--output-len", "4", "--max-concurrency", "2",
                   "--seed", "5")
    assert result["failed"] == 0 and result["completed"] == 12, result["errors"]
    assert result["prefix_cache_hit_rate"] > 0.5, result["prefix_cache_hit_rate"]
    wait_until_idle(stack)


@pytest.mark.slow
def test_sweep_writes_json_and_plots(stack, tmp_path):
    out_dir = tmp_path / "sweep"
    summary = bench(stack, "--num-prompts", "4", "--input-len", "16", "--output-len", "8",
                    "--sweep", "concurrency:1,4", "--out-dir", str(out_dir))
    levels = json.loads((out_dir / "sweep.json").read_text())
    assert [lv["sweep_level"] for lv in levels] == ["1", "4"] == summary["levels"]
    assert [lv["max_concurrency"] for lv in levels] == [1, 4]
    assert all(lv["failed"] == 0 and lv["completed"] == 4 for lv in levels)
    for name in ("throughput.png", "ttft.png", "tpot.png"):
        data = (out_dir / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    wait_until_idle(stack)


@pytest.mark.slow
def test_failures_are_counted(stack, capsys):
    result = bench(stack, "--num-prompts", "5", "--input-len", "8", "--output-len", "4", "--model", "no-such-model")
    assert result["completed"] == 0 and result["failed"] == 5
    assert all(e.startswith("HTTP 4") for e in result["errors"]), result["errors"]
    assert all(r["error"] for r in result["requests"])
    assert result["ttft_ms"]["mean"] is None and result["request_throughput"] == 0
    assert "failed: HTTP 4" in capsys.readouterr().out
