"""Cohere's Command-R (CohereForCausalLM) and Command R7B (Cohere2ForCausalLM) on tiny random models
built here (norms varied, per-head q/k norms on and off, a logit scale; Cohere2 with three local
layers of a window of 8 tokens to one NoPE global layer): greedy tokens equal transformers' in
float32, plain, chunked and on two tensor-parallel ranks (each rank holds its heads' q/k norm rows),
and logprobs to 1e-4 (the logit scale and the interleaved rotary show there)."""

from __future__ import annotations

import pytest

from test_qwen3_phi3 import LENGTHS, MAX_NEW, PROMPTS, run
from tiny_models import build_tiny_model, check_logprobs_equal_transformers, hf_greedy, make_engine

CASES = {"qk_norm": ("cohere", {}), "plain": ("cohere", {"use_qk_norm": False}), "cohere2": ("cohere2", {})}


@pytest.fixture(scope="module", params=list(CASES))
def cohere(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    folder = build_tiny_model(tmp_path_factory.mktemp(f"cohere-{request.param}"), arch, **overrides)
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


def test_cohere2_local_layers_window_and_take_rotary(tmp_path):
    folder = build_tiny_model(tmp_path / "r7b", "cohere2")
    with make_engine(folder) as engine:
        layers = engine.runner.model.layers
        assert [layer.self_attn.backend.window for layer in layers] == [8] * 3 + [0]
        assert [layer.self_attn.use_rope for layer in layers] == [True] * 3 + [False]
        assert engine.runner.config.kv_groups().windows == (0, 8, 8, 8)
        windowed = run(engine)
    # the same weights with a window wider than every prompt answer otherwise: the window is applied
    wide = build_tiny_model(tmp_path / "wide", "cohere2", sliding_window=512)
    assert hf_greedy(wide, PROMPTS, MAX_NEW) != windowed
    assert max(LENGTHS) + MAX_NEW > 8
