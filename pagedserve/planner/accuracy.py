"""`pagedserve plan-accuracy`: the planner against the real thing, in one sitting.

Starts `pagedserve serve`'s services (as `bench services` does), then for each workload runs
`bench serve` against them and `pagedserve plan` on the profile with the same flags, and prints
the relative error of the plan's median TTFT, median TPOT and output throughput. Workloads (the
issue's): random 128/64 at concurrency 4 and 16, and the shared-prefix dataset at concurrency 16.

The profile's fixed costs, when it has none (calibrate's --step-overhead-ms and
--request-overhead-ms left at 0), are taken from the services during a warm-up run of 8 other
requests (fill_overheads). Each plan is made before its workload runs.

A benchmark, not a test: on a shared machine the real run's speed drifts; say so beside the numbers.
Writes <out-dir>/accuracy.json and <out-dir>/plan_vs_real.html (html_report.py).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pagedserve.common.engine_args import add_engine_args

WORKLOADS = (
    ("random 128/64 c4", ["--dataset", "random", "--input-len", "128", "--output-len", "64", "--max-concurrency", "4"]),
    ("random 128/64 c16", ["--dataset", "random", "--input-len", "128", "--output-len", "64",
                           "--max-concurrency", "16"]),
    ("prefix 4x8 256+32 /64 c16", ["--dataset", "prefix", "--output-len", "64", "--max-concurrency", "16"]),
)
METRICS = (("median TTFT (ms)", lambda r: r["ttft_ms"]["median"]),
           ("median TPOT (ms)", lambda r: r["tpot_ms"]["median"]),
           ("output throughput (tok/s)", lambda r: r["output_throughput"]))


def add_accuracy_parser(sub) -> None:
    p = sub.add_parser("plan-accuracy", help="the planner's predictions beside real bench serve runs (a benchmark)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True, metavar="FILE", help="from `pagedserve calibrate`")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="workload i draws its prompts with seed + i")
    p.add_argument("--workloads", default=None, help="comma-separated indices of the workloads to run (default all)")
    p.add_argument("--redis-url", default=None, help="default: a private redis-server, as `pagedserve serve`")
    p.add_argument("--out-dir", default="plan-accuracy-out")
    p.add_argument("--json", default=None, metavar="FILE")
    add_engine_args(p)

    def run(args):
        return run_accuracy(args)

    p.set_defaults(func=run)


def serve_args(base_url: str, flags: list[str]) -> argparse.Namespace:
    from pagedserve.bench.serve import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", "--base-url", base_url, "--disable-tqdm", *flags])


def compare(plan: dict, real: dict) -> dict:
    rows = {}
    for name, get in METRICS:
        p, r = get(plan), get(real)
        rows[name] = {"plan": p, "real": r, "error": (p - r) / r if p is not None and r else None}
    return rows


def fill_overheads(profile, before, after, elapsed: float, warm: dict) -> None:
    """The fixed costs the profile leaves at 0, from the warm-up run on the services: per step, the
    step loop's busy time beyond the worker's compute (the scheduler's Python, the round trip, the
    publishing of tokens); per request, the first token's path outside the scheduler (gateway,
    tokenizer, network and the client, from bench serve's TTFT breakdown)."""
    steps = after.num_steps - before.num_steps
    if profile.step_overhead_s == 0 and steps > 0:
        busy = elapsed - (after.idle_seconds_total - before.idle_seconds_total)
        worker = after.worker_busy_seconds_total - before.worker_busy_seconds_total
        # At least the round trip: the busy-time difference is noisy where steps are few.
        profile.step_overhead_s = max(after.step_rtt_median_s, (busy - worker) / steps)
        print(f"per-step overhead from the services: {1e3 * profile.step_overhead_s:.2f} ms "
              f"(round trip alone: {1e3 * after.step_rtt_median_s:.2f} ms)", flush=True)
    breakdown = warm.get("ttft_breakdown_ms") or {}
    if profile.request_overhead_s == 0 and breakdown:
        ms = sum(breakdown.get(k, 0.0) for k in ("gateway", "tokenizer", "network", "client_overhead"))
        profile.request_overhead_s = max(0.0, ms) / 1e3
        print(f"per-request overhead from the services: {ms:.2f} ms", flush=True)


def run_accuracy(args) -> dict:
    import httpx

    from pagedserve.bench.serve import run_serve_bench
    from pagedserve.bench.sides import scheduler_stats, start_services
    from pagedserve.model_files.default_model import resolve_model
    from pagedserve.planner.cost_model import Profile
    from pagedserve.planner.html_report import write_html
    from pagedserve.planner.plan import engine_values, simulate, workload_config
    from pagedserve.planner.trace import from_dataset

    profile = Profile.load(args.profile)
    chosen = [WORKLOADS[int(i)] for i in args.workloads.split(",")] if args.workloads else list(WORKLOADS)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model(args.model)
    rows = []
    with start_services(args, model_path) as stack:
        model = httpx.get(stack.http_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        warm = serve_args(stack.http_url, ["--model", model, "--num-prompts", "8", "--seed", "1000",
                                           "--input-len", "128", "--output-len", "16", "--max-concurrency", "4"])
        before, started = scheduler_stats(stack), time.perf_counter()
        warm_result = run_serve_bench(warm)
        after, elapsed = scheduler_stats(stack), time.perf_counter() - started
        fill_overheads(profile, before, after, elapsed, warm_result)
        for index, (name, flags) in enumerate(chosen):
            # Each workload its own prompts (seed): one run's prompts would be the next one's cache hits.
            ns = serve_args(stack.http_url, ["--model", model, "--num-prompts", str(args.num_prompts),
                                             "--seed", str(args.seed + index), *flags])
            ns.profile_model, ns.trace = model, None
            trace = from_dataset(ns, None)
            plan = simulate(profile, engine_values(args), trace, ns.max_concurrency, ns.request_rate, None, None,
                            workload_config(ns, trace))
            print(f"=== {name}: real run", flush=True)
            real = run_serve_bench(ns)
            rows.append({"workload": name, "flags": flags, "comparison": compare(plan, real), "plan": plan,
                         "real": real})
    print(f"{'workload':<28}{'metric':<28}{'plan':>10}{'real':>10}{'error':>9}")
    for row in rows:
        for metric, c in row["comparison"].items():
            err = "n/a" if c["error"] is None else f"{100 * c['error']:+.1f}%"
            print(f"{row['workload']:<28}{metric:<28}{c['plan'] or 0:>10.1f}{c['real'] or 0:>10.1f}{err:>9}")
    summary = {"profile": args.profile, "num_prompts": args.num_prompts,
               "step_overhead_ms": 1e3 * profile.step_overhead_s,
               "request_overhead_ms": 1e3 * profile.request_overhead_s, "rows": rows}
    (out_dir / "accuracy.json").write_text(json.dumps(summary, indent=2))
    html = write_html(out_dir / "plan_vs_real.html", [(r["workload"], r["plan"], r["real"]) for r in rows])
    print(f"wrote {out_dir / 'accuracy.json'} and {html}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return summary
