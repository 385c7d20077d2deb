"""`pagedserve bench serve` against the real services (a tiny model with the default model's
tokenizer), and its arrival, statistics and dataset helpers without a network."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest

from pagedserve.bench.serve import parse_sweep
from pagedserve.bench.serve_client import arrival_gaps, summarize
from pagedserve.bench.serve_datasets import PromptMaker, load_sharegpt, prefix_requests, random_requests
from service_stack import start_test_stack, tiny_model_with_tokenizer, wait_until_idle

STAGES = ("gateway", "tokenizer", "queue", "prefill", "network")
METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")


# ---- no network ---------------------------------------------------------------------------------

def test_poisson_arrivals_are_seeded_with_the_right_mean():
    gaps = arrival_gaps(20000, 4.0, seed=7)
    assert gaps == arrival_gaps(20000, 4.0, seed=7)
    assert gaps != arrival_gaps(20000, 4.0, seed=8)
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.03)
    assert np.std(gaps) == pytest.approx(0.25, rel=0.05)  # exponential: std == mean
    assert np.mean(arrival_gaps(20000, 4.0, seed=7, burstiness=4.0)) == pytest.approx(0.25, rel=0.03)
    assert arrival_gaps(5, math.inf, seed=0) == [0.0] * 5


def test_summary_math():
    s = summarize([float(v) for v in range(1, 101)])
    assert s == {"mean": 50.5, "median": 50.5, "p90": pytest.approx(90.1), "p99": pytest.approx(99.01)}
    assert summarize([3.0]) == {"mean": 3.0, "median": 3.0, "p90": 3.0, "p99": 3.0}
    assert summarize([]) == {"mean": None, "median": None, "p90": None, "p99": None}


def test_sweep_parsing():
    assert parse_sweep("rates:1,2,inf") == ("rates", [1.0, 2.0, math.inf])
    assert parse_sweep("concurrency:1,4") == ("concurrency", [1.0, 4.0])
    for bad in ("speed:1", "rates:", "concurrency:1.5", "rates:0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_sweep(bad)


def test_random_and_prefix_datasets():
    words = PromptMaker(None)
    reqs = random_requests(50, 40, 20, 0.5, seed=3, maker=words)
    assert all(20 <= q.prompt_len <= 60 and 10 <= q.output_len <= 30 for q in reqs)
    assert all(len(q.prompt.split()) == q.prompt_len for q in reqs)
    assert [q.prompt for q in reqs] == [q.prompt for q in random_requests(50, 40, 20, 0.5, seed=3, maker=words)]

    class Tok:
        vocab_size = 1000
        all_special_ids = [0, 1, 2, 500]

    ids = PromptMaker(Tok())
    fixed = random_requests(10, 32, 16, 0.0, seed=0, maker=ids)
    assert all(len(q.prompt) == 32 and q.output_len == 16 for q in fixed)
    assert all(100 <= t < 1000 and t != 500 for q in fixed for t in q.prompt)

    pre = prefix_requests(3, 4, 16, 4, 8, seed=1, maker=ids)
    assert len(pre) == 12 and all(len(q.prompt) == 20 for q in pre)
    prefixes = [tuple(q.prompt[:16]) for q in pre]
    assert len(set(prefixes)) == 3 and all(prefixes.count(p) == 4 for p in set(prefixes))
    assert prefixes != sorted(prefixes, key=prefixes.index)  # shuffled, not grouped


def test_sharegpt_loader(tmp_path):
    def conv(human: str, gpt: str) -> dict:
        return {"conversations": [{"from": "system", "value": "be nice"}, {"from": "human", "value": human},
                                  {"from": "gpt", "value": gpt}]}

    entries = [conv("tell me about the sea and the sky", "the sea is wide and the sky is blue " * 3),
               conv("hi", "hello there my friend, how are you"),  # prompt too short
               conv("what is the answer to this question", "no"),  # reply too short
               conv("word " * 2000, "a long prompt is skipped " * 2),
               {"conversations": [{"from": "human", "value": "no reply here at all"}]},
               conv("write a long story about a dragon please", "once upon a time " * 10)]
    as_json = tmp_path / "chats.json"
    as_json.write_text(json.dumps(entries))
    as_jsonl = tmp_path / "chats.jsonl"
    as_jsonl.write_text("\n".join(json.dumps(e) for e in entries) + "\n")
    for path in (as_json, as_jsonl):
        reqs = load_sharegpt(path, 10, seed=0)
        assert sorted(q.prompt for q in reqs) == ["tell me about the sea and the sky",
                                                  "write a long story about a dragon please"]
        by_prompt = {q.prompt: q for q in reqs}
        assert by_prompt["tell me about the sea and the sky"].output_len == round(27 * 1.3)
        assert by_prompt["write a long story about a dragon please"].output_len == round(40 * 1.3)
    assert len(load_sharegpt(as_json, 1, seed=0)) == 1


# ---- against the services -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(default_model_path, tmp_path_factory):
    model = tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny-tok"), default_model_path)
    stack = start_test_stack(model, tmp_path_factory.mktemp("logs"), kv_cache_memory="64MiB")
    stack.model_path = model
    yield stack
    stack.stop()


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
