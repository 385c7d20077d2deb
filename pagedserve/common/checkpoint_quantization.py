"""Checkpoints quantized by a method we cannot load (AWQ, GPTQ, FP8, bitsandbytes, ...) are refused
when config.json is read, before any weight is: without this they fail much later with
"unexpected weight 'model.layers.0.self_attn.q_proj.qweight'", which names neither cause nor cure.

Torch-free: ModelConfig.from_hf_dict runs it, so the worker, the engine and `serve`'s pre-flight
check all stop on it with the same message. What we do load quantized is GGUF (its own block
formats) and, for unquantized HF checkpoints, weight-only int8 on request (--quantization).
"""

from __future__ import annotations

SUPPORTED_QUANTIZATION = ("none (unquantized safetensors), GGUF files (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), "
                          "int8 (--quantization int8 on an unquantized checkpoint)")

# quant_method as HF writes it -> the name users know it by.
_KNOWN = {"awq": "AWQ", "gptq": "GPTQ", "fp8": "FP8", "fbgemm_fp8": "FP8 (fbgemm)", "bitsandbytes": "bitsandbytes",
          "compressed-tensors": "compressed-tensors", "aqlm": "AQLM", "hqq": "HQQ", "eetq": "EETQ",
          "exl2": "EXL2", "quanto": "Quanto", "torchao": "torchao", "mxfp4": "MXFP4", "bitnet": "BitNet",
          "gptq_marlin": "GPTQ (Marlin)", "awq_marlin": "AWQ (Marlin)", "marlin": "Marlin", "vptq": "VPTQ",
          "higgs": "HIGGS", "spqr": "SpQR", "fp_quant": "FP-Quant", "auto-round": "AutoRound"}


class UnsupportedQuantization(ValueError):
    """config.json names a quantization method pagedserve cannot load."""


def _details(qc: dict) -> str:
    bits = qc.get("bits") or qc.get("w_bit") or (4 if qc.get("load_in_4bit") else 8 if qc.get("load_in_8bit") else None)
    group = qc.get("group_size") or qc.get("q_group_size")
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


def check_quantization(hf_config: dict, where: str = "the model") -> None:
    """Raise UnsupportedQuantization naming the method and what is supported, if config.json has a
    quantization_config."""
    method = quantization_method(hf_config)
    if method is None:
        return
    name = _KNOWN.get(method, method)
    qc = hf_config["quantization_config"]
    raise UnsupportedQuantization(
        f"{where} is quantized with {name}{_details(qc) if isinstance(qc, dict) else ''} "
        f"(quantization_config in config.json), which pagedserve cannot load. Supported: {SUPPORTED_QUANTIZATION}. "
        "Use the unquantized (float16/bfloat16) checkpoint of this model, or a GGUF file of it.")
