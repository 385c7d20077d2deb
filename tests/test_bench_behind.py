"""`pagedserve bench behind` end to end on a tiny random llama: the JSON it writes (both orders, one TTFT
per arrival offset), and that every run's prompts are fresh (a repeated prompt would be a prefix-cache
hit: its TTFT a few tokens' work). Timings are the bench's to show, not this test's."""

from __future__ import annotations

import argparse
import json

import pytest

from tiny_models import build_tiny_model

from pagedserve.bench import add_bench_parser
from pagedserve.engine import LLMEngine


def test_bench_behind_tiny_model(tmp_path, monkeypatch):
    model = build_tiny_model(tmp_path / "model")
    out = tmp_path / "behind.json"
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "behind", "--model", str(model), "--dtype", "float32", "--device", "cpu",
                              "--long-len", "40", "--short-len", "4", "--offsets", "3", "--lone-runs", "2",
                              "--max-num-batched-tokens", "32", "--long-prefill-token-threshold", "8",
                              "--kv-cache-memory", "8MiB", "--json", str(out)])
    prompts = []
    add_request = LLMEngine.add_request

    def recording_add_request(self, request_id, prompt, params, *rest, **kw):  # the real one, prompts noted
        prompts.append((request_id, list(prompt)))
        return add_request(self, request_id, prompt, params, *rest, **kw)

    monkeypatch.setattr(LLMEngine, "add_request", recording_add_request)
    assert args.func(args) == 0
    data = json.loads(out.read_text())
    assert data["chunk_tokens"] == 8 and data["long_len"] == 40 and len(data["offsets_ms"]) == 3
    for mode in ("short_first", "fcfs"):
        assert len(data[mode]["short_ttft_ms"]) == 3 and all(t > 0 for t in data[mode]["short_ttft_ms"])
        assert data[mode]["long_ttft_median_ms"] > 0 and data[mode]["ratio_to_lone"] > 0
    # warm-up short + warm-up pair + 2 lone + 3 offsets x 2 orders x 2 prompts
    assert len(prompts) == 1 + 2 + 2 + 12
    firsts = [tuple(p[:4]) for _, p in prompts]
    assert len(set(firsts)) == len(firsts)  # no run shares a first block with another
    assert sorted(len(p) for _, p in prompts if "long" in _) == [40] * 7


@pytest.mark.parametrize("flag", ["--offsets", "--lone-runs", "--long-len", "--short-len"])
def test_bench_behind_refuses_counts_below_one_before_loading_anything(flag):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "behind", "--model", "/nonexistent", flag, "0"])
    with pytest.raises(SystemExit, match="must be at least 1"):
        args.func(args)
