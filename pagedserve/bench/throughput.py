"""`pagedserve bench throughput`: offline throughput of the engine on a fixed synthetic workload,
against transformers' static batching on the same weights, with KV-cache waste measured live.

Workload W<N> (default N=64): rng = numpy.random.default_rng(0); prompt lengths
rng.integers(16, 257, N), then output lengths rng.integers(16, 129, N), then each prompt's token ids
rng.integers(100, vocab, plen) in request order; greedy, ignore_eos, max_tokens = its output length.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from pagedserve.common.gc_heap import frozen_heap
from pagedserve.common.sampling_params import SamplingParams

if TYPE_CHECKING:  # torch loads when a bench runs, not when the command line is parsed
    import torch


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def make_workload(num_prompts: int, vocab_size: int, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    plens = rng.integers(16, 257, num_prompts)
    olens = rng.integers(16, 129, num_prompts)
    prompts = [rng.integers(100, vocab_size, int(plen)).tolist() for plen in plens]
    return Workload(prompts, [int(o) for o in olens])


# ---- our engine ---------------------------------------------------------------------------------

def load_tokenizer(model_path: Path):
    """The model's tokenizer, or a stand-in with no special tokens (the bench only feeds ids)."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_path)
    except Exception:  # noqa: BLE001 - a folder without a tokenizer is fine here
        return SimpleNamespace(eos_token_id=None, pad_token_id=None)


def build_engine(args, model_path: Path, tokenizer):
    from pagedserve.engine import LLMEngine, engine_config_from_args

    config = engine_config_from_args(args, progress=False)
    config.model = str(model_path)
    return LLMEngine(config, tokenizer=tokenizer)


def request_params(args, work: Workload) -> list[SamplingParams]:
    """One request's settings per prompt: greedy (ignore_eos, max_tokens its output length), or sampled at
    --temperature with --top-p / --top-k; either with --repetition-penalty, --presence-penalty and
    --frequency-penalty."""
    temperature = getattr(args, "temperature", 0.0)
    penalties = {name: getattr(args, name) for name in ("repetition_penalty", "presence_penalty", "frequency_penalty")
                 if hasattr(args, name)}
    if temperature <= 0.0:
        return [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o, **penalties) for o in work.output_lens]
    return [SamplingParams(temperature=temperature, top_p=args.top_p, top_k=args.top_k, ignore_eos=True, max_tokens=o,
                           **penalties) for o in work.output_lens]


def run_engine(engine, work: Workload, params: list[SamplingParams] | None = None) -> dict:
    """Step the engine over the workload, timing it and sampling KV-block use after every step.
    params: one per request (default: greedy, ignore_eos, max_tokens its output length)."""
    bm = engine.scheduler.block_manager
    block_size = bm.block_size
    if params is None:
        params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o) for o in work.output_lens]
    ids = [f"bench-{i}" for i in range(len(work.prompts))]
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    preemptions0, steps0 = engine.scheduler.num_preemptions, engine.num_steps
    sum_blocks = sum_tokens = 0
    step_times: list[float] = []

    start = time.perf_counter()
    for rid, prompt, p in zip(ids, work.prompts, params):
        engine.add_request(rid, prompt, p)
    with frozen_heap():  # as LLMEngine.generate: no full collection rescans the model step after step
        while engine.has_unfinished():
            t0 = time.perf_counter()
            for out in engine.step():
                outputs[out.request_id].extend(t.token_id for t in out.new_tokens)
            step_times.append(time.perf_counter() - t0)
            # Freed blocks (prefix-cache entries included) sit in the free queue, so this counts
            # exactly the blocks held by live sequences.
            in_use = bm.num_total_blocks - bm.num_free_blocks
            if in_use:
                sum_blocks += in_use
                sum_tokens += sum(r.num_computed_tokens for r in engine.scheduler.running)
    elapsed = time.perf_counter() - start

    for i, rid in enumerate(ids):
        if len(outputs[rid]) != work.output_lens[i]:
            raise RuntimeError(f"request {i} produced {len(outputs[rid])} tokens, "
                               f"expected {work.output_lens[i]}")
    waste = 100.0 * (1.0 - sum_tokens / (sum_blocks * block_size)) if sum_blocks else 0.0
    return {"elapsed_s": elapsed, "kv_waste_pct": waste,
            "num_steps": engine.num_steps - steps0,
            "num_preemptions": engine.scheduler.num_preemptions - preemptions0,
            "step_times": step_times}


# ---- transformers baseline ----------------------------------------------------------------------

def load_hf_model(model_path: Path, dtype: torch.dtype, device: torch.device):

    from transformers import AutoModelForCausalLM

    kw = {}
    if not any(model_path.glob("*.safetensors")):
        ggufs = sorted(model_path.glob("*.gguf"))
        if ggufs:
            kw["gguf_file"] = ggufs[0].name
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **kw)
    model.to(device).eval()
    model.generation_config.eos_token_id = None  # ignore_eos
    return model


def hf_generate_chunk(model, prompts: list[list[int]], num_new: int, pad_id: int,
                      device: torch.device) -> torch.Tensor:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    with torch.inference_mode():
        out = model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False,
                             max_new_tokens=num_new, min_new_tokens=num_new, pad_token_id=pad_id,
                             eos_token_id=None)
    return out[:, width:]


def run_baseline(model_path: Path, dtype: torch.dtype, device: torch.device, work: Workload,
                 batch_sizes: list[int], pad_id: int) -> dict[int, float]:

    model = load_hf_model(model_path, dtype, device)
    hf_generate_chunk(model, [work.prompts[0][:8]], 2, pad_id, device)  # warm-up
    results: dict[int, float] = {}
    n = len(work.prompts)
    for bs in batch_sizes:
        chunks = [range(i, min(i + bs, n)) for i in range(0, n, bs)]
        start = time.perf_counter()
        for chunk in tqdm(chunks, desc=f"transformers bs={bs}", unit="batch"):
            num_new = max(work.output_lens[i] for i in chunk)
            gen = hf_generate_chunk(model, [work.prompts[i] for i in chunk], num_new, pad_id, device)
            if gen.shape[1] != num_new:
                raise RuntimeError(f"transformers generated {gen.shape[1]} tokens, expected {num_new}")
        elapsed = time.perf_counter() - start
        # Only the tokens each request asked for are useful; the rest of its row is padding work.
        results[bs] = work.num_output_tokens / elapsed
    del model
    return results


# ---- entry point --------------------------------------------------------------------------------

def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_throughput(args) -> dict:
    import torch

    from pagedserve.model_files.default_model import resolve_model

    torch.manual_seed(0)
    model_path = resolve_model(args.model, args.revision)
    tokenizer = load_tokenizer(model_path)
    engine = build_engine(args, model_path, tokenizer)
    work = make_workload(args.num_prompts, engine.model_config.vocab_size)

    # Warm-up: one tiny request, outside the timed region.
    engine.generate([[100 + i for i in range(8)]], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4))
    profiler = None
    cuda_profile = getattr(args, "profile", False) and engine.device.type == "cuda"
    if getattr(args, "profile", False) and not cuda_profile:
        if engine.ranks is not None:
            raise ValueError("--profile times one process's steps: use it with --tensor-parallel-size 1")
        from pagedserve.worker.step_profile import StepProfiler
        profiler = StepProfiler(engine.runner).install()
        engine.overlaps = False  # it times each step whole (ModelRunner.execute), one after the other
    cpu_start = time.process_time()
    ours = run_engine(engine, work, request_params(args, work))
    cpu_s = time.process_time() - cpu_start  # on a shared machine, with 1 thread, the comparable number
    rss = rss_mib()
    if profiler is not None:
        profiler.remove()
    phases = None
    if cuda_profile:
        from pagedserve.bench.cuda_profile import profile_phases
        phases = profile_phases(engine)
    dtype, device = engine.dtype, engine.device
    quantization, weights = engine.runner.quantization, engine.runner.weights_description
    block_size = engine.scheduler.block_manager.block_size
    engine.close()
    del engine

    elapsed = ours["elapsed_s"]
    out_tps = work.num_output_tokens / elapsed
    total_tps = (work.num_prompt_tokens + work.num_output_tokens) / elapsed
    print(f"pagedserve: {work.num_output_tokens} output tokens in {elapsed:.2f} s ({out_tps:.1f} tok/s), "
          f"{ours['num_steps']} steps", flush=True)

    baseline: dict[int, float] = {}
    if not args.no_baseline:
        pad_id = getattr(tokenizer, "pad_token_id", None)
        baseline = run_baseline(model_path, dtype, device, work, list(args.baseline_batch_sizes),
                                pad_id if pad_id is not None else 0)
    best = max(baseline.values()) if baseline else None

    result = {
        "output_tokens_per_s": out_tps,
        "total_tokens_per_s": total_tps,
        "baseline_output_tokens_per_s": best,
        "baseline_by_batch_size": {str(k): v for k, v in baseline.items()},
        "ratio_vs_transformers": out_tps / best if best else None,
        "kv_waste_pct": ours["kv_waste_pct"],
        "num_requests": len(work.prompts),
        "num_prompt_tokens": work.num_prompt_tokens,
        "num_output_tokens": work.num_output_tokens,
        "elapsed_s": elapsed,
        "dtype": str(dtype).removeprefix("torch."),
        "quantization": quantization,
        "linear_weights": weights,
        "cpu_s": cpu_s,
        "output_tokens_per_cpu_s": work.num_output_tokens / cpu_s,
        "rss_mib": rss,
        "model": str(args.model) if args.model else str(model_path),
        "num_steps": ours["num_steps"],
        "num_preemptions": ours["num_preemptions"],
        "torch_threads": torch.get_num_threads(),
        "cpu": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
    }
    if profiler is not None:
        result["profile"] = {"matmul_flops_per_s": profiler.mm_rate, "memory_bytes_per_s": profiler.bandwidth,
                             "kinds": profiler.rows()}
    if phases is not None:
        result["cuda_profile"] = [dict(vars(p), busy_share=p.busy_share) for p in phases]
    print_table(result, block_size)
    if profiler is not None:
        profiler.print_table()
    if phases is not None:
        from pagedserve.bench.cuda_profile import print_phases
        print_phases(phases)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


def print_table(r: dict, block_size: int) -> None:
    rows = [("requests", f"{r['num_requests']} ({r['num_prompt_tokens']} prompt + "
                         f"{r['num_output_tokens']} output tokens)"),
            ("model / dtype", f"{r['model']} / {r['dtype']}"),
            ("pagedserve output tok/s", f"{r['output_tokens_per_s']:.1f}"),
            ("pagedserve total tok/s", f"{r['total_tokens_per_s']:.1f}"),
            ("pagedserve elapsed", f"{r['elapsed_s']:.2f} s")]
    for bs, tps in r["baseline_by_batch_size"].items():
        rows.append((f"transformers bs={bs} output tok/s", f"{tps:.1f}"))
    if r["ratio_vs_transformers"] is not None:
        rows.append(("ratio vs best transformers", f"{r['ratio_vs_transformers']:.2f}x"))
    rows += [(f"KV waste (block size {block_size})", f"{r['kv_waste_pct']:.2f} %"),
             ("engine steps", str(r["num_steps"])),
             ("preemptions", str(r["num_preemptions"])),
             ("torch threads / cpu", f"{r['torch_threads']} / {r['cpu']}")]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
