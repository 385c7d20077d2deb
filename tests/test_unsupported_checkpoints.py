"""Checkpoints we cannot load say so before any weight is read: a quantization_config (AWQ's GEMV layout,
GPTQ in Marlin's format, asymmetric unpacked compressed-tensors, HQQ) names the method and what is supported,
in
ModelConfig, the engine and `serve` (which exits non-zero before starting a service)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedserve.common.checkpoint_quantization import SUPPORTED_QUANTIZATION, UnsupportedQuantization
from pagedserve.common.model_config import ModelConfig

LLAMA = dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
CONFIGS = {
    "awq_gemv": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv", "zero_point": True},
            "AWQ (4-bit, group size 128)"),
    "gptq_marlin_format": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True,
                            "checkpoint_format": "marlin"}, "GPTQ (4-bit, group size 32)"),
    "compressed_int8_asymmetric": ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {
        "group_0": {"weights": {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "group",
                                "group_size": 128}}}}, "compressed-tensors (8-bit, group size 128)"),
    "bitsandbytes_other_4bit_type": ({"quant_method": "bitsandbytes", "load_in_4bit": True,
                                      "bnb_4bit_quant_type": "int4"}, "bitsandbytes (4-bit)"),
    "hqq": ({"quant_method": "hqq", "quant_config": {"weight_quant_params": {"nbits": 4}}}, "HQQ"),
}


def quantized_folder(folder, quantization_config):
    """config.json with the quantization_config, and a weight file that is not safetensors at all:
    the refusal must come before anything reads it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**LLAMA, "quantization_config": quantization_config}))
    (folder / "model.safetensors").write_bytes(b"not read")
    return folder


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_the_method_and_what_is_supported_are_named(tmp_path, kind):
    qc, named = CONFIGS[kind]
    folder = quantized_folder(tmp_path / kind, qc)
    with pytest.raises(UnsupportedQuantization) as err:
        ModelConfig.from_folder(folder)
    message = str(err.value)
    assert f"is quantized with {named} (quantization_config in config.json)" in message
    assert str(folder) in message and f"Supported: {SUPPORTED_QUANTIZATION}" in message
    assert "GGUF files (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)" in message and "int8" in message


def test_an_unknown_method_is_named_as_written(tmp_path):
    with pytest.raises(UnsupportedQuantization, match="quantized with mystery-q "):
        ModelConfig.from_folder(quantized_folder(tmp_path, {"quant_method": "mystery-q"}))


def test_an_unquantized_config_passes():
    from pagedserve.common.checkpoint_quantization import scaled_weights
    assert ModelConfig.from_hf_dict(dict(LLAMA)).architecture == "LlamaForCausalLM"
    assert ModelConfig.from_hf_dict({**LLAMA, "quantization_config": None}).architecture == "LlamaForCausalLM"
    assert scaled_weights(dict(LLAMA)) is None and scaled_weights({**LLAMA, "quantization_config": None}) is None


def test_the_engine_refuses_it(tmp_path):
    from tiny_models import make_engine
    with pytest.raises(ValueError, match="quantized with HQQ"):
        make_engine(quantized_folder(tmp_path, CONFIGS["hqq"][0]))


@pytest.mark.parametrize("kind", ["awq_gemv", "gptq_marlin_format"])
def test_serve_exits_non_zero_naming_it(tmp_path, kind):
    qc, named = CONFIGS[kind]
    folder = quantized_folder(tmp_path / kind, qc)
    env = {**os.environ, "PAGEDSERVE_DATA_DIR": str(tmp_path / "data")}
    proc = subprocess.run([sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(folder), "--port", "0"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert f"quantized with {named}" in proc.stderr and "Supported: none" in proc.stderr
    assert "started" not in proc.stderr  # no service was started


def test_phi3_su_rope_is_longrope():
    scaling = {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    cfg = ModelConfig.from_hf_dict({**LLAMA, "architectures": ["Phi3ForCausalLM"],
                                    "original_max_position_embeddings": 32, "rope_scaling": scaling})
    assert cfg.rope_scaling["rope_type"] == "longrope"
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'su' for LlamaForCausalLM"):
        ModelConfig.from_hf_dict({**LLAMA, "rope_scaling": {"type": "su", "short_factor": [1.0] * 8}})
