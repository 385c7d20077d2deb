"""The in-process engine: scheduler + model runner in one loop (add requests, step, abort)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
from pathlib import Path
from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from pagedserve.common import settings, structured_output
from pagedserve.common.gc_heap import frozen_heap
from pagedserve.common.lora import LoraError, LoraRequest, parse_lora_modules, read_adapter
from pagedserve.common.messages import SampledToken
from pagedserve.common.multimodal import ImageInput, check_placements
from pagedserve.common.request_checks import logprobs_limit, logprobs_problem, params_vocab_problem
from pagedserve.common.sampling_defaults import read_defaults
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.vision_config import image_problem
from pagedserve.common.compilation import graph_plan, with_flags
from pagedserve.common.speculative import parse_speculative_config
from pagedserve.model_files.draft_check import check_draft_model
from pagedserve.scheduler.core.request import Request
from pagedserve.scheduler.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.worker.model_setup import (KVSettings, KVSize, load_runner, measure_cuda_memory, place_model,
                                           runner_kwargs, seed_rngs, size_kv_cache)
from pagedserve.worker.process_group import TPGroup, using_group

log = logging.getLogger("pagedserve")


_DEFAULTS = settings.defaults("engine")  # each default is declared in pagedserve.common.settings only


@dataclass(slots=True)
class EngineConfig:
    """The engine's settings (pagedserve.common.settings, "engine"), as the engine names them."""
    model: str | None = _DEFAULTS["model"]  # HF folder or .gguf; None: the default model
    tokenizer: str | None = _DEFAULTS["tokenizer"]  # folder of the tokenizer files; None: the model's
    revision: str | None = _DEFAULTS["revision"]  # a hub id's branch, tag or commit; None: main
    chat_template: str | None = _DEFAULTS["chat_template"]  # a file or inline Jinja; None: the model's
    # vLLM's JSON (a str) or a dict of image processor overrides: {"max_pixels": 1003520}; common/processor_kwargs.py
    mm_processor_kwargs: str | dict | None = _DEFAULTS["mm_processor_kwargs"]
    device: str = _DEFAULTS["device"]
    dtype: str = _DEFAULTS["dtype"]
    quantization: str = _DEFAULTS["quantization"]  # auto: a GGUF's own blocks on the CPU; none; int8
    block_size: int = _DEFAULTS["block_size"]
    kv_cache_memory: str | int | None = _DEFAULTS["kv_cache_memory"]  # None: 2GiB on CPU; CUDA: what is left
    gpu_memory_utilization: float = _DEFAULTS["gpu_memory_utilization"]
    swap_space: str | int = _DEFAULTS["swap_space"]  # host pool for preemption_mode="swap"
    max_num_seqs: int = _DEFAULTS["max_num_seqs"]
    enforce_eager: bool = _DEFAULTS["enforce_eager"]  # CUDA: no graphs
    # vLLM's JSON (a str) or a dict: {"cudagraph_mode": "FULL_DECODE_ONLY"}; common/compilation.py
    compilation_config: str | dict | None = _DEFAULTS["compilation_config"]
    # None: settings.step_budgets picks them (512 on CPU, 2048 on CUDA; an eighth, a quarter of that)
    max_num_batched_tokens: int | None = _DEFAULTS["max_num_batched_tokens"]
    long_prefill_token_threshold: int | None = _DEFAULTS["long_prefill_token_threshold"]
    max_model_len: int | None = _DEFAULTS["max_model_len"]
    max_logprobs: int = _DEFAULTS["max_logprobs"]  # vLLM's; -1: the vocabulary
    preemption_mode: str = _DEFAULTS["preemption_mode"]
    policy: str = _DEFAULTS["scheduling_policy"]
    enable_prefix_caching: bool = not _DEFAULTS["no_prefix_caching"]
    enable_chunked_prefill: bool = not _DEFAULTS["no_chunked_prefill"]
    # ranks 1..N-1 run in spawned processes (services: one worker per rank)
    tensor_parallel_size: int = _DEFAULTS["tensor_parallel_size"]
    runner: str = _DEFAULTS["runner"]  # auto/generate, or pooling: embeddings (LLM.embed)
    pooler: str = _DEFAULTS["pooler"]  # with runner pooling: last, mean or cls
    enable_lora: bool = _DEFAULTS["enable_lora"]  # LoRA adapters (add_request's lora_request)
    lora_modules: list[str] | None = _DEFAULTS["lora_modules"]  # name=path, registered at start
    max_loras: int = _DEFAULTS["max_loras"]
    max_lora_rank: int = _DEFAULTS["max_lora_rank"]
    max_cpu_loras: int | None = _DEFAULTS["max_cpu_loras"]  # None: max_loras
    # vLLM's JSON (a str) or a dict: {"method": "ngram", "num_speculative_tokens": 4, ...}; None: off
    speculative_config: str | dict | None = _DEFAULTS["speculative_config"]
    # Begin step N+1 before taking step N's tokens (vLLM's async scheduling; worker/step_overlap.py).
    # None: where the device runs behind the host (CUDA); the CPU computes a step as it is launched.
    async_scheduling: bool | None = None
    # The model's sampling defaults (vLLM's --generation-config; common/sampling_defaults.py): what
    # LLM.generate and chat use when given no sampling params. auto, vllm or a folder; JSON over it.
    # vLLM's LLM(seed=...): the generators start from it (worker/model_setup.seed_rngs; the benches' own
    # --seed is their workload's, so the engine commands take no --seed flag)
    seed: int | None = None
    generation_config: str = _DEFAULTS["generation_config"]
    override_generation_config: str | dict | None = _DEFAULTS["override_generation_config"]
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
    prompt_logprobs: list[SampledToken] | None = None  # positions 1.., on the request's first output (sample 0's)
    embedding: bytes | None = None  # an embedding request's vector (float32 LE), on its finish


@dataclass(slots=True)
class CompletedSample:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampledToken] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[SampledToken] | None = None  # positions 1.. of the prompt, when asked


def engine_config_from_args(args: argparse.Namespace, progress: bool = True) -> EngineConfig:
    """The engine's settings parsed by add_engine_args: the fields of the same name as they are,
    the others renamed here."""
    values = vars(args)
    same = {name: values[name] for name in EngineConfig.__dataclass_fields__ if name in values}
    compilation = with_flags(values.get("compilation_config"), values.get("cudagraph_capture_sizes"),
                             values.get("max_cudagraph_capture_size"), values.get("cuda_graph_sizes"))
    return EngineConfig(**{**same, "compilation_config": compilation, "policy": args.scheduling_policy,
                           "enable_prefix_caching": not args.no_prefix_caching,
                           "enable_chunked_prefill": not args.no_chunked_prefill, "progress": progress,
                           "async_scheduling": False if getattr(args, "no_async_scheduling", False) else None})


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer=None) -> None:
        self.config = config
        speculative = parse_speculative_config(config.speculative_config)  # a bad one fails before the model loads
        # so does a bad compilation config; the KV budget reserves the graphs' pool (_size_kv_cache)
        self.graphs = graphs = graph_plan(config.compilation_config, config.enforce_eager)
        # The one model setup (worker/model_setup.py), as the worker service runs it.
        place = place_model(config.model, config.device, config.dtype, config.max_model_len, local_rank=0,
                            tokenizer=tokenizer, tokenizer_name=config.tokenizer, revision=config.revision,
                            mm_processor_kwargs=config.mm_processor_kwargs)
        self.model_path, self.model_config, self.tokenizer = place.model_path, place.model_config, place.tokenizer
        # the model's sampling defaults (a bad generation config fails here, before the weights load)
        self.sampling_defaults = read_defaults(place.model_path, config.generation_config,
                                               config.override_generation_config)
        draft_path = check_draft_model(speculative, place.model_config, place.max_model_len)  # before any load
        self.device, self.dtype, self.eos_token_ids = place.device, place.dtype, place.eos_token_ids
        mc = self.model_config
        self.max_model_len = max_len = place.max_model_len
        config.max_num_batched_tokens, long_prefill_token_threshold = settings.step_budgets(
            config.max_num_batched_tokens, config.long_prefill_token_threshold, self.device.type)
        self.ranks = None
        if config.tensor_parallel_size > 1:
            from pagedserve.worker.local_ranks import LocalRanks
            self.ranks = LocalRanks(config.tensor_parallel_size, self.device,
                                    {**runner_kwargs(place, config.block_size, config.quantization), "progress": False})
        try:
            # one rank: built for one whatever group is current (a tensor-parallel engine may live beside it)
            with contextlib.nullcontext() if self.ranks else using_group(TPGroup()):
                self.runner = load_runner(place, config.block_size, config.quantization, progress=config.progress)
            if draft_path is not None:  # before the KV pool is sized: its blocks hold the draft's K/V too
                self._on_all_ranks("enable_draft", str(draft_path))
            log.info("loaded %s (%s on %s; linear weights %s)", Path(self.model_path).name,
                     str(self.dtype).removeprefix("torch."), self.device, self.runner.weights_description)
            size = self._size_kv_cache()
        except BaseException:
            self.close()
            raise
        num_blocks, num_host_blocks = size.num_blocks, size.num_host_blocks
        seed_rngs(config.seed)
        max_concurrency = num_blocks * config.block_size / max_len
        log.info("KV cache: %d blocks of %d tokens (%s, %.1f MiB); maximum concurrency at %d tokens "
                 "per request: %.2fx", num_blocks, config.block_size, self.dtype,
                 num_blocks * size.block_bytes / 2**20, max_len, max_concurrency)
        self._on_all_ranks("allocate_kv_cache", num_blocks, num_host_blocks)
        self.loras: dict[str, str] = {}  # the adapters requests may name: name -> folder
        if config.enable_lora:
            self._on_all_ranks("enable_lora", config.max_loras, config.max_lora_rank,
                               config.max_cpu_loras or config.max_loras)
            for name, path in parse_lora_modules(config.lora_modules).items():
                self.add_lora(LoraRequest(name, 0, path))
        self._on_all_ranks("use_decode_graphs", config.max_num_seqs, not graphs.decode,
                           config.max_num_batched_tokens if graphs.mixed else 0, graphs)
        self.scheduler = Scheduler(SchedulerConfig(
            num_gpu_blocks=num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=max_len,
            num_cpu_blocks=num_host_blocks, enable_prefix_caching=config.enable_prefix_caching,
            enable_chunked_prefill=config.enable_chunked_prefill, preemption_mode=config.preemption_mode,
            policy=config.policy, long_prefill_token_threshold=long_prefill_token_threshold,
            kv_group_windows=mc.kv_groups().windows, max_loras=config.max_loras if config.enable_lora else 0,
            whole_images=bool((mc.vision or {}).get("bidirectional"))),
            speculative)
        self.num_steps = 0
        asked = config.async_scheduling
        # (with tensor parallelism too: rank 0 broadcasts the sampled ids on the device as a step begins)
        self.overlaps = self.runner.platform.runs_behind_host if asked is None else asked
        self._in_flight = None  # (SchedulerOutput, the runner's StepInFlight) begun ahead, overlaps only

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

    def _size_kv_cache(self) -> KVSize:
        cfg = self.config
        kv = KVSettings(cfg.block_size, cfg.kv_cache_memory, cfg.gpu_memory_utilization, cfg.max_num_batched_tokens,
                        cfg.swap_space if cfg.preemption_mode == "swap" else 0,
                        self.graphs.graph_tokens(cfg.max_num_seqs, cfg.max_num_batched_tokens))

        def measure(runner, num_tokens: int):
            if self.ranks is not None:  # the profile run's collectives need every rank
                self.ranks.call("profile_peak_activation_bytes", num_tokens)
            return measure_cuda_memory(runner, num_tokens)
        return size_kv_cache(self.runner, kv, measure=measure)

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) ------------------------------
    def add_lora(self, lora_request: LoraRequest) -> bool:
        """Register an adapter (its folder checked now; the ranks read it on first use). LoraError
        when it cannot be served."""
        if not self.config.enable_lora:
            raise LoraError("LoRA adapters need enable_lora (--enable-lora)")
        read_adapter(lora_request.lora_name, lora_request.lora_path, self.config.max_lora_rank)
        self.loras[lora_request.lora_name] = lora_request.lora_path
        return True

    def remove_lora(self, name: str) -> bool:
        """Forget an adapter (running requests of it keep it until they finish)."""
        known = self.loras.pop(name, None) is not None
        if known:
            self._on_all_ranks("remove_lora", name)
        return known

    def list_loras(self) -> list[str]:
        return list(self.loras)

    def _with_lora(self, params: SamplingParams, lora_request: LoraRequest | None) -> SamplingParams:
        if lora_request is None:
            return params
        name, path = lora_request.lora_name, lora_request.lora_path
        if path and self.loras.get(name) != path:
            self.add_lora(lora_request)
        elif name not in self.loras:
            raise LoraError(f"LoRA adapter {name!r} is not loaded (and the request names no lora_path)", 404)
        return dataclasses.replace(params, lora_name=name, lora_path=self.loras[name])

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, lora_request: LoraRequest | None = None,
                    images: Sequence[ImageInput] = ()) -> None:
        """images: a multimodal model's, in prompt order, each over its placeholder tokens (common/multimodal.py)."""
        params = self._with_lora(params, lora_request)
        if images:
            check_placements(images, len(prompt_token_ids))
        if problem := image_problem(images, prompt_token_ids, self.model_config.vision):
            raise ValueError(problem)
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        problem = params_vocab_problem(params, vocab) or logprobs_problem(
            params, logprobs_limit(self.config.max_logprobs, vocab))
        if problem:
            raise ValueError(problem)
        if params.structured_output is not None:
            structured_output.check(params.structured_output)
        self.scheduler.add_request(Request(request_id, list(prompt_token_ids), len(prompt_token_ids),
                                           params, self.eos_token_ids, priority, images=tuple(images)))

    def abort(self, request_id: str, sample_index: int | None = None) -> bool:
        """Stop a request (or one of its samples; see Scheduler.abort). False if unknown."""
        return self.scheduler.abort(request_id, sample_index)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        """One step's outputs. With async scheduling (self.overlaps) the step after it has begun on the
        device before this one's tokens are taken (step_overlap.py)."""
        if self.overlaps:
            sched, result = self._overlapped_step()
        else:
            sched = self.scheduler.schedule()
            result = self._on_all_ranks("execute", sched)
        self.num_steps += 1
        updates = self.scheduler.update(sched, result)
        for request_id, exc in self.scheduler.take_failed():
            # One caller in one process: its request's fault is its error (the scheduler has
            # aborted that request already and stays consistent for the others).
            raise RuntimeError(f"request {request_id!r} failed in the scheduler: {exc}") from exc
        return [RequestOutput(u.request.group_id, u.request.sample_index, u.new_tokens, u.finished,
                              u.request.finish_reason, u.request.num_prompt_tokens, u.request.num_cached_tokens,
                              u.prompt_logprobs, u.embedding)
                for u in updates]

    def _overlapped_step(self):
        """(step, result) of the step begun last time (or now), the next one begun ahead first when
        nothing needs these results to schedule it (Scheduler.schedule(ahead=True))."""
        sched, handle = self._in_flight or self._begin(self.scheduler.schedule())
        self._in_flight = None
        scheduler = self.scheduler
        if not scheduler.needs_sync and not scheduler.waits_for_speculation():
            ahead = scheduler.schedule(ahead=True)
            if ahead is not None:
                self._in_flight = self._begin(ahead)
        return sched, self.runner.finish(handle)

    def _begin(self, sched):
        """Begin a step on every rank; only rank 0's is finished here (a rank's runner finishes its older
        step itself as the next one begins: its finish runs no collective)."""
        return sched, self._on_all_ranks("begin", sched)

    def generate(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams,
                 use_tqdm: bool = False, lora_request: LoraRequest | list | None = None) -> list[list[CompletedSample]]:
        """Run a batch to completion; results in input order, one list of samples per prompt.
        lora_request: one adapter for every prompt, or one (or None) per prompt."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        ids = [f"gen-{self.num_steps}-{i}" for i in range(len(prompts))]
        results = {rid: [CompletedSample() for _ in range(p.n)] for rid, p in zip(ids, params)}
        for rid, prompt, p, lora in zip(ids, prompts, params, loras):
            self.add_request(rid, prompt, p, lora_request=lora)
        bar = tqdm(total=len(prompts), desc="generating", unit="req", disable=not use_tqdm)
        pending = {rid: p.n for rid, p in zip(ids, params)}
        with frozen_heap():  # no full collection rescans the model and libraries step after step
            self._generate_loop(results, pending, bar)
        bar.close()
        return [results[rid] for rid in ids]

    def _generate_loop(self, results: dict, pending: dict, bar) -> None:
        while self.has_unfinished():
            for out in self.step():
                sample = results[out.request_id][out.sample_index]
                if out.prompt_logprobs is not None:  # once per request: every sample shows them
                    for each in results[out.request_id]:
                        each.prompt_logprobs = out.prompt_logprobs
                for token in out.new_tokens:
                    sample.token_ids.append(token.token_id)
                    if token.logprob is not None:
                        sample.logprobs.append(token)
                if out.finished:
                    sample.finish_reason = out.finish_reason
                    pending[out.request_id] -= 1
                    if pending[out.request_id] == 0:
                        bar.update(1)

    def stats(self) -> dict:
        bm = self.scheduler.block_manager
        return {"num_blocks": bm.num_total_blocks, "num_free_blocks": bm.num_free_blocks,
                "prefix_cache_queries": bm.prefix_queries, "prefix_cache_hits": bm.prefix_hits,
                "num_preemptions": self.scheduler.num_preemptions, "num_steps": self.num_steps,
                "waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
                "swapped": len(self.scheduler.swapped), "adapters": self._adapter_counts(),
                **self.spec_decode_stats()}

    def _adapter_counts(self) -> dict[str, dict[str, int]]:
        """LoRA adapter -> its running and waiting requests (vLLM's lora_requests_info)."""
        counts: dict[str, dict[str, int]] = {}
        for queue in ("running", "waiting"):
            for req in getattr(self.scheduler, queue):
                if req.params.lora_name:
                    entry = counts.setdefault(req.params.lora_name, {"running": 0, "waiting": 0})
                    entry[queue] += 1
        return counts

    def spec_decode_stats(self) -> dict:
        """Speculative decoding's counters, acceptance rate and mean acceptance length (empty when off)."""
        spec = self.scheduler.speculation
        return {} if spec is None else {"spec_decode": spec.counters.as_dict()}
