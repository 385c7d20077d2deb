"""`pagedserve bench moe`: one MoE layer (router, float32 softmax top-k with renormalisation, and
the routed experts of moe.FusedMoE) on random weights, through the grouped backend (tokens sorted
by expert, one matmul pair per expert) and the naive one (a loop over tokens and their experts).

The two are timed alternately for several rounds (a busy machine then slows both alike); each
round times enough calls to last --min-time seconds, and the table reports the medians of the
per-call times and their ratio, and the largest difference between the two outputs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads when the bench runs, not when the command line is parsed
    import torch

DTYPES = ("float32", "bfloat16", "float16")


def parse_ints(text: str) -> list[int]:
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def parse_dtypes(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names or any(n not in DTYPES for n in names):
        raise argparse.ArgumentTypeError(f"expected comma-separated dtypes among {', '.join(DTYPES)}, got {text!r}")
    return names


def add_moe_parser(bench_sub) -> None:
    p = bench_sub.add_parser("moe", help="one MoE layer: grouped vs naive per-token experts",
                             description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--intermediate-size", type=int, default=1408, help="each expert's")
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=parse_ints, default=[16, 64, 256], help="comma-separated batch sizes")
    p.add_argument("--dtypes", type=parse_dtypes, default=["float32", "bfloat16"], help="comma-separated")
    p.add_argument("--rounds", type=int, default=5, help="alternating grouped / naive timings")
    p.add_argument("--min-time", type=float, default=0.2, help="seconds each timing lasts at least")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON here")
    p.set_defaults(func=run_moe_bench)


def make_layer(hidden: int, intermediate: int, num_experts: int, dtype: torch.dtype, seed: int):
    """A FusedMoE with random (variance-preserving) weights and its router weight."""
    import torch

    from pagedserve.worker.moe import FusedMoE, GroupedTorchMoE

    gen = torch.Generator().manual_seed(seed)
    layer = FusedMoE(num_experts, hidden, intermediate, GroupedTorchMoE(), reduce=False)
    with torch.no_grad():
        layer.w13.data = (torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) * hidden ** -0.5).to(dtype)
        layer.w2.data = (torch.randn(num_experts, hidden, intermediate, generator=gen) * intermediate ** -0.5).to(dtype)
    router = torch.randn(num_experts, hidden, generator=gen).to(dtype)
    return layer, router


def moe_forward(layer, router: torch.Tensor, hidden: torch.Tensor, top_k: int) -> torch.Tensor:
    import torch.nn.functional as F

    from pagedserve.worker.moe import softmax_topk

    weights, ids = softmax_topk(F.linear(hidden, router), top_k, renormalize=True)
    return layer(hidden, weights, ids)


def time_calls(fn, min_time: float) -> float:
    """Seconds per call: as many calls as fill min_time (at least one)."""
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_time:
            return elapsed / calls


def bench_case(num_tokens: int, dtype_name: str, args) -> dict:
    import torch

    from pagedserve.worker.moe import GroupedTorchMoE, NaiveTorchMoE

    dtype = getattr(torch, dtype_name)
    layer, router = make_layer(args.hidden_size, args.intermediate_size, args.num_experts, dtype, args.seed)
    gen = torch.Generator().manual_seed(args.seed + num_tokens)
    hidden = torch.randn(num_tokens, args.hidden_size, generator=gen).to(dtype)
    backends = {"grouped": GroupedTorchMoE(), "naive": NaiveTorchMoE()}
    outputs, times = {}, {name: [] for name in backends}

    def call(name):
        layer.backend = backends[name]
        return moe_forward(layer, router, hidden, args.top_k)

    for name in backends:  # warm up, and keep the outputs to compare
        outputs[name] = call(name).float()
    for _ in range(args.rounds):
        for name in backends:
            times[name].append(time_calls(lambda name=name: call(name), args.min_time))
    grouped, naive = statistics.median(times["grouped"]), statistics.median(times["naive"])
    return {"dtype": dtype_name, "tokens": num_tokens, "grouped_ms": grouped * 1e3, "naive_ms": naive * 1e3,
            "speedup": naive / grouped, "grouped_tokens_per_s": num_tokens / grouped,
            "max_abs_diff": (outputs["grouped"] - outputs["naive"]).abs().max().item(),
            "grouped_ms_all": [t * 1e3 for t in times["grouped"]], "naive_ms_all": [t * 1e3 for t in times["naive"]]}


def run_moe_bench(args) -> dict:
    import torch

    from pagedserve.bench.throughput import cpu_name

    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        with torch.inference_mode():
            cases = [bench_case(t, d, args) for d in args.dtypes for t in args.tokens]
        used_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    result = {"hidden_size": args.hidden_size, "intermediate_size": args.intermediate_size,
              "num_experts": args.num_experts, "top_k": args.top_k, "rounds": args.rounds,
              "min_time_s": args.min_time, "torch_threads": used_threads, "cpu": cpu_name(), "cases": cases}
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


def print_table(r: dict) -> None:
    print(f"MoE layer: hidden {r['hidden_size']}, intermediate {r['intermediate_size']}, {r['num_experts']} experts, "
          f"top-{r['top_k']}; medians of {r['rounds']} alternating rounds; "
          f"torch threads {r['torch_threads']}, cpu {r['cpu']}")
    header = ("dtype", "tokens", "grouped ms", "naive ms", "naive/grouped", "grouped tok/s", "max |diff|")
    rows = [(c["dtype"], str(c["tokens"]), f"{c['grouped_ms']:.3f}", f"{c['naive_ms']:.3f}", f"{c['speedup']:.1f}x",
             f"{c['grouped_tokens_per_s']:.0f}", f"{c['max_abs_diff']:.2e}") for c in r["cases"]]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
