"""Qwen3 (dense, MoE) and Phi-3 on tiny random models built here: greedy tokens equal transformers'
in float32, plain, with chunked prefill and on two tensor-parallel ranks; Phi-3's fused qkv /
gate_up checkpoint tensors, LongRoPE and partial rotary."""

from __future__ import annotations

import pytest
import torch

from pagedserve.common.sampling_params import SamplingParams
from tiny_models import build_tiny_model, hf_greedy, make_engine

MAX_NEW = 16
LENGTHS = [3, 9, 17, 28, 44, 60]


def make_prompts(lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


PROMPTS = make_prompts()
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def run(engine, prompts=PROMPTS):
    return [samples[0].token_ids for samples in engine.generate(prompts, GREEDY)]


# LongRoPE with a short original context (32), so that prompts fall on either side of it; the
# factors are arbitrary but distinct, as in Phi-3's own config.json.
LONGROPE = dict(original_max_position_embeddings=32,
                rope_scaling=dict(rope_type="longrope", short_factor=[1.0, 1.2, 1.5, 2.0],
                                  long_factor=[1.0, 3.0, 6.0, 12.0]),
                partial_rotary_factor=0.5)
CASES = {"qwen3": ("qwen3", {}), "qwen3_tied": ("qwen3", dict(tie_word_embeddings=True)),
         "qwen3_moe": ("qwen3_moe", {}), "phi3": ("phi3", {}), "phi3_longrope_partial": ("phi3", LONGROPE)}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    folder = build_tiny_model(tmp_path_factory.mktemp(request.param), arch, **overrides)
    return request.param, folder, hf_greedy(folder, PROMPTS, MAX_NEW)


def crosses_original_context(name: str, length: int) -> bool:
    """A LongRoPE sequence that starts within the original context and decodes past it: at the
    crossing transformers recomputes its whole cache with the long factors, we keep the cache
    (module docstring of pagedserve.worker.models.phi3)."""
    return name.startswith("phi3_longrope") and length <= 32 < length + MAX_NEW - 1


def test_batch_matches_transformers(case):
    name, folder, expected = case
    got = run(make_engine(folder))
    for length, ours, theirs in zip(LENGTHS, got, expected):
        if not crosses_original_context(name, length):
            assert ours == theirs, f"prompt of {length} tokens"


def test_chunked_prefill_matches(case):
    name, folder, expected = case
    got = run(make_engine(folder, max_num_batched_tokens=16))
    for length, ours, theirs in zip(LENGTHS, got, expected):
        # Chunks of a LongRoPE prompt longer than the original context before its boundary get the
        # short factors (transformers prefills it in one pass, all long).
        if not crosses_original_context(name, length) and not (name.startswith("phi3_longrope") and length > 32):
            assert ours == theirs, f"prompt of {length} tokens"


def test_two_ranks_match_transformers(case):
    name, folder, expected = case
    if name == "qwen3_tied":
        pytest.skip("the tied head is the Llama skeleton's, tested on two ranks there")
    with make_engine(folder) as engine:
        one_rank_bytes = engine.runner.weight_bytes()
    with make_engine(folder, tensor_parallel_size=2) as engine:
        got = run(engine)
        assert 0.45 < engine.runner.weight_bytes() / one_rank_bytes < 0.6
    for length, ours, theirs in zip(LENGTHS, got, expected):
        if not crosses_original_context(name, length):
            assert ours == theirs, f"prompt of {length} tokens"


def test_layers_are_what_the_config_says(case):
    from pagedserve.worker.models.llama import LlamaMLP
    from pagedserve.worker.models.phi3 import PackedColumnParallelLinear
    from pagedserve.worker.models.qwen3 import Qwen3Attention, Qwen3MoeSparseMoE
    name, folder, _ = case
    model = make_engine(folder).runner.model
    if name.startswith("qwen3"):
        assert all(isinstance(layer.self_attn, Qwen3Attention) for layer in model.layers)
    if name == "qwen3_moe":
        assert [type(layer.mlp) for layer in model.layers] == [LlamaMLP, Qwen3MoeSparseMoE]
    if name.startswith("phi3"):
        assert all(isinstance(layer.self_attn.qkv_proj, PackedColumnParallelLinear)
                   and isinstance(layer.mlp.gate_up_proj, PackedColumnParallelLinear) for layer in model.layers)
    if name == "phi3_longrope_partial":
        assert model.rotary_dim == 8 and model.cos_table.shape[1] == 8


def test_longrope_picks_the_set_per_sequence(tmp_path):
    """A batch of a short and a long sequence: each gets its own factor set (transformers runs
    them one at a time)."""
    scaling = dict(rope_type="su", original_max_position_embeddings=32,  # "su": LongRoPE's first name
                   short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
                   long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0])
    folder = build_tiny_model(tmp_path, "phi3", rope_scaling=scaling)
    prompts = make_prompts([5, 12, 40, 50], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = [s[0].token_ids for s in make_engine(folder).generate(prompts, params)]
    assert got == hf_greedy(folder, prompts, 8)


def test_a_truncated_fused_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file
    folder = build_tiny_model(tmp_path, "phi3")
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16].contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"weight '{name}': a fused tensor of 112 rows, expected 64 \+ 32 \+ 32"):
        make_engine(folder)
