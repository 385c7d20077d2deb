"""bitsandbytes checkpoints (the hub's "-bnb-4bit" models: transformers' serialization of Linear4bit and
Linear8bitLt) load, dequantized as they are read (worker/bitsandbytes_weights.py).

transformers with bitsandbytes writes the checkpoints (it quantizes a tiny Llama as it loads it, on the
CPU, and saves it), and bitsandbytes reads them as the reference: its QuantState from the saved tensors
and dequantize_4bit, or int8_vectorwise_dequant. Greedy tokens and logprobs equal transformers' on those
weights in float32, on one rank and two."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedserve.common.checkpoint_quantization import scaled_weights
from test_scaled_checkpoints import PARAMS, check_equals_transformers
from tiny_models import build_tiny_model, make_engine

KINDS = {
    "nf4-double": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "nf4-bfloat16-storage": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                 bnb_4bit_quant_storage=torch.bfloat16),
    "int8": dict(load_in_8bit=True),
}


def reference(tensors: dict) -> dict:
    """The checkpoint's weights as bitsandbytes dequantizes them, in float32, and its other tensors."""
    import bitsandbytes.functional as bnbf

    out = {}
    for key, value in tensors.items():
        module = key.removesuffix(".weight")
        state = {k: v for k, v in tensors.items() if k.startswith(key + ".")}
        if key.endswith(".weight") and state:
            qs = bnbf.QuantState.from_dict(state, device="cpu")
            out[key] = bnbf.dequantize_4bit(value, qs).to(torch.float32)
        elif key.endswith(".weight") and module + ".SCB" in tensors:
            out[key] = bnbf.int8_vectorwise_dequant(value, tensors[module + ".SCB"]).to(torch.float32)
        elif not key.startswith(tuple(k + "." for k in tensors if k.endswith(".weight"))) and not key.endswith(
                (".SCB", ".weight_format")):
            out[key] = value
    return out


def bnb_checkpoint(tmp_path, kind: str) -> tuple:
    """(transformers' bitsandbytes checkpoint of a tiny Llama, bitsandbytes' reading of it saved plain)."""
    plain = build_tiny_model(tmp_path / "plain", seed=3)
    config = transformers.BitsAndBytesConfig(**KINDS[kind], bnb_4bit_compute_dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(plain, quantization_config=config,
                                                              dtype=torch.float32, device_map="cpu")
    folder, ref = tmp_path / kind, tmp_path / f"{kind}-dequantized"
    model.save_pretrained(folder)
    weights = reference(load_file(folder / "model.safetensors"))
    assert weights.keys() == load_file(plain / "model.safetensors").keys()
    ref.mkdir()
    (ref / "config.json").write_text((plain / "config.json").read_text())
    save_file(weights, ref / "model.safetensors")
    return folder, ref


@pytest.mark.parametrize("kind, ranks", [("nf4-double", 2), ("fp4", 1), ("nf4-bfloat16-storage", 1), ("int8", 2)])
def test_bitsandbytes_checkpoints_equal_transformers_on_bitsandbytes_reading_them(tmp_path, kind, ranks):
    folder, ref = bnb_checkpoint(tmp_path, kind)
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "bitsandbytes"
    assert scaled_weights({"quantization_config": qc}).layout == "bitsandbytes"
    check_equals_transformers(folder, ref, ranks=ranks)


def test_the_cpu_default_dequantizes_them_too(tmp_path):
    """--quantization auto (serve's default on the CPU) keeps 4-bit blocks it can; NF4 codes are not ggml's."""
    folder, _ = bnb_checkpoint(tmp_path, "nf4-double")
    with make_engine(folder, quantization="auto") as auto, make_engine(folder) as plain:
        assert auto.runner.quantization == "none"
        assert auto.runner.weights_description.startswith("float, dequantized at load")
        prompt = [[5, 17, 99, 3, 42, 8]]
        assert auto.generate(prompt, PARAMS)[0][0].token_ids == plain.generate(prompt, PARAMS)[0][0].token_ids


def test_a_4_bit_weight_without_its_scales_is_named(tmp_path):
    folder, _ = bnb_checkpoint(tmp_path, "fp4")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.o_proj.weight.absmax"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.o_proj.weight is stored in 4 bits by "
                                         r"bitsandbytes with no model.layers.1.self_attn.o_proj.weight.absmax"):
        make_engine(folder)
