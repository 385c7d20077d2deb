"""A tiny random StarCoder2 written as a GGUF the way llama.cpp's converter writes one (tests/gguf_convert:
llama.cpp's starcoder2 names, LayerNorm weights and biases, biases on every projection and on ffn_up
and ffn_down, the LayerNorm epsilon key, no sliding window), tied and untied: our config and weights
equal transformers' GGUF loader's (rope_theta excepted: its starcoder2 mapping reads no rope.freq_base,
so it is checked against the HF model the file was written from), greedy tokens through the prepared
folder equal transformers' Starcoder2ForCausalLM on that HF model in float32, whole and chunked, and
kept quantized the weights agree with the same file dequantized."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from gguf_checks import check_q8_rows_agree_with_dequantized, check_serves_like_transformers, check_weights_equal
from gguf_convert import convert_to_gguf
from pagedserve.kernels import cpu_ops
from pagedserve.model_files.gguf_loader import gguf_to_hf_config
from tiny_models import build_tiny_model

ROPE = {"rope_type": "default", "rope_theta": 100000.0}  # StarCoder2-15B's base, away from the default
CASES = {"tied": {}, "untied": {"tie_word_embeddings": False}}


@pytest.fixture(scope="module", params=list(CASES))
def starcoder(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"starcoder2-gguf-{request.param}")
    folder = build_tiny_model(root / "hf", "starcoder2", rope_parameters=ROPE, **CASES[request.param])
    convert_to_gguf(folder, root / "tiny.gguf", "starcoder2")
    return folder, root / "tiny.gguf"


def test_config_and_weights_equal_transformers(starcoder):
    folder, path = starcoder
    reference = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
    cfg, ref = gguf_to_hf_config(path), reference.config
    assert cfg["architectures"] == ["Starcoder2ForCausalLM"]
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "use_bias", "hidden_act",
                 "sliding_window"):
        assert cfg[name] == getattr(ref, name), name
    # the file's float32 epsilon: ours reads as the intended 1e-05, transformers' as float32's nearest
    assert np.float32(cfg["norm_epsilon"]) == np.float32(ref.norm_epsilon)
    assert cfg["rope_parameters"] == json.loads((folder / "config.json").read_text())["rope_parameters"] == ROPE
    tied = cfg["tie_word_embeddings"]
    expected = {k: v for k, v in reference.state_dict().items() if not (tied and k == "lm_head.weight")}
    check_weights_equal(path, expected)


def test_prepared_folder_serves_like_transformers(starcoder, tmp_path):
    folder, path = starcoder
    check_serves_like_transformers(folder, path, tmp_path)


@pytest.mark.skipif(cpu_ops.load() is None, reason="no C++ compiler for the CPU kernels here")
def test_quantized_weights_agree_with_dequantized(starcoder, tmp_path):
    _, path = starcoder
    check_q8_rows_agree_with_dequantized(path, tmp_path, ["attn_q", "attn_k", "attn_v", "attn_output",
                                                          "ffn_up", "ffn_down"])
