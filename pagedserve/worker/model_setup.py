"""A model's place and budget, decided once at load: device, dtype, context length, eos ids and how
many KV blocks fit. Shared by the worker service and the in-process engine (pagedserve.engine)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from pagedserve.common.model_config import ModelConfig
from pagedserve.common.sizes import parse_size
from pagedserve.worker.kv_cache import bytes_per_block

log = logging.getLogger("pagedserve")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


def cpu_has_fast_bf16() -> bool:
    from pagedserve.kernels.cpu_ops import cpu_flags
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
             "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    if name not in table:
        raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {name!r}")
    if device.type == "cpu" and table[name] == torch.bfloat16 and not cpu_has_fast_bf16():
        # Without avx512_bf16 or AMX nothing computes in bfloat16: torch's bfloat16 matmuls ran at
        # 0.3-2.4 GFLOP/s against 100-130 in float32 on a 2-core Zen 3 EPYC (AVX2 only), and
        # oneDNN's at a quarter of float32's on an AVX-512 Xeon without avx512_bf16. So the linear
        # layers multiply in float32: AVX-512 widens the bfloat16 weights in registers, AVX2 keeps
        # float32 copies of them (cpu_linear.pack).
        log.warning("--dtype bfloat16 on a CPU without avx512_bf16 or AMX: there is no bfloat16 arithmetic here, "
                    "the matmuls widen the weights to float32 (without AVX-512 into float32 copies of them, "
                    "which take 2x the memory), so bfloat16 is no faster than float32 at large batches "
                    "(--dtype auto picks float32)")
    return table[name]


def eos_ids(folder: Path, cfg: ModelConfig, tokenizer) -> tuple[int, ...]:
    ids = set(cfg.eos_token_ids)
    gen = folder / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def resolve_max_model_len(mc: ModelConfig, requested: int | None) -> int:
    max_len = mc.max_position_embeddings
    if mc.sliding_window:
        max_len = min(max_len, mc.sliding_window)  # full attention equals windowed attention below it
    if requested:
        if requested > max_len:
            raise ValueError(f"max_model_len {requested} exceeds the model's context of {max_len}")
        max_len = requested
    return max_len


def kv_cache_blocks(runner, block_size: int, kv_cache_memory: str | int | None, gpu_memory_utilization: float,
                    max_num_batched_tokens: int, swap_space: str | int) -> tuple[int, int]:
    """How many device blocks the budget holds (and host blocks for swapping; swap_space 0: none)."""
    per_block = bytes_per_block(runner.config, block_size, runner.dtype, runner.tensor_parallel_size)
    if kv_cache_memory:
        budget = parse_size(kv_cache_memory)
    elif runner.device.type == "cuda":
        # Weights are loaded: what is in use now plus the peak of the largest step is taken.
        peak = runner.profile_peak_activation_bytes(max_num_batched_tokens)
        free, total = torch.cuda.mem_get_info(runner.device)
        budget = int(total * gpu_memory_utilization) - (total - free) - peak
    else:
        budget = parse_size("2GiB")
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(f"the KV cache budget of {budget} bytes holds no block "
                         f"({per_block} bytes each); raise --kv-cache-memory")
    host = parse_size(swap_space) // per_block if swap_space else 0
    return int(num_blocks), int(host)
