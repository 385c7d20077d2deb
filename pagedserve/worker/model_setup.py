"""One model setup, used by the worker service and the in-process engine (pagedserve.engine)
alike: place the model (resolve it, its device for this rank, dtype, context length, eos ids),
load it into a ModelRunner, measure the device's memory, and size the KV pool.

    place = place_model(model, device, dtype, max_model_len, local_rank=...)
    runner = load_runner(place, block_size, quantization)      # after joining the TP group
    size = size_kv_cache(runner, KVSettings(...))              # raises KVBudgetError
    runner.allocate_kv_cache(size.num_blocks, size.num_host_blocks)

The device decisions (device, dtype, rank device, memory reading, KV budget) are the platform's
(pagedserve.worker.platform); the budget's arithmetic is device_memory's (pure).
Threads: the caller's (the worker's torch thread, the engine's).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.common.model_config import ModelConfig
from pagedserve.common.sizes import parse_size
from pagedserve.common.vision_config import largest_step_tokens
from pagedserve.worker.device_memory import MemoryReading, describe, graph_reserve, num_blocks
from pagedserve.worker.kv_cache import bytes_per_block
from pagedserve.worker.platform import (  # noqa: F401 (pick_device, pick_dtype, cpu_has_fast_bf16: re-exported)
    cpu_has_fast_bf16,
    measure_cuda_memory,
    pick_device,
    pick_dtype,
    platform_for,
)

log = logging.getLogger("pagedserve")


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


CPU_KV_CACHE_MEMORY = "2GiB"  # the CPU's pool when --kv-cache-memory is not given


@dataclass(frozen=True, slots=True)
class ModelPlace:
    """Where and how a model runs, decided before its weights load."""
    model_path: Path
    model_config: ModelConfig
    device: torch.device  # this rank's own (cuda:<local rank>, or the CPU)
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    tokenizer: object | None  # the HF tokenizer, when one was given or could be loaded


def place_model(model: str | None, device: str, dtype: str, max_model_len: int | None, local_rank: int = 0,
                tokenizer=None, tokenizer_name: str | None = None, need_tokenizer: bool = True,
                revision: str | None = None, mm_processor_kwargs: str | dict | None = None) -> ModelPlace:
    """Resolve the model and decide its place. tokenizer: one the caller has, else loaded from
    tokenizer_name or the model's folder (need_tokenizer False: a model without one still runs,
    with the eos ids of its config files). mm_processor_kwargs: --mm-processor-kwargs, laid over the
    folder's preprocessor_config.json as the front end lays it (common/processor_kwargs.py)."""
    from pagedserve.model_files.default_model import resolve_model
    model_path = Path(resolve_model(model, revision))
    config = ModelConfig.from_folder(model_path, mm_processor_kwargs)
    where = platform_for(pick_device(device)).rank_device(local_rank)
    if tokenizer is None:
        from transformers import AutoTokenizer
        try:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_name or model_path)
        except (OSError, ValueError):
            if need_tokenizer:
                raise
    return ModelPlace(model_path, config, where, pick_dtype(dtype, where), resolve_max_model_len(config, max_model_len),
                      eos_ids(model_path, config, tokenizer), tokenizer)


def seed_rngs(seed: int | None) -> None:
    """--seed (vLLM's): torch's CPU and CUDA generators, Python's and numpy's start from seed (unseeded
    requests' draws come from torch's); None: left as the process started them."""
    if seed is None:
        return
    import random

    import numpy as np
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # every device's generator too


def runner_kwargs(place: ModelPlace, block_size: int, quantization: str) -> dict:
    """ModelRunner's arguments for this place (the TP followers of an engine get them too)."""
    return dict(model_config=place.model_config, model_path=place.model_path, dtype=place.dtype, device=place.device,
                block_size=block_size, max_model_len=place.max_model_len, eos_token_ids=place.eos_token_ids,
                quantization=quantization)


def load_runner(place: ModelPlace, block_size: int, quantization: str, progress: bool = True):
    """Load this rank's shard into a ModelRunner (the TP group joined already)."""
    from pagedserve.worker.model_runner import ModelRunner
    return ModelRunner(**runner_kwargs(place, block_size, quantization), progress=progress)


@dataclass(frozen=True, slots=True)
class KVSettings:
    """How the KV pool is sized: the engine's settings, the worker's own, or what its scheduler
    asks for in Profile."""
    block_size: int
    kv_cache_memory: str | int | None  # None: CPU_KV_CACHE_MEMORY on the CPU, the measured budget on CUDA
    gpu_memory_utilization: float
    max_num_batched_tokens: int | None  # a step's budget: the profile run's size (None: not known yet)
    swap_space: str | int = 0  # the host pool for swapping (0: none)
    graph_tokens: int = 0  # the largest step a CUDA graph will capture (GraphPlan.graph_tokens; 0: none)


@dataclass(frozen=True, slots=True)
class KVSize:
    num_blocks: int
    num_host_blocks: int
    block_bytes: int
    reading: MemoryReading | None  # what the budget was computed from (CUDA, measured)
    graph_reserve: int = 0  # bytes kept out of the budget for the CUDA graphs' pool (device_memory.graph_reserve)


def size_kv_cache(runner, kv: KVSettings, reading: MemoryReading | None = None,
                  measure: Callable[[object, int], MemoryReading] | None = None) -> KVSize:
    """How many device blocks this worker's budget holds (and host blocks for swapping). An
    explicit kv_cache_memory is the budget as given; else, where the platform measures memory (CUDA),
    the measured one (reading, or measure(runner, the largest step's tokens) now: max_num_batched_tokens,
    or more where a step may run an image past it (vision_config.largest_step_tokens); measure defaulting
    to the platform's), on the CPU CPU_KV_CACHE_MEMORY. Raises
    KVBudgetError (a ValueError) naming the numbers when it holds no block."""
    per_block = bytes_per_block(runner.config, kv.block_size, runner.dtype, runner.tensor_parallel_size)
    if getattr(runner, "drafter", None) is not None:  # a block holds the draft model's K/V too
        per_block = runner.kv_block_bytes(kv.block_size)
    graphs = 0
    if kv.kv_cache_memory:
        budget = parse_size(kv.kv_cache_memory)
    elif (platform := platform_for(runner.device)).measures_memory:
        profiled = kv.max_num_batched_tokens and largest_step_tokens(runner.config.vision, kv.max_num_batched_tokens)
        reading = reading or (measure or platform.measure_memory)(runner, profiled)
        # a runner with LoRA slots captures no graph (ModelRunner.use_decode_graphs)
        graph_tokens = kv.graph_tokens if getattr(runner, "lora", None) is None else 0
        graphs = graph_reserve(reading.peak, profiled or 0, graph_tokens)
        budget = platform.kv_budget(reading, kv.gpu_memory_utilization, per_block, graphs)
        log.info("KV budget %d bytes: %s", budget, describe(reading, kv.gpu_memory_utilization, per_block, graphs))
    else:
        budget = parse_size(CPU_KV_CACHE_MEMORY)
    host = parse_size(kv.swap_space) // per_block if kv.swap_space else 0
    return KVSize(int(num_blocks(budget, per_block)), int(host), per_block, reading, graphs)


def kv_cache_blocks(runner, block_size: int, kv_cache_memory: str | int | None, gpu_memory_utilization: float,
                    max_num_batched_tokens: int, swap_space: str | int) -> tuple[int, int]:
    """size_kv_cache's (device blocks, host blocks), for callers with the settings apart (the planner)."""
    size = size_kv_cache(runner, KVSettings(block_size, kv_cache_memory, gpu_memory_utilization,
                                            max_num_batched_tokens, swap_space))
    return size.num_blocks, size.num_host_blocks
