"""Checkpoints of weights stored in 8 bits or fewer with scales (FP8 as DeepSeek-V3 and Qwen3 ship it,
fbgemm's, compressed-tensors' 8-bit float or int and packed int such as W4A16) load, dequantized as they are
read (worker/scaled_weights.py): greedy tokens and logprobs equal transformers' in float32, on the
dequantized weights (checkpoints written here: blocks that do not divide the matrix, scales in another
shard) or reading the checkpoint itself (written by compressed-tensors), on one rank and two. Asymmetric
and unpacked 4-bit schemes are still refused, naming the method."""

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


PROMPT = [5, 17, 99, 3, 42, 8]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)


def check_equals_transformers(folder, reference, ranks: int = 1, quantization: str = "none",
                              description: str = "dequantized at load") -> None:
    """The engine on `folder` (with `quantization`, its weights described so): greedy tokens and logprobs
    equal transformers' on `reference` in float32, and with ranks=2 two ranks give the same tokens."""
    with make_engine(folder, quantization=quantization) as engine:
        out = engine.generate([PROMPT], PARAMS)[0][0]
        assert description in engine.runner.weights_description
    model = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + out.token_ids])).logits[0, len(PROMPT) - 1:-1]
    ref_logprobs = torch.log_softmax(logits, dim=-1)
    assert out.token_ids == ref_logprobs.argmax(dim=-1).tolist()
    for step, sample in enumerate(out.logprobs):
        assert sample.logprob == pytest.approx(ref_logprobs[step, sample.token_id].item(), abs=1e-4)
    if ranks == 2:
        with make_engine(folder, tensor_parallel_size=2, quantization=quantization) as two:
            assert two.generate([PROMPT], PARAMS)[0][0].token_ids == out.token_ids


@pytest.mark.parametrize("name, arch", [(name, "llama") for name in SCHEMES] + [
    ("fp8-block", "deepseek_v3"), ("fp8-block", "qwen3_moe")])  # as DeepSeek-V3 and Qwen3's FP8 checkpoints are
def test_greedy_tokens_and_logprobs_equal_transformers_on_the_dequantized_weights(tmp_path, name, arch):
    folder, ref = scaled_pair(tmp_path, name, arch)
    assert scaled_weights(ModelConfig.from_folder(folder).hf) is not None
    check_equals_transformers(folder, ref)


# compressed-tensors' own writer, and transformers (with compressed-tensors) as the reader: weight-only schemes,
# so the reference computes in float32 on the dequantized weights as the engine does.
CT_SCHEMES = {
    "w4a16-group32": (dict(num_bits=4, type="int", strategy="group", group_size=32), "pack-quantized"),
    "w4a16-asymmetric": (dict(num_bits=4, type="int", strategy="group", group_size=32, symmetric=False),
                         "pack-quantized"),
    "w3-channel": (dict(num_bits=3, type="int", strategy="channel"), "pack-quantized"),  # values straddle words
    "w8a16-channel": (dict(num_bits=8, type="int", strategy="channel"), "int-quantized"),
    "fp8-channel": (dict(num_bits=8, type="float", strategy="channel"), "float-quantized"),
    "fp8-block32": (dict(num_bits=8, type="float", strategy="block", block_structure=[32, 32]), "float-quantized"),
}


def ct_checkpoint(tmp_path, name: str) -> tuple:
    """A tiny Llama quantized and saved by compressed-tensors (min-max scales, as llm-compressor's observer),
    and the reference to read it: the checkpoint itself (transformers decompresses it as it loads), or where
    transformers cannot load it (asymmetric: it mis-sizes the packed zero points) the weights compressed-tensors
    decompresses from the same tensors, saved plain."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args, fmt = CT_SCHEMES[name]
    weights = QuantizationArgs(**{"symmetric": True, **args})
    model = transformers.AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "plain", seed=3),
                                                              dtype=torch.float32)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            scale, zero = calculate_qparams(*min_max(module.weight.data, weights), weights)
            module.weight_scale.data = scale.reshape(module.weight_scale.shape).to(module.weight_scale.dtype)
            if not weights.symmetric:
                module.weight_zero_point.data = zero.reshape(module.weight_zero_point.shape).to(
                    module.weight_zero_point.dtype)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(tmp_path / name)
    compressor.update_config(tmp_path / name)
    if weights.symmetric:
        return tmp_path / name, tmp_path / name
    compressor.decompress_model(model)
    plain = load_file(tmp_path / "plain" / "model.safetensors")
    decompressed = {key: value for key, value in model.state_dict().items() if key in plain}
    assert decompressed.keys() == plain.keys()
    reference = tmp_path / f"{name}-decompressed"
    reference.mkdir()
    (reference / "config.json").write_text((tmp_path / "plain" / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in decompressed.items()}, reference / "model.safetensors")
    return tmp_path / name, reference


def min_max(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    if args.strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if args.strategy == "group":
        groups = w.reshape(w.shape[0], -1, args.group_size)
        return groups.amin(-1), groups.amax(-1)
    bh, bw = args.block_structure
    blocks = w.reshape(w.shape[0] // bh, bh, w.shape[1] // bw, bw)
    return blocks.amin((1, 3)), blocks.amax((1, 3))


@pytest.mark.parametrize("name", list(CT_SCHEMES))
def test_compressed_tensors_checkpoints_equal_transformers_reading_them(tmp_path, name):
    folder, reference = ct_checkpoint(tmp_path, name)
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["format"] == CT_SCHEMES[name][1]
    # two ranks for W4A16: o_proj's and down_proj's columns come from whole packed rows
    check_equals_transformers(folder, reference, ranks=2 if name.startswith("w4a16") else 1)


def test_unpack_reads_compressed_tensors_packing():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from pagedserve.worker.scaled_weights import unpack
    torch.manual_seed(0)
    for bits in range(2, 9):
        for cols in (16, 37, 100):
            values = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (5, cols), dtype=torch.int8)
            assert torch.equal(unpack(pack_to_int32(values, bits), bits, cols), values), (bits, cols)


def test_two_ranks_read_their_rows_and_columns_and_the_scales_that_cover_them(tmp_path):
    folder, ref = scaled_pair(tmp_path, "fp8-block")  # blocks of 32 x 48: a rank's columns start mid-block
    check_equals_transformers(folder, ref, ranks=2)


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
    (compressed("float", "tensor") | {"format": "nvfp4-pack-quantized"}, "compressed-tensors (8-bit)"),
    ({**compressed("int", "channel"), "config_groups": {"group_0": {"weights": {
        "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 128}}}},
     "compressed-tensors (4-bit, group size 128)"),
    ({**compressed("int", "channel"), "config_groups": {"group_0": {"weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}}},
     "compressed-tensors (4-bit, group size 128)"),  # 4 bits, but not packed
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


def awq_reference(awq: dict, plain: dict, group: int, zero_point: bool) -> dict:
    """The plain checkpoint's tensors, each weight stored in `awq` (qweight, qzeros, scales) as
    compressed-tensors' AutoAWQConverter and dequantize read it, in float32."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize

    converted = AutoAWQConverter(bits=4, group_size=group, zero_point=zero_point).process(dict(awq))
    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=group, symmetric=not zero_point)
    reference = {}
    for key, w in plain.items():
        module = key.removesuffix(".weight")
        if module + ".qweight" not in awq:
            reference[key] = w
            continue
        q = unpack_from_int32(converted[module + ".weight_packed"], 4, w.shape)
        groups = torch.Size([w.shape[0], w.shape[1] // group])
        zero = (unpack_from_int32(converted[module + ".weight_zero_point"], 4, groups, packed_dim=0)
                if zero_point else None)
        scale = converted[module + ".weight_scale"].float()
        reference[key] = ct_dequantize(q, scale, zero, args, dtype=torch.float32)
    return reference


def awq_checkpoint(tmp_path, zero_point: bool, arch: str = "llama") -> tuple:
    """AutoAWQ's GEMM layout (random words, so every nibble and order matters), and its reference: the weights
    compressed-tensors' AutoAWQConverter and dequantize read from it, saved plain."""
    group = 32
    plain = build_tiny_model(tmp_path / "plain", arch, seed=3)
    tensors = load_file(plain / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    awq = {}
    quantized = [key for key, w in tensors.items() if key.endswith("_proj.weight") and w.shape[1] % group == 0]
    for key, w in tensors.items():
        if key not in quantized:
            awq[key] = w
            continue
        module, (rows, cols) = key.removesuffix(".weight"), w.shape
        awq[module + ".qweight"] = torch.randint(-2 ** 31, 2 ** 31 - 1, (cols, rows // 8), dtype=torch.int32,
                                                 generator=gen)
        if zero_point:
            awq[module + ".qzeros"] = torch.randint(-2 ** 31, 2 ** 31 - 1, (cols // group, rows // 8),
                                                    dtype=torch.int32, generator=gen)
        awq[module + ".scales"] = (torch.rand(cols // group, rows, generator=gen) * 0.01 + 0.005).half()
    reference = awq_reference(awq, tensors, group, zero_point)
    config = json.loads((plain / "config.json").read_text())
    folder, ref = tmp_path / "awq", tmp_path / "awq-dequantized"
    for path, state, cfg in ((folder, awq, {**config, "quantization_config": {
            "quant_method": "awq", "bits": 4, "group_size": group, "zero_point": zero_point, "version": "gemm"}}),
                             (ref, reference, config)):
        path.mkdir()
        (path / "config.json").write_text(json.dumps(cfg))
        save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors")
    return folder, ref


@pytest.mark.parametrize("zero_point", [True, False])
def test_autoawq_checkpoints_equal_compressed_tensors_reading_them(tmp_path, zero_point):
    folder, ref = awq_checkpoint(tmp_path, zero_point)
    check_equals_transformers(folder, ref, ranks=2)


@pytest.mark.parametrize("kind, qtype", [("w4a16-group32", "Q4_0"), ("w4a16-asymmetric", "Q4_1"), ("awq", "Q4_1"),
                                         ("awq-symmetric", "Q4_0"), ("awq-qwen3_moe", "Q4_1")])
def test_4_bit_weights_stay_4_bit_blocks_on_the_cpu_kernels(tmp_path, kind, qtype):
    """By default (--quantization auto) on the CPU, 4-bit weights with a scale per 32 inputs or more are
    ggml's Q4_0 / Q4_1 blocks (no zero points / zero points) for the kernels: they dequantize to the float
    load's weights, and the model predicts what the float load does. (A MoE's experts take float weights:
    their blocks are dequantized into them.)"""
    if kind.startswith("awq"):
        folder, _ = awq_checkpoint(tmp_path, zero_point=kind != "awq-symmetric",
                                   arch="qwen3_moe" if kind.endswith("moe") else "llama")
    else:
        folder, _ = ct_checkpoint(tmp_path, kind)
    check_kept_blocks(folder, qtype)


def check_kept_blocks(folder, qtype: str) -> None:
    """A 4-bit checkpoint's down_proj read as `qtype` blocks dequantizes to the float load's weight, and
    the engine on the blocks (--quantization auto) predicts what the float load does."""
    from pagedserve.kernels import cpu_ops
    from pagedserve.worker.weights import iter_lazy_weights
    from test_quantized_model import agreement, top1

    import numpy as np
    name = "model.layers.0.mlp.down_proj.weight"
    blocks, weight = (next(w.full() for n, w in iter_lazy_weights(folder, torch.float32, False, keep) if n == name)
                      for keep in (True, False))
    assert blocks.qtype.name == qtype
    # (ggml's d and m are float16: these float32 scales round; a bfloat16 checkpoint's are float16 exactly)
    assert torch.allclose(blocks.dequantize(cpu_ops.load(), torch.float32), weight, atol=1e-3, rtol=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, 40).tolist() for _ in range(3)]
    with make_engine(folder, quantization="auto") as quant, make_engine(folder) as plain:
        assert quant.runner.quantization == "gguf" and qtype in quant.runner.weights_description
        assert "kept from the checkpoint's" in quant.runner.weights_description
        assert agreement(top1(quant, prompts), top1(plain, prompts)) >= 0.9
