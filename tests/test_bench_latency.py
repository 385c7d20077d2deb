"""`pagedserve bench latency` end to end on a tiny random llama: the JSON it writes, and that the
measured run's prompt is not the warm-up's (a repeated prompt would be a prefix-cache hit and its
TTFT a few tokens' work)."""

from __future__ import annotations

import argparse
import json

import torch
from tiny_models import build_tiny_model

from pagedserve.bench import add_bench_parser
from pagedserve.engine import LLMEngine

KEYS = {"ttft_ms", "ttft_cpu_ms", "prefill_tokens_per_s", "decode_tokens_per_s", "decode_ms_per_token",
        "decode_cpu_ms_per_token", "rss_mib", "weight_mib", "weight_read_gb_per_s", "threads", "quantization"}


def test_bench_latency_tiny_model(tmp_path, monkeypatch):
    model = build_tiny_model(tmp_path / "model")
    out = tmp_path / "latency.json"
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "latency", "--model", str(model), "--dtype", "float32", "--device", "cpu",
                              "--input-len", "48", "--output-len", "6", "--warmup", "2", "--kv-cache-memory", "8MiB",
                              "--json", str(out)])
    prompts = []
    add_request = LLMEngine.add_request

    def recording_add_request(self, request_id, prompt, params, *rest, **kw):  # the real one, prompts noted
        prompts.append(list(prompt))
        return add_request(self, request_id, prompt, params, *rest, **kw)

    monkeypatch.setattr(LLMEngine, "add_request", recording_add_request)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert args.func(args) == 0
    finally:
        torch.set_num_threads(threads)
    data = json.loads(out.read_text())
    assert KEYS <= data.keys()
    assert data["ttft_ms"] > 0 and data["ttft_cpu_ms"] > 0 and data["decode_tokens_per_s"] > 0
    assert len(prompts) == 3 and all(len(p) == 48 for p in prompts)
    assert prompts[-1] not in prompts[:-1] and prompts[0][:16] != prompts[-1][:16]  # no shared first block
