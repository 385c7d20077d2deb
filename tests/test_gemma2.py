"""Gemma 2 on a tiny random model built here: greedy tokens equal transformers' Gemma2ForCausalLM
(eager attention, float32) plain, with chunked prefill, under preemption and on two tensor-parallel
ranks, and its logprobs to 1e-4; the soft-caps are small enough here to bend the scores and the
logits (a model without either is seen to differ). Local layers (a window of 8 tokens, shorter
than most prompts) attend through the windowed backend with the cap and form their own KV group."""

from __future__ import annotations

import json

import pytest

from pagedserve.common.model_config import ModelConfig
from pagedserve.common.sampling_params import SamplingParams
from test_gemma3 import GROUP_BLOCK_BYTES, LENGTHS, MAX_NEW, PROMPTS, run
from tiny_models import build_tiny_model, check_logprobs_equal_transformers, hf_greedy, make_engine


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp("gemma2"), "gemma2")
    return folder, hf_greedy(folder, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("overrides", [{}, {"max_num_batched_tokens": 16}, {"tensor_parallel_size": 2},
                                       {"kv_cache_memory": 24 * GROUP_BLOCK_BYTES, "max_num_batched_tokens": 16}])
def test_greedy_tokens_equal_transformers(gemma, overrides):
    folder, expected = gemma
    with make_engine(folder, **overrides) as engine:
        got = run(engine)
        if "kv_cache_memory" in overrides:  # 24 blocks for six requests: preempted on the way
            assert engine.stats()["num_preemptions"] > 0
    for length, ours, theirs in zip(LENGTHS, got, expected):
        assert ours == theirs, f"prompt of {length} tokens, {overrides}"


def test_layers_backends_and_kv_groups(gemma):
    folder, _ = gemma
    with make_engine(folder) as engine:
        backends = [layer.self_attn.backend for layer in engine.runner.model.layers]
        # the platform backend's variants (the compiled CPU kernels' here), one per kind of layer
        assert [(b.window, b.softcap) for b in backends] == [(8, 1.5), (0, 1.5)] * 2
        assert backends[0] is backends[2] and backends[1] is backends[3]
        assert engine.runner.config.kv_groups().layers == ((1, 3), (0, 2))
    # an older config.json without layer_types: every second layer from the first is local
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("layer_types")
    assert ModelConfig.from_hf_dict(cfg).kv_groups().layers == ((1, 3), (0, 2))


def test_logprobs_equal_transformers_and_the_caps_show(gemma, tmp_path):
    folder, _ = gemma
    prompt = PROMPTS[4]
    out = check_logprobs_equal_transformers(folder, prompt)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    # Without either cap (the same weights) the answer is another one: the caps are exercised.
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        other = tmp_path / cap
        other.mkdir()
        for f in folder.iterdir():
            (other / f.name).symlink_to(f)
        (other / "config.json").unlink()
        (other / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()), cap: None}))
        with make_engine(other) as engine:
            uncapped = engine.generate([prompt], params)[0][0]
        assert [s.logprob for s in uncapped.logprobs] != pytest.approx([s.logprob for s in out.logprobs], abs=1e-3)
