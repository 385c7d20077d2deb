"""A tiny random OLMo 2 written as a GGUF the way llama.cpp's converter writes one (tests/gguf_convert:
llama.cpp's olmo2 names, post_attention_norm and post_ffw_norm after the sublayers, full-width q/k
norms, q/k not permuted, an untied output). transformers' GGUF loader does not read olmo2, so the
reference is the HF model the file was written from: our config and weights equal it, and greedy
tokens through the prepared folder equal transformers' Olmo2ForCausalLM on it in float32, whole and
chunked; an olmo2 file with a sliding window (OLMo 3) is refused."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from gguf_checks import check_serves_like_transformers, check_weights_equal
from gguf_convert import convert_to_gguf
from pagedserve.model_files.gguf_loader import gguf_to_hf_config
from tiny_models import build_tiny_model

ROPE = {"rope_type": "default", "rope_theta": 500000.0}  # OLMo 2's base, away from the default


@pytest.fixture(scope="module")
def olmo(tmp_path_factory):
    root = tmp_path_factory.mktemp("olmo2-gguf")
    folder = build_tiny_model(root / "hf", "olmo2", rope_parameters=ROPE)
    convert_to_gguf(folder, root / "tiny.gguf", "olmo2")
    return folder, root / "tiny.gguf"


def test_config_and_weights_equal_the_hf_model(olmo):
    folder, path = olmo
    hf, cfg = json.loads((folder / "config.json").read_text()), gguf_to_hf_config(path)
    assert cfg["architectures"] == ["Olmo2ForCausalLM"] and cfg["model_type"] == "olmo2"
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
                 "attention_bias", "hidden_act"):
        assert cfg[name] == hf[name], name
    assert cfg["rope_parameters"] == ROPE
    expected = load_file(folder / "model.safetensors")
    check_weights_equal(path, expected)


def test_prepared_folder_serves_like_transformers(olmo, tmp_path):
    folder, path = olmo
    check_serves_like_transformers(folder, path, tmp_path)


def test_olmo3_sliding_window_is_refused(olmo, tmp_path):
    folder, _ = olmo
    convert_to_gguf(folder, tmp_path / "olmo3.gguf", "olmo2", sliding_window=8)
    with pytest.raises(ValueError, match="sliding window"):
        gguf_to_hf_config(tmp_path / "olmo3.gguf")
