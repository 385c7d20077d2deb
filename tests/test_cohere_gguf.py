"""Tiny random Command-R (with and without per-head q/k norms) and Command R7B written as GGUFs the
way llama.cpp's converter writes them (tests/gguf_convert: llama.cpp's command-r and cohere2 names and
keys, logit_scale, the LayerNorm epsilon, cohere2's sliding window and rope dimension count, q/k rows
not permuted: llama.cpp's rotary for both takes interleaved pairs, as HF's). transformers' GGUF loader
does not read them, so the reference is the HF model each file was written from: our config and
weights equal it, and greedy tokens through the prepared folder equal transformers' in float32, whole
and chunked (Command R7B's three local layers of a window of 8 to one NoPE global layer, from
llama.cpp's fixed pattern); kept quantized (the CPU kernels' blocks), the reordered q/k rows agree
with the same file dequantized."""

from __future__ import annotations

import json

import gguf
import pytest
from safetensors.torch import load_file

from gguf_checks import check_q8_rows_agree_with_dequantized, check_serves_like_transformers, check_weights_equal
from gguf_convert import convert_to_gguf
from pagedserve.kernels import cpu_ops
from pagedserve.model_files.gguf_loader import gguf_to_hf_config
from tiny_models import build_tiny_model

NONE = gguf.RopeScalingType.NONE
# case: (tiny_models arch, its overrides, llama.cpp arch, what that converter class adds)
CASES = {
    "qk_norm": ("cohere", {}, "command-r", dict(logit_scale=0.5, rope_scaling_type=NONE)),
    "plain": ("cohere", {"use_qk_norm": False}, "command-r", dict(logit_scale=0.5, rope_scaling_type=NONE)),
    "cohere2": ("cohere2", {}, "cohere2", dict(logit_scale=0.5, sliding_window=8, vocab_size=256,
                                               rope_dimension_count=16, rope_scaling_type=NONE)),
}


@pytest.fixture(scope="module", params=list(CASES))
def cohere(request, tmp_path_factory):
    arch, overrides, gguf_arch, keys = CASES[request.param]
    root = tmp_path_factory.mktemp(f"cohere-gguf-{request.param}")
    folder = build_tiny_model(root / "hf", arch, **overrides)
    convert_to_gguf(folder, root / "tiny.gguf", gguf_arch, **keys)
    return folder, root / "tiny.gguf"


def test_config_and_weights_equal_the_hf_model(cohere):
    folder, path = cohere
    hf, cfg = json.loads((folder / "config.json").read_text()), gguf_to_hf_config(path)
    assert cfg["architectures"] == hf["architectures"] and cfg["model_type"] == hf["model_type"]
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "layer_norm_eps", "logit_scale", "max_position_embeddings",
                 "tie_word_embeddings", "attention_bias", "hidden_act", "rope_parameters"):
        assert cfg[name] == hf[name], name
    assert cfg["use_qk_norm"] == hf.get("use_qk_norm", False)
    if hf["model_type"] == "cohere2":
        assert cfg["layer_types"] == hf["layer_types"] and cfg["sliding_window"] == hf["sliding_window"] == 8
    expected = load_file(folder / "model.safetensors")
    check_weights_equal(path, expected)


def test_prepared_folder_serves_like_transformers(cohere, tmp_path):
    folder, path = cohere

    def inspect(engine):
        if "cohere2" in path.parent.name:
            assert engine.runner.config.kv_groups().windows == (0, 8, 8, 8)
            assert [layer.self_attn.use_rope for layer in engine.runner.model.layers] == [True] * 3 + [False]

    check_serves_like_transformers(folder, path, tmp_path, inspect)


@pytest.mark.skipif(cpu_ops.load() is None, reason="no C++ compiler for the CPU kernels here")
def test_quantized_rows_agree_with_dequantized(cohere, tmp_path):
    _, path = cohere
    check_q8_rows_agree_with_dequantized(path, tmp_path, ["attn_q", "attn_k", "attn_v", "attn_output",
                                                          "ffn_gate", "ffn_up", "ffn_down"])
