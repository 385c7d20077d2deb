"""Cohere's Command-R (CohereForCausalLM) on tiny random models built here (norms varied, per-head
q/k norms on and off, a logit scale): greedy tokens equal transformers' in float32, plain, chunked
and on two tensor-parallel ranks (each rank holds its heads' q/k norm rows), and logprobs to 1e-4
(the logit scale and the interleaved rotary show there)."""

from __future__ import annotations

import pytest

from test_qwen3_phi3 import LENGTHS, MAX_NEW, PROMPTS, run
from tiny_models import build_tiny_model, check_logprobs_equal_transformers, hf_greedy, make_engine

CASES = {"qk_norm": {}, "plain": {"use_qk_norm": False}}


@pytest.fixture(scope="module", params=list(CASES))
def cohere(request, tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp(f"cohere-{request.param}"), "cohere", **CASES[request.param])
    return folder, hf_greedy(folder, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("overrides", [{}, {"max_num_batched_tokens": 16}, {"tensor_parallel_size": 2}])
def test_greedy_tokens_equal_transformers(cohere, overrides):
    folder, expected = cohere
    with make_engine(folder, **overrides) as engine:
        got = run(engine)
    for length, ours, theirs in zip(LENGTHS, got, expected):
        assert ours == theirs, f"prompt of {length} tokens, {overrides}"


def test_logprobs_equal_transformers(cohere):
    folder, _ = cohere
    check_logprobs_equal_transformers(folder, PROMPTS[3])
