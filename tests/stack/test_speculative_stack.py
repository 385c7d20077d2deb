"""Speculative decoding through the services (scheduler -> worker over the step link): with
--speculative-config the default model (float32) answers grounded prompts (repeat code with one
change: bench/grounded.py) with the greedy tokens the in-process engine gives without it, most of
them accepted proposals; /metrics shows the spec_decode counters (and vLLM's names), and each
request's timings its drafted and accepted tokens. In-process engines: tests/test_speculative.py."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from pagedserve.bench.grounded import grounded_token_ids
from pagedserve.common.sampling_params import SamplingParams
from tiny_models import make_engine

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
MAX_TOKENS = 48


@pytest.mark.slow
def test_default_model_greedy_tokens_equal_without_speculation_and_metrics(default_model_path, launch_stack):
    with make_engine(default_model_path, tokenizer=None) as engine:
        prompts = [grounded_token_ids(engine.tokenizer, i) for i in range(2)]
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        expected = [engine.tokenizer.decode(o[0].token_ids, skip_special_tokens=True)
                    for o in engine.generate(prompts, params)]
    stack = launch_stack(default_model_path, speculative_config=SPEC)
    http = httpx.Client(base_url=stack.http_url, timeout=300)
    name = http.get("/v1/models").json()["data"][0]["id"]
    for prompt, text in zip(prompts, expected):
        body = {"model": name, "prompt": prompt, "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                "timings": True}
        reply = http.post("/v1/completions", json=body).json()
        assert reply["choices"][0]["text"] == text
        timings = reply["timings"]
        assert timings["spec_draft_tokens"] >= timings["spec_accepted_tokens"] > MAX_TOKENS // 3, timings
    time.sleep(0.6)  # the gateway shares one /metrics answer for ~0.5 s
    lines = http.get("/metrics").text.splitlines()
    metrics = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(("vllm:", "pag"))}
    drafted = metrics["vllm:spec_decode_num_draft_tokens_total"]
    assert drafted >= metrics["vllm:spec_decode_num_accepted_tokens_total"] > MAX_TOKENS
    assert metrics["pagedserve:spec_decode_num_drafts_total"] > 0
    assert 2 < metrics["pagedserve:spec_decode_mean_acceptance_length"] <= 5


@pytest.mark.slow
def test_draft_model_through_the_services(tiny_model, launch_stack):
    """method draft_model: the flag reaches the worker, which loads the draft (here the target
    itself: every proposal kept) beside the target; the greedy tokens equal the engine's without
    speculation."""
    prompts = [[5, 6, 7, 8] * 6, list(range(100, 140))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with make_engine(tiny_model, tokenizer=None) as engine:
        expected = [engine.tokenizer.decode(o[0].token_ids, skip_special_tokens=True)
                    for o in engine.generate(prompts, params)]
    spec = json.dumps({"method": "draft_model", "model": str(tiny_model), "num_speculative_tokens": 3})
    stack = launch_stack(tiny_model, logs="draft-logs", speculative_config=spec)
    http = httpx.Client(base_url=stack.http_url, timeout=300)
    name = http.get("/v1/models").json()["data"][0]["id"]
    for prompt, text in zip(prompts, expected):
        body = {"model": name, "prompt": prompt, "temperature": 0, "max_tokens": 24, "ignore_eos": True,
                "timings": True}
        reply = http.post("/v1/completions", json=body).json()
        assert reply["choices"][0]["text"] == text
        timings = reply["timings"]
        assert timings["spec_draft_tokens"] == timings["spec_accepted_tokens"] > 12, timings
