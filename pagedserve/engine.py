"""The in-process engine: scheduler + model runner in one loop (add requests, step, abort)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from pagedserve.messages import SampledToken
from pagedserve.model_config import ModelConfig
from pagedserve.sampling_params import SamplingParams
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.worker.kv_cache import bytes_per_block, parse_size

log = logging.getLogger("pagedserve")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # HF folder or .gguf; None: the default model
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_memory: str | int | None = None  # default: 2GiB on CPU; on CUDA from gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    swap_space: str | int = "1GiB"  # host pool for preemption_mode="swap"
    max_num_seqs: int = 128
    # None: 512 on CPU (small steps mix prefill chunks into decodes: +8% on W64 over 2048, and
    # a short prompt waits less behind a long one), 2048 on CUDA.
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int | None = None  # None: max_num_batched_tokens // 4
    max_model_len: int | None = None
    preemption_mode: str = "recompute"
    policy: str = "fcfs"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = 1  # ranks 1..N-1 run in spawned processes (services: one worker per rank)
    progress: bool = True


@dataclass(slots=True)
class RequestOutput:
    """New tokens of one sample of one request since the previous step."""
    request_id: str
    sample_index: int
    new_tokens: list[SampledToken]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass(slots=True)
class CompletedSample:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampledToken] = field(default_factory=list)
    finish_reason: str | None = None


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


def cpu_has_fast_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
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


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer=None) -> None:
        from pagedserve.default_model import resolve_model
        from services.worker.model_runner import ModelRunner

        self.config = config
        self.model_path = resolve_model(config.model)
        self.model_config = ModelConfig.from_folder(self.model_path)
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        if tokenizer is None:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_ids(self.model_path, self.model_config, tokenizer)
        mc = self.model_config
        self.max_model_len = max_len = resolve_max_model_len(mc, config.max_model_len)
        if config.max_num_batched_tokens is None:
            config.max_num_batched_tokens = 512 if self.device.type == "cpu" else 2048
        runner_kwargs = dict(model_config=mc, model_path=self.model_path, dtype=self.dtype, device=self.device,
                             block_size=config.block_size, max_model_len=max_len, eos_token_ids=self.eos_token_ids)
        self.ranks = None
        if config.tensor_parallel_size > 1:
            from services.worker.local_ranks import LocalRanks
            self.ranks = LocalRanks(config.tensor_parallel_size, self.device, {**runner_kwargs, "progress": False})
        try:
            self.runner = ModelRunner(**runner_kwargs, progress=config.progress)
        except BaseException:
            self.close()
            raise
        num_blocks, num_host_blocks = self._size_kv_cache()
        max_concurrency = num_blocks * config.block_size / max_len
        log.info("KV cache: %d blocks of %d tokens (%s, %.1f MiB); maximum concurrency at %d tokens "
                 "per request: %.2fx", num_blocks, config.block_size, self.dtype,
                 num_blocks * bytes_per_block(mc, config.block_size, self.dtype, config.tensor_parallel_size) / 2**20,
                 max_len, max_concurrency)
        self._on_all_ranks("allocate_kv_cache", num_blocks, num_host_blocks)
        self.scheduler = Scheduler(SchedulerConfig(
            num_gpu_blocks=num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=max_len,
            num_cpu_blocks=num_host_blocks, enable_prefix_caching=config.enable_prefix_caching,
            enable_chunked_prefill=config.enable_chunked_prefill, preemption_mode=config.preemption_mode,
            policy=config.policy, long_prefill_token_threshold=(
                config.max_num_batched_tokens // 4 if config.long_prefill_token_threshold is None
                else config.long_prefill_token_threshold)))
        self.num_steps = 0

    def _on_all_ranks(self, method: str, *args):
        if self.ranks is not None:
            self.ranks.call(method, *args)
        return getattr(self.runner, method)(*args)

    def close(self) -> None:
        """Stop the tensor-parallel ranks (a no-op on one rank)."""
        if self.ranks is not None:
            self.ranks.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _size_kv_cache(self) -> tuple[int, int]:
        cfg = self.config
        if self.ranks is not None and self.device.type == "cuda" and not cfg.kv_cache_memory:
            # kv_cache_blocks profiles a forward pass on rank 0; its collectives need every rank.
            self.ranks.call("profile_peak_activation_bytes", cfg.max_num_batched_tokens)
        return kv_cache_blocks(self.runner, cfg.block_size, cfg.kv_cache_memory, cfg.gpu_memory_utilization,
                               cfg.max_num_batched_tokens, cfg.swap_space if cfg.preemption_mode == "swap" else 0)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0) -> None:
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        self.scheduler.add_request(Request(request_id, list(prompt_token_ids), len(prompt_token_ids),
                                           params, self.eos_token_ids, priority))

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        result = self._on_all_ranks("execute", sched)
        self.num_steps += 1
        return [RequestOutput(u.request.group_id, u.request.sample_index, u.new_tokens, u.finished,
                              u.request.finish_reason, u.request.num_prompt_tokens, u.request.num_cached_tokens)
                for u in self.scheduler.update(sched, result)]

    def generate(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams,
                 use_tqdm: bool = False) -> list[list[CompletedSample]]:
        """Run a batch to completion; results in input order, one list of samples per prompt."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        ids = [f"gen-{self.num_steps}-{i}" for i in range(len(prompts))]
        results = {rid: [CompletedSample() for _ in range(p.n)] for rid, p in zip(ids, params)}
        for rid, prompt, p in zip(ids, prompts, params):
            self.add_request(rid, prompt, p)
        bar = tqdm(total=len(prompts), desc="generating", unit="req", disable=not use_tqdm)
        pending = {rid: p.n for rid, p in zip(ids, params)}
        while self.has_unfinished():
            for out in self.step():
                sample = results[out.request_id][out.sample_index]
                for token in out.new_tokens:
                    sample.token_ids.append(token.token_id)
                    if token.logprob is not None:
                        sample.logprobs.append(token)
                if out.finished:
                    sample.finish_reason = out.finish_reason
                    pending[out.request_id] -= 1
                    if pending[out.request_id] == 0:
                        bar.update(1)
        bar.close()
        return [results[rid] for rid in ids]

    def stats(self) -> dict:
        bm = self.scheduler.block_manager
        return {"num_blocks": bm.num_total_blocks, "num_free_blocks": bm.num_free_blocks,
                "prefix_cache_queries": bm.prefix_queries, "prefix_cache_hits": bm.prefix_hits,
                "num_preemptions": self.scheduler.num_preemptions, "num_steps": self.num_steps,
                "waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
                "swapped": len(self.scheduler.swapped)}
