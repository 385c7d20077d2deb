"""Checkpoints quantized by a method we cannot load (AWQ's GEMV layout, GPTQ in Marlin's format, HQQ, AQLM,
...) are refused when config.json is read, before any weight is: without this they fail much later with
"unexpected weight 'model.layers.0.self_attn.q_proj.qweight'", which names neither cause nor cure.

Weights stored in 8 bits or fewer with scales load, dequantized to the serving dtype as they are read
(worker/scaled_weights.py): FP8 (`fp8`: per tensor, or DeepSeek-V3's and Qwen3's 128x128 blocks with
`weight_scale_inv`; `fbgemm_fp8`: per output channel) and compressed-tensors' symmetric weights: 8-bit float
or int (`float-quantized`, `naive-quantized`, `int-quantized`) and 2- to 8-bit int packed in int32 words
(`pack-quantized`: W4A16 and the like), per tensor, channel, group or block; AutoAWQ's 4-bit GEMM
checkpoints (`awq`, version `gemm`: `qweight`, `qzeros`, `scales`); and GPTQ's (`gptq`, as AutoGPTQ,
GPTQModel and AutoRound write it: 2- to 8-bit `qweight` packed along the inputs, `qzeros`, `scales`,
`g_idx`, act order too; `checkpoint_format` `gptq` or `gptq_v2`; and AutoRound's own `auto-round`
format of the same tensors); and bitsandbytes' (transformers' serialization: NF4 or FP4, double quantization too,
and LLM.int8). The activations' quantization
(dynamic or static `input_scale`) and an FP8 KV cache's scales are not applied: the layers compute in the
serving dtype, as transformers does on the dequantized weights. `scaled_weights` says how a checkpoint's
scales broadcast; `kept_in_blocks` whether its 4-bit weights are ggml's Q4_0 / Q4_1 blocks, which the CPU
kernels keep (--quantization auto) rather than dequantize.

Torch-free: ModelConfig.from_hf_dict runs it, so the worker, the engine and `serve`'s pre-flight
check all stop on it with the same message. What we also load quantized is GGUF (its own block
formats) and, for unquantized HF checkpoints, weight-only int8 on request (--quantization).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

SUPPORTED_QUANTIZATION = ("none (unquantized safetensors), scaled weights dequantized at load (fp8, fbgemm_fp8, "
                          "compressed-tensors symmetric 8-bit float or int and packed 2- to 8-bit int, AWQ 4-bit "
                          "GEMM, GPTQ and AutoRound 2- to 8-bit int, bitsandbytes NF4, FP4 and int8), GGUF files "
                          "(Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), int8 (--quantization int8 on an unquantized checkpoint)")
_COMPRESSED_8BIT_FORMATS = ("float-quantized", "naive-quantized", "int-quantized")
_PACKED_FORMAT = "pack-quantized"


@dataclass(frozen=True, slots=True)
class ScaledWeights:
    """How a checkpoint's 8-bit weights' scales broadcast: a scale of shape [ceil(out / block[0]),
    ceil(in / block[1])] covers blocks of that size; a one-element scale the whole matrix, one of
    [out] or [out, 1] each row, whatever `block` says."""
    method: str
    block: tuple[int, int] | None = None  # None: per tensor or per output channel (the scale's shape says)
    packed_bits: int = 0  # pack-quantized: the bits of each value in the int32 words (X.weight_packed)
    zero_points: bool = False  # asymmetric (packed only): X.weight_zero_point, laid out as the scale
    # "": compressed-tensors' names (X.weight_packed ...); "awq": AutoAWQ's GEMM layout, X.qweight [in, out / 8],
    # X.qzeros, X.scales [in / group, out]; "gptq": X.qweight [in * bits / 32, out], X.qzeros, X.scales, X.g_idx;
    # "bitsandbytes": transformers' serialization of its 4-bit (NF4, FP4) and 8-bit layers
    layout: str = ""
    zero_offset: int = 0  # GPTQ: added to a stored zero point (AutoGPTQ's format stores it less one)
    act_order: bool = False  # GPTQ's desc_act: each input's group is X.g_idx[input], not input // group
    # GPTQModel's `dynamic` overrides: (pattern, bits) in order, the first whose pattern matches a module's name
    # (re.match) giving its bits; modules it skips are stored plain
    module_bits: tuple[tuple[str, int], ...] = ()

    def bits_of(self, module: str) -> int:
        """The packed bits of a module's weight (`module`: its name without .qweight)."""
        return next((bits for pattern, bits in self.module_bits if re.match(pattern, module)), self.packed_bits)

# quant_method as HF writes it -> the name users know it by.
_KNOWN = {"awq": "AWQ", "gptq": "GPTQ", "fp8": "FP8", "fbgemm_fp8": "FP8 (fbgemm)", "bitsandbytes": "bitsandbytes",
          "compressed-tensors": "compressed-tensors", "aqlm": "AQLM", "hqq": "HQQ", "eetq": "EETQ",
          "exl2": "EXL2", "quanto": "Quanto", "torchao": "torchao", "mxfp4": "MXFP4", "bitnet": "BitNet",
          "gptq_marlin": "GPTQ (Marlin)", "awq_marlin": "AWQ (Marlin)", "marlin": "Marlin", "vptq": "VPTQ",
          "higgs": "HIGGS", "spqr": "SpQR", "fp_quant": "FP-Quant", "auto-round": "AutoRound"}


class UnsupportedQuantization(ValueError):
    """config.json names a quantization method pagedserve cannot load."""


def _weights_schemes(qc: dict) -> list[dict]:
    """compressed-tensors' weight schemes, one a config group."""
    groups = qc.get("config_groups") or {}
    return [g.get("weights") or {} for g in groups.values() if isinstance(g, dict)] if isinstance(groups, dict) else []


def _details(qc: dict) -> str:
    schemes = _weights_schemes(qc)
    first = schemes[0] if schemes else {}
    bits = (qc.get("bits") or qc.get("w_bit") or first.get("num_bits")
            or (4 if qc.get("load_in_4bit") else 8 if qc.get("load_in_8bit") else None))
    group = qc.get("group_size") or qc.get("q_group_size") or first.get("group_size")
    parts = [f"{bits}-bit"] if bits else []
    if group:
        parts.append(f"group size {group}")
    return f" ({', '.join(parts)})" if parts else ""


def quantization_method(hf_config: dict) -> str | None:
    """The quantization method config.json declares, or None for an unquantized checkpoint."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        return "unknown"
    method = qc.get("quant_method")
    if not method and (qc.get("load_in_4bit") or qc.get("load_in_8bit")):
        method = "bitsandbytes"  # configs written before quant_method existed
    return str(method or "unknown").lower()


def scaled_weights(hf_config: dict) -> ScaledWeights | None:
    """How to dequantize the checkpoint's 8-bit weights, or None when it has none we load (unquantized,
    or a method check_quantization refuses)."""
    method = quantization_method(hf_config)
    qc = hf_config.get("quantization_config")
    if method is None or not isinstance(qc, dict):
        return None
    if method in ("fp8", "fbgemm_fp8"):
        block = qc.get("weight_block_size")
        return ScaledWeights(method, _block(block)) if block is None or _block(block) else None
    if method == "awq":
        group = qc.get("group_size", 128)
        if qc.get("bits", 4) != 4 or str(qc.get("version", "gemm")).lower() != "gemm" or not (
                isinstance(group, int) and group > 0):
            return None
        return ScaledWeights(method, (1, group), 4, bool(qc.get("zero_point", True)), layout="awq")
    if method == "gptq":
        return _gptq(qc)
    if method == "bitsandbytes":
        four = qc.get("load_in_4bit") or qc.get("_load_in_4bit")
        if four and str(qc.get("bnb_4bit_quant_type", "fp4")).lower() not in ("nf4", "fp4"):
            return None
        return ScaledWeights(method, packed_bits=4 if four else 8, layout="bitsandbytes")
    if method in ("auto-round", "intel/auto-round"):
        return _auto_round(qc)
    packed = qc.get("format") == _PACKED_FORMAT
    if method != "compressed-tensors" or not (packed or qc.get("format") in _COMPRESSED_8BIT_FORMATS):
        return None
    schemes = _weights_schemes(qc)
    bits = {w.get("num_bits") for w in schemes}
    symmetric = {w.get("symmetric") is not False for w in schemes}
    if not schemes or len(bits) != 1 or len(symmetric) != 1 or any(
            w.get("type") not in (("int",) if packed else ("float", "int")) or w.get("dynamic") for w in schemes):
        return None
    blocks = {_scheme_block(w) for w in schemes}
    zero_points = not symmetric.pop()
    if len(blocks) != 1 or False in blocks or bits.pop() not in (range(2, 9) if packed else (8,)) or (
            zero_points and not packed):
        return None
    return ScaledWeights(method, blocks.pop(), schemes[0]["num_bits"] if packed else 0, zero_points)


def _gptq(qc: dict) -> ScaledWeights | None:
    """GPTQ: a zero point per output and group (AutoGPTQ's format stores it less one, `gptq_v2` as it
    is), a group of -1 being all the inputs; Marlin's repacked format is not this layout."""
    bits, group = qc.get("bits", 4), qc.get("group_size", 128)
    fmt = str(qc.get("checkpoint_format") or "gptq").lower()
    module_bits = _dynamic_bits(qc.get("dynamic") or {}, bits)
    if bits not in range(2, 9) or fmt not in ("gptq", "gptq_v2") or qc.get("is_marlin_format") or not (
            isinstance(group, int) and (group > 0 or group == -1)) or module_bits is None:
        return None
    return ScaledWeights("gptq", None if group == -1 else (1, group), bits, True, layout="gptq",
                         zero_offset=1 if fmt == "gptq" else 0, act_order=bool(qc.get("desc_act")),
                         module_bits=module_bits)


def _dynamic_bits(dynamic, bits: int) -> tuple[tuple[str, int], ...] | None:
    """GPTQModel's per-module overrides ({"+:pattern" or "pattern": {"bits": ...}, "-:pattern": {}} where
    "-:" skips a module) as (pattern, bits) for the modules it quantizes, or None when one is malformed.
    A group size or act order of its own needs no rule: the scales' and g_idx's shapes say."""
    if not isinstance(dynamic, dict):
        return None
    rules = []
    for key, override in dynamic.items():
        if not isinstance(key, str) or not isinstance(override, dict):
            return None
        if key.startswith("-:"):
            continue  # skipped modules are stored plain and read so
        own = override.get("bits", bits)
        try:
            re.compile(key.removeprefix("+:"))
        except re.error:
            return None
        if own not in range(2, 9):
            return None
        rules.append((key.removeprefix("+:"), own))
    return tuple(rules)


# AutoRound's packing formats -> GPTQ's layout with the zero points' offset (as its own loader reads them),
# or "awq": AutoAWQ's GEMM layout
_AUTO_ROUND_PACKINGS = {"auto_round:auto_gptq": 1, "auto_round:gptq": 1, "auto": 1, "auto_round": 0,
                        "auto_round:gptqmodel": 0, "auto_round:auto_awq": "awq", "auto_round:awq": "awq"}


def _auto_round(qc: dict) -> ScaledWeights | None:
    """AutoRound's own format (quant_method auto-round): GPTQ's tensors (or, packed as auto_awq, AutoAWQ's), integer
    weights of one width, the zero points' offset by packing_format. Layers it lists in extra_config must be that width
    too, or float (16 bits and over: stored plain); mixed widths and its float formats (MXFP4, NVFP4, FP8) are not this
    layout."""
    packing = str(qc.get("packing_format") or "auto_round:auto_gptq")
    default = (qc.get("bits", 4), qc.get("group_size", 128), qc.get("sym", True), qc.get("data_type", "int"))
    layers = [c for c in (qc.get("extra_config") or {}).values() if isinstance(c, dict)]

    def same_or_float(layer: dict) -> bool:
        own = tuple(layer.get(key, value) for key, value in zip(("bits", "group_size", "sym", "data_type"), default))
        return own == default or (isinstance(own[0], int) and own[0] >= 16)

    if (packing not in _AUTO_ROUND_PACKINGS or default[3] != "int" or (qc.get("act_bits") or 16) < 16
            or not all(map(same_or_float, layers))):
        return None
    bits, group = default[:2]
    if _AUTO_ROUND_PACKINGS[packing] == "awq":
        return ScaledWeights("auto-round", (1, group), 4, not default[2], layout="awq") if bits == 4 and (
            isinstance(group, int) and group > 0) else None
    scheme = _gptq({"bits": bits, "group_size": group, "desc_act": False,
                    "checkpoint_format": "gptq" if _AUTO_ROUND_PACKINGS[packing] else "gptq_v2"})
    return None if scheme is None else replace(scheme, method="auto-round")


def kept_in_blocks(scheme: ScaledWeights | None) -> bool:
    """Whether the CPU kernels can keep the checkpoint's weights as they are stored: 4-bit values with a
    scale (and zero point) per output row and group of a multiple of 32 inputs are Q4_0 (Q4_1) blocks (in
    GPTQ's act order, of the inputs gathered by group: worker/scaled_weights.GptqSource; not bitsandbytes'
    NF4 or FP4 codes)."""
    return scheme is not None and scheme.packed_bits == 4 and (
        scheme.layout != "bitsandbytes") and (
        scheme.block is None or (scheme.block[0] == 1 and scheme.block[1] % 32 == 0))


def _block(value) -> tuple[int, int] | None:
    if isinstance(value, str):  # compressed-tensors' older "128x128"
        value = value.lower().split("x")
    try:
        rows, cols = (int(v) for v in value)
    except (TypeError, ValueError):
        return None
    return (rows, cols) if rows > 0 and cols > 0 else None


def _scheme_block(weights: dict):
    """A compressed-tensors weight scheme's block (None: per tensor or channel), False when unknown."""
    strategy = weights.get("strategy")
    if strategy in ("tensor", "channel"):
        return None
    if strategy == "group" and isinstance(weights.get("group_size"), int) and weights["group_size"] > 0:
        return (1, weights["group_size"])
    if strategy == "block":
        return _block(weights.get("block_structure")) or False
    return False


def check_quantization(hf_config: dict, where: str = "the model") -> None:
    """Raise UnsupportedQuantization naming the method and what is supported, if config.json has a
    quantization_config that scaled_weights cannot load."""
    method = quantization_method(hf_config)
    if method is None or scaled_weights(hf_config) is not None:
        return
    name = _KNOWN.get(method, method)
    qc = hf_config["quantization_config"]
    raise UnsupportedQuantization(
        f"{where} is quantized with {name}{_details(qc) if isinstance(qc, dict) else ''} "
        f"(quantization_config in config.json), which pagedserve cannot load. Supported: {SUPPORTED_QUANTIZATION}. "
        "Use the unquantized (float16/bfloat16) checkpoint of this model, or a GGUF file of it.")


# vLLM's --quantization values that name a checkpoint's own method -> the quant_methods its config.json may declare
CHECKPOINT_METHODS = {"gptq": ("gptq",), "gptq_marlin": ("gptq",), "awq": ("awq",), "awq_marlin": ("awq",),
                      "fp8": ("fp8", "fbgemm_fp8"), "fbgemm_fp8": ("fbgemm_fp8",), "bitsandbytes": ("bitsandbytes",),
                      "compressed-tensors": ("compressed-tensors",), "auto-round": ("auto-round", "intel/auto-round"),
                      "inc": ("auto-round", "intel/auto-round")}


def quantization_flag(requested: str, hf_config: dict, where: str = "the model") -> str:
    """--quantization as the loader takes it (auto, none, int8). vLLM's names of a checkpoint's method (gptq,
    awq_marlin, fp8, bitsandbytes, ...) say what the checkpoint is, as in vLLM: they mean auto when it is
    that, and are refused, naming both, when it is not; vLLM quantizes an unquantized checkpoint on the fly
    for fp8 and bitsandbytes, which pagedserve does not (int8 is its own weight-only scheme)."""
    if requested not in CHECKPOINT_METHODS:
        return requested
    method = quantization_method(hf_config)
    if method in CHECKPOINT_METHODS[requested]:
        return "auto"
    if method is None:
        raise ValueError(f"--quantization {requested}: {where} has no quantization_config (an unquantized "
                         "checkpoint); pagedserve does not quantize one to this method as it loads. Use "
                         f"--quantization int8 (weight-only int8 on the CPU) or a {requested} checkpoint of it")
    raise ValueError(f"--quantization {requested}: {where} is quantized with {_KNOWN.get(method, method)} "
                     "(quantization_config in config.json); leave --quantization at auto to load it as it is")
