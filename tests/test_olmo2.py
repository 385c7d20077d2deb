"""OLMo 2 on a tiny random model built here (its norms' weights varied): greedy tokens equal
transformers' Olmo2ForCausalLM in float32, plain, with chunked prefill and on two tensor-parallel
ranks (each rank's q/k norms hold their slice of the weight and sum the squares across ranks), and
logprobs to 1e-4; KV heads that would be replicated across ranks are refused by name."""

from __future__ import annotations

import pytest

from test_qwen3_phi3 import LENGTHS, MAX_NEW, PROMPTS, run
from tiny_models import build_tiny_model, check_logprobs_equal_transformers, hf_greedy, make_engine


@pytest.fixture(scope="module")
def olmo(tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp("olmo2"), "olmo2")
    return folder, hf_greedy(folder, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("overrides", [{}, {"max_num_batched_tokens": 16}, {"tensor_parallel_size": 2}])
def test_greedy_tokens_equal_transformers(olmo, overrides):
    folder, expected = olmo
    with make_engine(folder, **overrides) as engine:
        got = run(engine)
    for length, ours, theirs in zip(LENGTHS, got, expected):
        assert ours == theirs, f"prompt of {length} tokens, {overrides}"


def test_logprobs_equal_transformers(olmo):
    folder, _ = olmo
    check_logprobs_equal_transformers(folder, PROMPTS[3])


def test_replicated_kv_heads_are_refused(tmp_path):
    folder = build_tiny_model(tmp_path, "olmo2", num_key_value_heads=1)
    with pytest.raises(Exception, match="OLMo 2 with 1 KV heads cannot run on --tensor-parallel-size 2"):
        make_engine(folder, tensor_parallel_size=2)
