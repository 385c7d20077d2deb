"""What `pagedserve plan` runs (the command: plan_command.py): replay a workload through the real
scheduler on a calibrated profile and report what `bench serve` would (its --json keys, its
printed report); with --sweep, every combination of the budgets given, ranked (sweep.py); with
--memory, the KV-cache arithmetic (memory.py).

The scheduler is configured the way the server configures it: the step budgets from
settings.step_budgets on the profile's device, the KV pool from --kv-cache-memory (else the pool the
server sized when the profile was made) divided by the model's bytes per block. No torch here.
"""

from __future__ import annotations

import math

from pagedserve.common import settings
from pagedserve.common.lora import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS
from pagedserve.planner.cost_model import LoraCost, Profile
from pagedserve.common.sizes import parse_size
from pagedserve.planner.report import bench_json
from pagedserve.planner.simulator import Simulator
from pagedserve.planner.trace import TraceRequest, from_dataset, load_trace, spread_over_adapters
from pagedserve.scheduler.core.scheduler import SchedulerConfig

ENGINE_KEYS = ("block_size", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens",
               "long_prefill_token_threshold", "max_model_len", "preemption_mode", "scheduling_policy",
               "no_prefix_caching", "no_chunked_prefill", "swap_space", "enable_lora", "max_loras", "max_lora_rank")


def scheduler_config(profile: Profile, engine: dict) -> SchedulerConfig:
    """The SchedulerConfig `pagedserve serve` would build with these engine flags on the profiled
    machine (engine: ENGINE_KEYS -> value, None for the default)."""
    budget, threshold = settings.step_budgets(engine.get("max_num_batched_tokens"),
                                              engine.get("long_prefill_token_threshold"), profile.device)
    block_size = engine.get("block_size") or 16
    per_block = profile.kv_bytes_per_token * block_size
    pool_bytes = parse_size(engine["kv_cache_memory"]) if engine.get("kv_cache_memory") else \
        profile.default_kv_cache_bytes
    num_blocks = pool_bytes // per_block
    if num_blocks < 1:
        raise ValueError(f"the KV cache budget of {pool_bytes} bytes holds no block ({per_block} bytes each)")
    max_len = engine.get("max_model_len") or profile.max_model_len
    if max_len > profile.max_model_len:
        raise ValueError(f"max_model_len {max_len} exceeds the model's context of {profile.max_model_len}")
    mode = engine.get("preemption_mode") or "recompute"
    host = parse_size(engine.get("swap_space") or "1GiB") // per_block if mode == "swap" else 0
    return SchedulerConfig(num_gpu_blocks=int(num_blocks), block_size=block_size,
                           max_num_seqs=engine.get("max_num_seqs") or 128, max_num_batched_tokens=budget,
                           max_model_len=max_len, num_cpu_blocks=int(host),
                           enable_prefix_caching=not engine.get("no_prefix_caching"),
                           enable_chunked_prefill=not engine.get("no_chunked_prefill"), preemption_mode=mode,
                           policy=engine.get("scheduling_policy") or "fcfs",
                           long_prefill_token_threshold=threshold,
                           max_loras=(engine.get("max_loras") or DEFAULT_MAX_LORAS) if engine.get("enable_lora") else 0)


def lora_cost(profile: Profile, engine: dict) -> LoraCost | None:
    """The adapters' extra cost per step with --enable-lora (cost_model.LoraCost), else None."""
    if not engine.get("enable_lora"):
        return None
    return profile.lora_cost(engine.get("max_lora_rank") or DEFAULT_MAX_LORA_RANK)


def load_workload(args) -> list[TraceRequest]:
    if args.trace:
        return spread_over_adapters(load_trace(args.trace), getattr(args, "loras", 0))
    tokenizer = None
    if args.dataset == "sharegpt" or args.tokenizer:
        from pagedserve.bench.serve_datasets import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer, getattr(args, "profile_model_path", args.profile_model))
    return spread_over_adapters(from_dataset(args, tokenizer), getattr(args, "loras", 0))


def workload_config(args, trace: list[TraceRequest]) -> dict:
    """The workload keys `bench serve --json` writes, as far as a plan knows them."""
    return {"model": args.profile_model, "dataset": "trace" if args.trace else args.dataset,
            "dataset_path": args.trace or args.dataset_path, "num_prompts": len(trace), "prompt_format": "token_ids",
            "input_len": args.input_len, "output_len": args.output_len, "range_ratio": args.range_ratio,
            "num_prefixes": args.num_prefixes, "suffixes_per_prefix": args.suffixes_per_prefix,
            "prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "burstiness": args.burstiness,
            "seed": args.seed, "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms}


def simulate(profile: Profile, engine: dict, trace: list[TraceRequest], max_concurrency: int | None,
             request_rate: float, slo_ttft_ms: float | None, slo_tpot_ms: float | None, config: dict) -> dict:
    sched_config = scheduler_config(profile, engine)
    if any(r.lora for r in trace) and not engine.get("enable_lora"):
        raise ValueError("the workload's requests name LoRA adapters: plan it with --enable-lora")
    lora = lora_cost(profile, engine)
    sim = Simulator(sched_config, lambda shape: profile.step_time(shape, lora), profile.request_overhead_s,
                    max_concurrency).run(trace)
    result = bench_json(sim, trace, slo_ttft_ms, slo_tpot_ms, request_rate, max_concurrency, config)
    waits = [t.send_s - r.arrival_s for t, r in zip(sim.requests, trace)]
    result["planner"].update(
        engine={k: getattr(sched_config, k) for k in ("num_gpu_blocks", "block_size", "max_num_seqs",
                                                        "max_num_batched_tokens", "long_prefill_token_threshold",
                                                        "max_model_len", "enable_prefix_caching",
                                                        "enable_chunked_prefill", "preemption_mode",
                                                        "max_loras")},
        lora=None if lora is None else {"max_lora_rank": engine.get("max_lora_rank") or DEFAULT_MAX_LORA_RANK,
                                        "ms_per_adapted_token": 1e3 * lora.seconds_per_row,
                                        "ms_per_adapter_in_step": 1e3 * lora.seconds_per_slot,
                                        "lora_ms_total": 1e3 * sum(lora.seconds_per_row * s.lora_rows +
                                                                 lora.seconds_per_slot * s.lora_slots
                                                                 for s in sim.steps)},
        mean_client_wait_ms=1e3 * sum(waits) / len(waits) if waits else 0.0,
        profile={"model": profile.model, "device": profile.device, "dtype": profile.dtype,
                 "fit_mean_abs_rel_error": profile.cost.fit.mean_abs_rel_error,
                 "step_overhead_ms": 1e3 * profile.step_overhead_s,
                 "request_overhead_ms": 1e3 * profile.request_overhead_s})
    return result


def print_planner_lines(result: dict) -> None:
    p = result["planner"]
    waits = ", ".join(f"{k} {v:.1f}" for k, v in p["waiting_request_seconds"].items() if v) or "none"
    print(f"{' Planner (simulated) ':-^60}")
    for label, value in (("Steps:", p["num_steps"]), ("Mean step (ms):", f"{p['mean_step_ms']:.2f}"),
                         ("Mean tokens per step:", f"{p['mean_step_tokens']:.1f}"),
                         ("Preemptions:", p["num_preemptions"]),
                         ("KV usage peak / mean:",
                          f"{100 * p['kv_usage_peak']:.1f}% / {100 * p['kv_usage_mean']:.1f}%"),
                         ("Mean running / waiting:", f"{p['mean_running']:.1f} / {p['mean_waiting']:.1f}"),
                         ("Client-side wait (mean ms):", f"{p['mean_client_wait_ms']:.1f}")):
        print(f"{label:<40}{value!s:>20}")
    print(f"waiting (request-seconds by reason): {waits}")
    if p.get("lora"):
        lora = p["lora"]
        print(f"LoRA (rank {lora['max_lora_rank']}): {lora['ms_per_adapted_token']:.4f} ms per adapted token, "
              f"{lora['ms_per_adapter_in_step']:.3f} ms per adapter in a step; {lora['lora_ms_total']:.1f} ms in all")


def engine_values(args) -> dict:
    return {k: getattr(args, k, None) for k in ENGINE_KEYS}


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"
