"""Checkpoints of 8-bit weights with scales (FP8 as DeepSeek-V3 and Qwen3 ship it, fbgemm's, and
compressed-tensors' 8-bit float or int) load, dequantized as they are read (worker/scaled_weights.py):
greedy tokens and logprobs equal transformers' on the dequantized weights in float32, per tensor, per
channel and per block (blocks that do not divide the matrix, and scales in another shard), on one rank
and two. 4-bit and asymmetric schemes are still refused, naming the method."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedserve.common.checkpoint_quantization import UnsupportedQuantization, scaled_weights
from pagedserve.common.model_config import ModelConfig
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.worker.scaled_weights import dequantize
from tiny_models import build_tiny_model, make_engine

FP8_MAX = 448.0


def compressed(kind: str, strategy: str, **extra) -> dict:
    fmt = "float-quantized" if kind == "float" else "naive-quantized"
    weights = {"num_bits": 8, "type": kind, "symmetric": True, "strategy": strategy, "dynamic": False, **extra}
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": {"num_bits": 8, "type": kind, "strategy": "token",
                                                                "dynamic": True, "symmetric": True}}}}


# name -> (quantization_config, how the test quantizes: kind, block or "tensor" / "channel", scale name)
SCHEMES = {
    "ct-fp8-tensor": (compressed("float", "tensor"), "float", "tensor", "weight_scale"),
    "ct-int8-channel": (compressed("int", "channel"), "int", "channel", "weight_scale"),
    "ct-fp8-block": (compressed("float", "block", block_structure=[32, 48]), "float", (32, 48), "weight_scale"),
    "fp8-block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 48]},
                  "float", (32, 48), "weight_scale_inv"),
    "fbgemm-fp8-channel": ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}, "float", "channel",
                           "weight_scale"),
}


def quantize(w: torch.Tensor, kind: str, block) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(8-bit values, scale, the scale broadcast to w's shape by hand) with w ~ values * that broadcast,
    per tensor, channel or block."""
    top = FP8_MAX if kind == "float" else 127.0
    rows, cols = w.shape
    if block == "tensor":
        scale = (w.abs().max() / top).reshape(1)
        full = scale.expand(rows, cols)
    elif block == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / top
        full = scale.expand(rows, cols)
    else:
        bh, bw = block
        scale = torch.zeros(-(-rows // bh), -(-cols // bw))
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                scale[i, j] = w[i * bh:(i + 1) * bh, j * bw:(j + 1) * bw].abs().max() / top
        full = scale.repeat_interleave(bh, 0)[:rows].repeat_interleave(bw, 1)[:, :cols]
    values = w / full
    values = values.to(torch.float8_e4m3fn) if kind == "float" else values.round().clamp(-127, 127).to(torch.int8)
    return values, scale, full


def scaled_pair(tmp_path, name: str, arch: str = "llama") -> tuple:
    """(the 8-bit checkpoint, the same weights dequantized as a plain float32 checkpoint)."""
    qc, kind, block, scale_name = SCHEMES[name]
    plain = build_tiny_model(tmp_path / "plain", arch, seed=3)
    tensors = load_file(plain / "model.safetensors")
    config = json.loads((plain / "config.json").read_text())
    stored, scales, reference = {}, {}, {}
    for key, w in tensors.items():
        if key.endswith("_proj.weight"):
            values, scale, full = quantize(w, kind, block)
            stored[key], scales[key.removesuffix("weight") + scale_name] = values, scale
            stored[key.removesuffix("weight") + "input_scale"] = torch.tensor([0.02])  # static, not applied
            reference[key] = values.to(torch.float32) * full
        else:
            stored[key] = reference[key] = w
    folder, ref = tmp_path / name, tmp_path / f"{name}-dequantized"
    folder.mkdir()
    ref.mkdir()
    (ref / "config.json").write_text(json.dumps(config))
    save_file(reference, ref / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    # the scales in a shard of their own (a sharded checkpoint may split a weight from its scale)
    save_file(stored, folder / "model-00001-of-00002.safetensors")
    save_file(scales, folder / "model-00002-of-00002.safetensors")
    return folder, ref


@pytest.mark.parametrize("name, arch", [(name, "llama") for name in SCHEMES] + [
    ("fp8-block", "deepseek_v3"), ("fp8-block", "qwen3_moe")])  # as DeepSeek-V3 and Qwen3's FP8 checkpoints are
def test_greedy_tokens_and_logprobs_equal_transformers_on_the_dequantized_weights(tmp_path, name, arch):
    folder, ref = scaled_pair(tmp_path, name, arch)
    assert scaled_weights(ModelConfig.from_folder(folder).hf) is not None
    prompt = [5, 17, 99, 3, 42, 8]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    with make_engine(folder) as engine:
        out = engine.generate([prompt], params)[0][0]
        assert "dequantized at load" in engine.runner.weights_description
    model = transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]
    ref_logprobs = torch.log_softmax(logits, dim=-1)
    assert out.token_ids == ref_logprobs.argmax(dim=-1).tolist()
    for step, sample in enumerate(out.logprobs):
        assert sample.logprob == pytest.approx(ref_logprobs[step, sample.token_id].item(), abs=1e-4)


def test_two_ranks_read_their_rows_and_columns_and_the_scales_that_cover_them(tmp_path):
    folder, _ = scaled_pair(tmp_path, "fp8-block")  # blocks of 32 x 48: a rank's columns start mid-block
    prompt = [7, 1, 64, 200, 13]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with make_engine(folder) as one:
        expected = one.generate([prompt], params)[0][0].token_ids
    with make_engine(folder, tensor_parallel_size=2) as two:
        assert two.generate([prompt], params)[0][0].token_ids == expected


def test_dequantize_reads_a_window_as_the_whole_matrix_would():
    torch.manual_seed(0)
    w = torch.randn(70, 100)
    for block in ("tensor", "channel", (32, 48), (1, 16)):
        values, scale, full = quantize(w, "float", block)
        b = None if isinstance(block, str) else block
        whole = dequantize(values, scale, b, (70, 100), [(0, 70), (0, 100)])
        assert torch.equal(whole, values.to(torch.float32) * full)
        assert torch.equal(dequantize(values[33:61], scale, b, (70, 100), [(33, 61), (0, 100)]), whole[33:61])
        assert torch.equal(dequantize(values[:, 47:90], scale, b, (70, 100), [(0, 70), (47, 90)]), whole[:, 47:90])
    with pytest.raises(ValueError, match=r"a scale of shape \(3, 2\) for a weight of shape \(70, 100\)"):
        dequantize(values, torch.ones(3, 2), (32, 48), (70, 100), [(0, 70), (0, 100)])


@pytest.mark.parametrize("qc, named", [
    (compressed("int", "group", group_size=128) | {"format": "pack-quantized"}, "compressed-tensors"),
    ({**compressed("int", "channel"), "config_groups": {"group_0": {"weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}}},
     "compressed-tensors (4-bit, group size 128)"),
    ({**compressed("int", "channel"), "config_groups": {"group_0": {"weights": {
        "num_bits": 8, "type": "int", "symmetric": False, "strategy": "channel"}}}}, "compressed-tensors (8-bit)"),
    ({"quant_method": "fp8", "weight_block_size": "big"}, "FP8"),
])
def test_what_cannot_be_dequantized_this_way_is_still_refused(qc, named):
    llama = dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(UnsupportedQuantization, match=f"is quantized with {re.escape(named)} "):
        ModelConfig.from_hf_dict({**llama, "quantization_config": qc})


def test_an_8_bit_weight_without_its_scale_is_named(tmp_path):
    folder, _ = scaled_pair(tmp_path, "fp8-block")
    (folder / "model-00002-of-00002.safetensors").unlink()  # the scales' shard is missing
    with pytest.raises(ValueError, match=r"model.layers.0.\S+_proj.weight is stored in 8 bits \(F8_E4M3\) with no "
                                         r"scale beside it"):
        make_engine(folder)
