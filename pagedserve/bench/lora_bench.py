"""`pagedserve bench throughput --loras N`: the cost of serving LoRA adapters (issue 40).

The workload W<num-prompts> of `bench throughput` runs twice on one engine started with LoRA on
(--max-loras N, --max-lora-rank --lora-rank): on the base model alone, and with its requests
spread round robin over N random adapters of rank --lora-rank on every projection (q/k/v/o and
gate/up/down, written as PEFT folders into a temporary folder). The two alternate --rounds times
in the same sitting (base first), so a loaded machine slows both alike; the report gives each
run's output tok/s and the ratio of the best LoRA run to the best base run (the goal: >= 0.8).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

from pagedserve.common.lora import CONFIG_FILE, WEIGHTS_FILE, LoraRequest
from pagedserve.common.model_config import ModelConfig
from pagedserve.common.sampling_params import SamplingParams


def write_random_adapter(folder: Path, cfg: ModelConfig, rank: int, seed: int) -> Path:
    """A PEFT folder of rank `rank` on every projection of every layer, random A and B scaled so
    the delta is ~1% of a unit activation (as a trained adapter's)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
              "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
              "mlp.down_proj": (inter, h)}
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01 / rank ** 0.5
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / WEIGHTS_FILE))
    (folder / CONFIG_FILE).write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": [m.split(".")[1] for m in shapes],
        "bias": "none", "use_rslora": False, "task_type": "CAUSAL_LM"}))
    return folder


def run(args) -> dict:
    from pagedserve.bench.throughput import build_engine, cpu_name, load_tokenizer, make_workload, run_engine
    from pagedserve.model_files.default_model import resolve_model

    num_loras, rank = args.loras, args.lora_rank
    args.enable_lora, args.max_loras, args.max_lora_rank = True, num_loras, rank
    args.max_cpu_loras = max(args.max_cpu_loras or 0, num_loras)
    model_path = resolve_model(args.model, args.revision)
    engine = build_engine(args, model_path, load_tokenizer(model_path))
    work = make_workload(args.num_prompts, engine.model_config.vocab_size)
    with tempfile.TemporaryDirectory(prefix="pagedserve-lora-bench-") as tmp:
        for i in range(num_loras):
            path = write_random_adapter(Path(tmp) / f"bench-lora-{i}", engine.model_config, rank, seed=i)
            engine.add_lora(LoraRequest(f"bench-lora-{i}", i + 1, str(path)))
        greedy = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o) for o in work.output_lens]
        names = [f"bench-lora-{i % num_loras}" for i in range(len(work.prompts))]
        spread = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o, lora_name=name,
                                 lora_path=engine.loras[name]) for name, o in zip(names, work.output_lens)]
        engine.generate([[100 + i for i in range(8)]], greedy[0])  # warm-up, outside the timed runs
        engine.generate([[100 + i for i in range(8)]], spread[0])
        runs: dict[str, list[float]] = {"base": [], "lora": []}
        per_cpu_s: dict[str, list[float]] = {"base": [], "lora": []}  # on a shared machine, the steadier
        for _ in range(args.rounds):
            for kind, params in (("base", greedy), ("lora", spread)):
                t0, cpu0 = time.perf_counter(), time.process_time()
                out = run_engine(engine, work, params)
                cpu_s = time.process_time() - cpu0
                tps = work.num_output_tokens / out["elapsed_s"]
                runs[kind].append(tps)
                per_cpu_s[kind].append(work.num_output_tokens / cpu_s)
                print(f"{kind}: {work.num_output_tokens} output tokens in {time.perf_counter() - t0:.2f} s "
                      f"({tps:.1f} tok/s; {cpu_s:.1f} CPU s: {work.num_output_tokens / cpu_s:.1f} tok per CPU s), "
                      f"{out['num_steps']} steps", flush=True)
    dtype = str(engine.dtype).removeprefix("torch.")
    quantization, weights = engine.runner.quantization, engine.runner.weights_description
    engine.close()
    result = {"num_requests": len(work.prompts), "num_output_tokens": work.num_output_tokens,
              "loras": num_loras, "lora_rank": rank, "dtype": dtype, "rounds": args.rounds,
              "base_output_tokens_per_s": runs["base"], "lora_output_tokens_per_s": runs["lora"],
              "ratio_best": max(runs["lora"]) / max(runs["base"]),
              "ratio_median": float(np.median(runs["lora"]) / np.median(runs["base"])),
              "base_output_tokens_per_cpu_s": per_cpu_s["base"], "lora_output_tokens_per_cpu_s": per_cpu_s["lora"],
              "ratio_per_cpu_s": max(per_cpu_s["lora"]) / max(per_cpu_s["base"]),
              "quantization": quantization, "weights": weights,
              "model": str(args.model or model_path), "cpu": cpu_name()}
    print(f"LoRA ({num_loras} adapters of rank {rank}) / base output tok/s: best {result['ratio_best']:.3f}, "
          f"median {result['ratio_median']:.3f}; per CPU second {result['ratio_per_cpu_s']:.3f} ({dtype})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result
