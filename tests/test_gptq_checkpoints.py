"""GPTQ checkpoints (quant_method "gptq", as AutoGPTQ, GPTQModel and AutoRound write them), and AutoRound's own format
of the same tensors (quant_method "auto-round"), load, dequantized as they are read, or on the CPU kernels kept as Q4_0
/ Q4_1 blocks (worker/scaled_weights.GptqSource).

The reference reader is AutoRound's torch QuantLinear for GPTQ's layout (auto_round_extension.torch:
`qlinear_torch_zp`, zero points stored less one, and `qlinear_torch`, stored as they are: `gptq_v2`), with
its scales in float32 so its dequantized weights are exact: it multiplies the identity, which gives the
transposed weight; each input's group (g_idx) picks its rows of qzeros and scales. The checkpoints are
random words (every bit, the 3-bit values that straddle words, the zero points and act order's g_idx
matter) or written by AutoRound itself (round to nearest, its own config.json). Greedy tokens and logprobs
equal transformers' on the reference's weights in float32."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.common.checkpoint_quantization import kept_in_blocks, scaled_weights
from pagedserve.common.model_config import ModelConfig
from test_scaled_checkpoints import awq_reference, check_equals_transformers, check_kept_blocks
from tiny_models import build_tiny_model, make_engine


def reference_weight(tensors: dict, module: str, bits: int, shape, fmt: str = "gptq") -> torch.Tensor:
    """[out, in] float32: what AutoRound's QuantLinear for this format reads from the module's tensors.
    (Its own g_idx path slices the scales by the input size, wrong where out != in: each input gets its
    group's rows of qzeros and scales instead, a QuantLinear of groups of one input.)"""
    if fmt == "gptq":
        from auto_round_extension.torch.qlinear_torch_zp import QuantLinear
    else:
        from auto_round_extension.torch.qlinear_torch import QuantLinear
    out, inputs = shape
    scales = tensors[module + ".scales"]
    group = tensors.get(module + ".g_idx", torch.arange(inputs) // (inputs // scales.shape[0])).long()
    layer = QuantLinear(bits, 1, inputs, out, bias=False)
    layer.qweight, layer.qzeros = tensors[module + ".qweight"], tensors[module + ".qzeros"][group]
    layer.scales = scales[group].float()
    with torch.no_grad():
        return layer(torch.eye(inputs)).T.contiguous()


def random_words(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-2 ** 31, 2 ** 31 - 1, (rows, cols), dtype=torch.int32, generator=gen)


def gptq_checkpoint(tmp_path, bits: int = 4, group: int = 32, act_order: bool = False, fmt: str = "gptq",
                    arch: str = "llama", symmetric: bool = False, dynamic: tuple[dict, object] = ({}, None),
                    shared_order: bool = False) -> tuple:
    """(a GPTQ checkpoint of random words, the reference's weights saved plain). act_order: each matrix's
    g_idx a random permutation of its groups' runs (shared_order: one for the matrices that read the same
    input, q/k/v and gate/up, as GPTQ's order comes from that input); symmetric: every zero point 8, as GPTQ's sym=True;
    dynamic: GPTQModel's overrides for the config, and what they mean: module -> (bits, group), or None
    where a module is left float."""
    plain = build_tiny_model(tmp_path / "plain", arch, seed=3)
    tensors = load_file(plain / "model.safetensors")
    gen = torch.Generator().manual_seed(bits * 10 + group)
    stored, reference, orders = {}, {}, {}
    default = (bits, group)
    for key, w in tensors.items():
        module, (out, inputs) = key.removesuffix(".weight"), w.shape if w.dim() == 2 else (0, 0)
        bits, group = (dynamic[1] or (lambda _: default))(module) or (0, 1)
        if not key.endswith("_proj.weight") or not bits or w.shape[1] % group:
            stored[key] = reference[key] = w
            continue
        groups = inputs // group if group > 0 else 1
        stored[module + ".qweight"] = random_words(inputs * bits // 32, out, gen)
        if symmetric:
            stored_zero = 8 - (1 if fmt == "gptq" else 0)
            word = sum(stored_zero << (bits * i) for i in range(32 // bits))
            stored[module + ".qzeros"] = torch.full((groups, out * bits // 32), word, dtype=torch.int64).to(
                torch.int32)
        else:
            stored[module + ".qzeros"] = random_words(groups, out * bits // 32, gen)
        stored[module + ".scales"] = (torch.rand(groups, out, generator=gen) * 0.01 + 0.005).half()
        in_order = torch.arange(inputs, dtype=torch.int32) // (group if group > 0 else inputs)
        reader = module.rsplit(".", 1)[0] + (".attention" if module.endswith(("q_proj", "k_proj", "v_proj")) else
                                             ".mlp" if module.endswith(("gate_proj", "up_proj")) else module)
        if act_order and not (shared_order and reader in orders):
            orders[reader] = torch.randperm(inputs, generator=gen)
        stored[module + ".g_idx"] = in_order[orders[reader]] if act_order else in_order
        reference[key] = reference_weight(stored, module, bits, w.shape, fmt)
    config = json.loads((plain / "config.json").read_text())
    qc = {"quant_method": "gptq", "bits": default[0], "group_size": default[1], "desc_act": act_order,
          "sym": symmetric, "checkpoint_format": fmt, **({"dynamic": dynamic[0]} if dynamic[0] else {})}
    folder, ref = tmp_path / "gptq", tmp_path / "gptq-dequantized"
    for path, state, cfg in ((folder, stored, {**config, "quantization_config": qc}), (ref, reference, config)):
        path.mkdir()
        (path / "config.json").write_text(json.dumps(cfg))
        save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors")
    return folder, ref


@pytest.mark.parametrize("bits, group, act_order, fmt, ranks", [
    (4, 32, False, "gptq", 2),  # two ranks: o_proj's and down_proj's columns, gate/up's rows
    (4, 32, True, "gptq", 2),  # act order: a rank's columns are no run of groups
    (3, 64, False, "gptq", 1),  # 3-bit values straddle words, in the weights and the zero points
    (8, -1, True, "gptq", 1),  # one group: a scale per output
    (2, 16, False, "gptq_v2", 1),  # zero points stored as they are
])
def test_gptq_checkpoints_equal_transformers_on_autoround_reading_them(tmp_path, bits, group, act_order, fmt, ranks):
    folder, ref = gptq_checkpoint(tmp_path, bits, group, act_order, fmt)
    scheme = scaled_weights(ModelConfig.from_folder(folder).hf)
    assert (scheme.layout, scheme.packed_bits, scheme.act_order) == ("gptq", bits, act_order)
    check_equals_transformers(folder, ref, ranks=ranks)


def test_gptqmodel_dynamic_overrides_give_a_module_its_own_bits_or_none(tmp_path):
    """GPTQModel's `dynamic`: a rule (a pattern re.match-ed against the module's name, "+:" optional) gives
    the modules it matches their own bits and group size, the first that matches deciding; "-:" leaves them
    float. Two ranks: a rank's rows and columns of an 8-bit and a 2-bit matrix."""
    dynamic = {r"-:.*layers\.1\.self_attn\.o_proj": {}, r"+:.*down_proj": {"bits": 8, "group_size": 64},
               r".*layers\.0\.mlp\.up_proj": {"bits": 2}, r".*layers\.0\.mlp\.(up|gate)_proj": {"bits": 3}}

    def meaning(module: str):
        if module == "model.layers.1.self_attn.o_proj":
            return None
        if module.endswith("down_proj"):
            return 8, 64
        return {"model.layers.0.mlp.up_proj": (2, 32), "model.layers.0.mlp.gate_proj": (3, 32)}.get(module, (4, 32))

    folder, ref = gptq_checkpoint(tmp_path, dynamic=(dynamic, meaning))
    stored = load_file(folder / "model.safetensors")
    assert "model.layers.1.self_attn.o_proj.weight" in stored
    assert stored["model.layers.0.mlp.up_proj.qweight"].shape[0] == 64 * 2 // 32
    check_equals_transformers(folder, ref, ranks=2)
    with make_engine(folder, quantization="auto") as kept:  # the 4-bit matrices as Q4_1 blocks, the others float
        assert "Q4_1" in kept.runner.weights_description


def test_a_mixture_of_experts_gptq_checkpoint(tmp_path):
    """Qwen3-MoE: every expert's matrices are GPTQ modules of their own. On the CPU kernels (act order) the
    attention's matrices stay blocks, the experts' (float parameters) are dequantized with their inputs back
    in order: the model predicts what the float load does."""
    import numpy as np

    from test_quantized_model import agreement, top1
    folder, ref = gptq_checkpoint(tmp_path, arch="qwen3_moe", act_order=True, shared_order=True)
    check_equals_transformers(folder, ref)
    prompts = [np.random.default_rng(2).integers(3, 256, 40).tolist()]
    with make_engine(folder) as plain:
        want = top1(plain, prompts)
    with make_engine(folder, quantization="auto") as kept:
        assert "Q4_1" in kept.runner.weights_description
        assert agreement(top1(kept, prompts), want) >= 0.9


def autoround(root, fmt: str, sym: bool = True, model_free: bool = False) -> tuple:
    """A tiny Llama quantized by AutoRound (4-bit, groups of 32, round to nearest: no calibration data) and
    saved in `fmt`, and the reference's weights saved plain: the config.json and tensors a checkpoint of
    that format from the hub has."""
    import transformers
    from auto_round import AutoRound
    from tokenizers import Tokenizer, models, pre_tokenizers

    plain = build_tiny_model(root / "plain", seed=3)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", eos_token="t1")
    tokenizer.save_pretrained(plain)  # AutoRound loads the model folder, and its tokenizer from it
    AutoRound(str(plain), tokenizer, bits=4, group_size=32, sym=sym, iters=0, disable_opt_rtn=True,
              disable_model_free=not model_free).quantize_and_save(str(root / "out"), format=fmt)
    folder = next((root / "out").glob("**/config.json")).parent
    packing = json.loads((folder / "config.json").read_text())["quantization_config"].get("packing_format", "")
    tensors, weights = load_file(folder / "model.safetensors"), load_file(plain / "model.safetensors")
    if packing == "auto_round:auto_awq":
        reference = awq_reference(tensors, weights, 32, not sym)
    else:
        offset = packing in ("", "auto_round:auto_gptq")
        reference = {key: reference_weight(tensors, key.removesuffix(".weight"), 4, w.shape,
                                           "gptq" if offset else "gptq_v2")
                     if key.removesuffix(".weight") + ".qweight" in tensors else w for key, w in weights.items()}
    ref = root / "reference"
    ref.mkdir()
    (ref / "config.json").write_text((plain / "config.json").read_text())
    save_file(reference, ref / "model.safetensors")
    return folder, ref


@pytest.fixture(scope="module")
def autoround_gptq(tmp_path_factory):
    return autoround(tmp_path_factory.mktemp("autoround"), "auto_gptq")


def test_a_gptq_checkpoint_autoround_wrote(autoround_gptq):
    folder, ref = autoround_gptq
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["sym"]) == ("gptq", 4, 32, True)
    check_equals_transformers(folder, ref)


@pytest.mark.parametrize("sym, model_free, packing", [
    (True, False, "auto_round:auto_gptq"), (False, True, "auto_round"), (False, False, "auto_round:auto_awq")])
def test_autorounds_own_format(tmp_path, sym, model_free, packing):
    """quant_method auto-round (Intel's checkpoints on the hub): GPTQ's tensors with the zero points stored
    less one (auto_gptq packing) or as they are (its model-free writer's), or AutoAWQ's tensors."""
    folder, ref = autoround(tmp_path, "auto_round", sym, model_free)
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["packing_format"]) == ("auto-round", packing)
    check_equals_transformers(folder, ref, ranks=2)


@pytest.mark.parametrize("extra, loads", [
    ({}, True), ({"lm_head": {"bits": 16, "data_type": "float"}}, True),
    ({"model.layers.0.mlp.down_proj": {"bits": 4, "group_size": 32}}, True),
    ({"model.layers.0.mlp.down_proj": {"bits": 8}}, False),  # mixed widths
    ({"model.layers.0.mlp.down_proj": {"bits": 4, "group_size": 128}}, False)])
def test_autoround_layers_of_another_width_are_refused(extra, loads):
    qc = {"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": 4, "group_size": 32,
          "sym": True, "data_type": "int", "extra_config": extra}
    assert (scaled_weights({"quantization_config": qc}) is not None) == loads
    for other in ({"data_type": "mx_fp"}, {"packing_format": "auto_round:llm_compressor"}, {"act_bits": 8}):
        assert scaled_weights({"quantization_config": {**qc, **other}}) is None


@pytest.mark.parametrize("kind, qtype", [("asymmetric", "Q4_1"), ("symmetric", "Q4_0"), ("autoround", "Q4_0")])
def test_4_bit_gptq_stays_4_bit_blocks_on_the_cpu_kernels(tmp_path, autoround_gptq, kind, qtype):
    """In order (no act order), 4-bit GPTQ weights are Q4_0 blocks when every zero point is 8 (symmetric),
    else Q4_1: they dequantize to the float load's weights, and the model predicts what it does."""
    folder = autoround_gptq[0] if kind == "autoround" else gptq_checkpoint(
        tmp_path, symmetric=kind == "symmetric")[0]
    check_kept_blocks(folder, qtype)


@pytest.mark.parametrize("shared", [True, False])
def test_act_order_stays_4_bit_blocks_of_its_groups(tmp_path, shared):
    """GPTQ's act order (desc_act): a matrix's inputs gathered by group are Q4_1 blocks, which dequantize to
    the float load's weight, and the layer gathers its input likewise (its kernels, decode rows and prefill
    rows, against the dense weight); the model predicts what the float load does. shared: q/k/v and gate/up
    in one order each (what GPTQ writes): every matrix kept; else those layers' parts disagree and stay float."""
    import numpy as np

    from pagedserve.worker.quantized import QuantizedWeight
    folder, _ = gptq_checkpoint(tmp_path, act_order=True, shared_order=shared)
    assert kept_in_blocks(scaled_weights(ModelConfig.from_folder(folder).hf))
    check_kept_blocks(folder, "Q4_1")
    layers = ModelConfig.from_folder(folder).num_hidden_layers
    with make_engine(folder, quantization="auto") as engine:
        kept = [m.quant for m in engine.runner.model.modules() if isinstance(getattr(m, "quant", None),
                                                                            QuantizedWeight)]
        assert len(kept) == (4 if shared else 2) * layers  # q/k/v, o, gate/up, down (or o and down)
        gen = torch.Generator().manual_seed(0)
        for quant in kept:
            order = quant.input_order
            assert order is not None and not torch.equal(order, torch.arange(quant.cols))
            dense = quant.dense(torch.float32)
            for rows in (1, 5, 40):  # a decode, a few, past DEQUANTIZE_ABOVE
                x = torch.randn(rows, quant.cols, generator=gen)
                want = x @ dense.T
                got = quant.linear(x)
                assert (got - want).abs().max() <= 0.02 * want.abs().max(), (rows, quant.cols)
    if shared:  # two ranks: o and down by inputs, no run of groups: dequantized; the rest by rows, kept
        rng = np.random.default_rng(1)
        prompts = [rng.integers(3, 256, 40).tolist() for _ in range(2)]
        from test_quantized_model import agreement, top1
        with make_engine(folder) as plain:
            want = top1(plain, prompts)
        with make_engine(folder, quantization="auto", tensor_parallel_size=2) as two:
            assert "10 Q4_1 matrices" in two.runner.weights_description
            assert agreement(top1(two, prompts), want) >= 0.9


def test_a_g_idx_that_names_no_group_is_an_error(tmp_path):
    folder, _ = gptq_checkpoint(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.g_idx"][5] = 7  # two groups of 32 inputs
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj.g_idx is not a group \(0..1\) for each of "
                                         "64 inputs"):
        make_engine(folder)
