"""A model's weights loaded, and what its linear layers hold: the one place that decides it from
--quantization, the device and the checkpoint (vLLM's method names checked against it, a GGUF's blocks
or a checkpoint's 4-bit ones kept on the CPU kernels or, on CUDA, their 4-bit ones on the int4 kernel; else
float), and says
so in the line that names the model. Load time only."""

from __future__ import annotations

from pathlib import Path

import torch

from pagedserve.common.checkpoint_quantization import kept_in_blocks, quantization_flag, scaled_weights
from pagedserve.common.model_config import ModelConfig
from pagedserve.worker import int4_weight, quantized
from pagedserve.worker.weights import iter_lazy_weights, weight_files


def load_linear_weights(model: torch.nn.Module, model_config: ModelConfig, model_path, requested: str,
                        device: torch.device, dtype: torch.dtype, progress: bool) -> tuple[str, str, str]:
    """Fill the model's weights. Returns (--quantization as the load took it: vLLM's method names become
    auto; the mode: "gguf", "int8", "int4" or "none"; the description of the linear weights)."""
    requested = quantization_flag(requested, model_config.hf)
    is_gguf = weight_files(Path(model_path))[0].suffix == ".gguf"
    scaled = scaled_weights(model_config.hf)
    kept = kept_in_blocks(scaled)  # a checkpoint's 4-bit weights that are Q4_0 / Q4_1 blocks
    mode = quantized.resolve(requested, device, is_gguf or kept, kept or is_gguf)
    model.load_weights(iter_lazy_weights(model_path, dtype, progress, keep_quantized=mode in ("gguf", "int4")))
    if mode == "int4":
        formats = int4_weight.finalize(model, device)
    else:
        formats = quantized.finalize(model, mode) if mode != "none" else {}
    kernels = "the int4 kernel" if mode == "int4" else "the CPU kernels"
    description = "float" if not formats else f"quantized on {kernels} (" + ", ".join(
        f"{count} {name}" for name, count in sorted(formats.items())) + " matrices)"
    if scaled is not None:
        how = "kept from" if formats else "dequantized at load from"
        description += f", {how} the checkpoint's {scaled.method} weights"
    return requested, mode, description
