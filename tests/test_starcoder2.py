"""StarCoder2 on tiny random models built here (biases and LayerNorm biases varied): greedy tokens
equal transformers' Starcoder2ForCausalLM in float32, plain, chunked and on two tensor-parallel ranks,
and logprobs to 1e-4; a config.json that does not say whether the head is tied is read as
transformers reads it (tied); a sliding window caps the context."""

from __future__ import annotations

import json

import pytest

from pagedserve.common.model_config import ModelConfig
from test_qwen3_phi3 import LENGTHS, MAX_NEW, PROMPTS, run
from tiny_models import build_tiny_model, check_logprobs_equal_transformers, hf_greedy, make_engine

CASES = {"tied": {}, "untied": {"tie_word_embeddings": False}}


@pytest.fixture(scope="module", params=list(CASES))
def starcoder(request, tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp(f"starcoder2-{request.param}"), "starcoder2",
                              **CASES[request.param])
    return folder, hf_greedy(folder, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("overrides", [{}, {"max_num_batched_tokens": 16}, {"tensor_parallel_size": 2}])
def test_greedy_tokens_equal_transformers(starcoder, overrides):
    folder, expected = starcoder
    with make_engine(folder, **overrides) as engine:
        got = run(engine)
    for length, ours, theirs in zip(LENGTHS, got, expected):
        assert ours == theirs, f"prompt of {length} tokens, {overrides}"


def test_logprobs_equal_transformers(starcoder):
    folder, _ = starcoder
    check_logprobs_equal_transformers(folder, PROMPTS[3])


def test_config_defaults_as_transformers_reads_them(starcoder):
    folder, _ = starcoder
    cfg = json.loads((folder / "config.json").read_text())
    silent = {k: v for k, v in cfg.items() if k != "tie_word_embeddings"}
    assert ModelConfig.from_hf_dict(silent).tie_word_embeddings
    assert ModelConfig.from_hf_dict({**cfg, "sliding_window": 64}).sliding_window == 64
    assert ModelConfig.from_hf_dict(cfg).attention_bias
