"""`pagedserve bench tp`: the same offline workload on one rank and on N tensor-parallel ranks.

Both engines stay loaded and their runs alternate, because this machine's speed drifts between
runs; only pairs run back to back compare. Each engine gets the machine's cores divided among
its ranks. On a 2-core CPU two ranks are expected to be slower (each step adds two all_reduces
per layer over gloo, and each rank's matmuls run on one core): the point is the measurement.
"""

from __future__ import annotations

import json
import statistics

from pagedserve.bench.throughput import build_engine, load_tokenizer, make_workload, run_engine
from pagedserve.common.engine_args import add_engine_args
from pagedserve.common.sampling_params import SamplingParams


def add_tp_parser(bench_sub) -> None:
    p = bench_sub.add_parser("tp", help="tensor-parallel ranks vs one rank, alternating runs", description=__doc__)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, metavar="FILE")
    add_engine_args(p)
    p.set_defaults(func=run_tp_bench, tensor_parallel_size=2)


def run_tp_bench(args) -> dict:
    import torch

    from pagedserve.model_files.default_model import resolve_model

    model_path = resolve_model(args.model, args.revision)
    tokenizer = load_tokenizer(model_path)
    ranks = args.tensor_parallel_size
    if ranks < 2:
        raise SystemExit("bench tp compares --tensor-parallel-size N (N >= 2) against one rank")
    cores = torch.get_num_threads()
    args.tensor_parallel_size = 1
    single = build_engine(args, model_path, tokenizer)
    args.tensor_parallel_size = ranks
    parallel = build_engine(args, model_path, tokenizer)
    threads = {1: cores, ranks: torch.get_num_threads()}  # LocalRanks divided the cores among its ranks
    work = make_workload(args.num_prompts, single.model_config.vocab_size)
    warmup = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)
    runs: dict[int, list[float]] = {1: [], ranks: []}
    try:
        for engine, size in ((single, 1), (parallel, ranks)):
            torch.set_num_threads(threads[size])
            engine.generate([[100 + i for i in range(8)]], warmup)
        for repeat in range(args.repeats):
            for engine, size in ((single, 1), (parallel, ranks)):
                torch.set_num_threads(threads[size])
                elapsed = run_engine(engine, work)["elapsed_s"]
                runs[size].append(work.num_output_tokens / elapsed)
            print(f"run {repeat + 1}: 1 rank {runs[1][-1]:.1f} out tok/s, {ranks} ranks {runs[ranks][-1]:.1f} "
                  f"({runs[ranks][-1] / runs[1][-1]:.2f}x)", flush=True)
    finally:
        parallel.close()
        torch.set_num_threads(cores)
    ratios = [p / s for s, p in zip(runs[1], runs[ranks])]
    result = {"tensor_parallel_size": ranks, "dtype": str(single.dtype).removeprefix("torch."),
              "num_prompts": args.num_prompts, "num_output_tokens": work.num_output_tokens,
              "one_rank_output_tok_s": runs[1], f"{ranks}_ranks_output_tok_s": runs[ranks],
              "median_ratio": statistics.median(ratios), "threads_per_rank": {str(k): v for k, v in threads.items()}}
    print(f"median: {ranks} ranks / 1 rank = {result['median_ratio']:.2f}x "
          f"({statistics.median(runs[ranks]):.1f} vs {statistics.median(runs[1]):.1f} out tok/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result
