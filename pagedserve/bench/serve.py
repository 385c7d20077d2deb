"""`pagedserve bench serve`: a load generator against any OpenAI-compatible endpoint (ours or
another server's), in the manner of vLLM's serving benchmark.

Every request streams (SSE) with temperature 0, max_tokens = its output length, ignore_eos and
stream_options.include_usage; it also asks for `"timings": true`, which our gateway answers with a
`timings` object in the final chunk (the server's TTFT and its breakdown by stage). Load is either
Poisson arrivals at --request-rate (seeded; inf sends everything at once) or a closed loop of
--max-concurrency clients, or both. Per request: TTFT (send -> first content chunk), ITL (gaps
between content chunks), TPOT ((e2e - ttft) / (output tokens - 1)), end-to-end latency, output
tokens (the server's usage when given, else the chunk count), and failures (HTTP errors, errors in
the stream and exceptions are counted, never raised).

Datasets:
  random    prompts of --input-len tokens, outputs of --output-len, both uniform in
            [len*(1-r), len*(1+r)] for --range-ratio r. With a tokenizer (--tokenizer, or the
            model id when it is a local folder or one pagedserve prepared) the prompt is a list
            of random token ids (exact length on /v1/completions); without one it is text of
            random common words. Input
            lengths reported are the server's usage.prompt_tokens whenever it gives them.
  prefix    --num-prefixes shared prefixes of --prefix-len x --suffixes-per-prefix suffixes of
            --suffix-len, shuffled: exercises prefix caching.
  grounded  repeat a piece of code with one change (bench/grounded.py): outputs copy their prompts,
            the workload of n-gram speculation (--speculative-config on the server); with it the
            report adds the run's spec decode acceptance rate and mean acceptance length
  sharegpt  --dataset-path FILE, a JSON list or JSONL of {"conversations": [{"from": "human",
            "value": ...}, {"from": "gpt", ...}]}: the first human turn is the prompt and the reply
            after it sets max_tokens (its token count with a tokenizer, else words x 1.3).

--sweep rates:1,2,4,inf or --sweep concurrency:1,4,16 runs the dataset at each load level (level i
draws its prompts with seed + i: the same distribution, fresh prompts, so no level gets the previous
one's prefix-cache hits) and
writes <out-dir>/sweep.json and PNG plots (throughput, TTFT and TPOT percentiles vs load).
"""

# This module is the command (its parser, a run, the report and the sweep's plots); the requests come
# from serve_datasets, and the client that sends them and sums up the results from serve_client.

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from pathlib import Path

import numpy as np

from pagedserve.bench.serve_client import (aggregate, prefix_hit_rates, read_prefix_cache_counters, read_spec_counters,
                                           request_body, spec_rates,
                                           resolve_model, run_requests)
from pagedserve.bench.serve_datasets import BenchRequest, build_dataset, load_tokenizer

METRICS_SHARED_S = 0.6  # a little over how long pagedserve's gateway shares one /metrics answer


# ---- CLI ----------------------------------------------------------------------------------------

def parse_rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"the request rate must be positive or inf, got {text!r}")
    return rate


def parse_sweep(text: str) -> tuple[str, list[float]]:
    kind, _, values = text.partition(":")
    kind = {"rate": "rates", "rates": "rates", "concurrency": "concurrency"}.get(kind.strip())
    if kind is None or not values.strip():
        raise argparse.ArgumentTypeError(f"--sweep takes rates:1,2,inf or concurrency:1,4,16, got {text!r}")
    try:
        levels = [float(v) for v in values.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--sweep: {e}") from None
    if not levels or any(not v > 0 for v in levels):
        raise argparse.ArgumentTypeError(f"--sweep levels must be positive, got {values!r}")
    if kind == "concurrency" and any(math.isinf(v) or v != int(v) for v in levels):
        raise argparse.ArgumentTypeError(f"--sweep concurrency levels must be integers, got {values!r}")
    return kind, levels


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload and SLO flags, shared with `pagedserve plan` (the planner replays the same draws)."""
    p.add_argument("--dataset", choices=["random", "prefix", "sharegpt", "grounded"], default="random")
    p.add_argument("--dataset-path", default=None, help="the ShareGPT JSON/JSONL file")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128, help="random dataset")
    p.add_argument("--output-len", type=int, default=128, help="random and prefix datasets")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random lengths uniform in len*(1 -/+ r)")
    p.add_argument("--num-prefixes", type=int, default=4, help="prefix dataset")
    p.add_argument("--suffixes-per-prefix", type=int, default=8, help="prefix dataset")
    p.add_argument("--prefix-len", type=int, default=256, help="prefix dataset")
    p.add_argument("--suffix-len", type=int, default=32, help="prefix dataset")
    p.add_argument("--request-rate", type=parse_rate, default=math.inf,
                   help="Poisson arrivals per second (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival times (1 = Poisson; <1 burstier, >1 more regular)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT at most this")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT at most this")


def add_serve_parser(bench_sub) -> None:
    p = bench_sub.add_parser("serve", help="load generator against an OpenAI-compatible endpoint (vLLM style)",
                             description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer (path or name) for token-id prompts and ShareGPT lengths; default: the "
                        "model id when it is a local folder or a model pagedserve prepared, else none "
                        "(text prompts)")
    add_workload_args(p)
    p.add_argument("--num-warmups", type=int, default=0, help="requests sent (unmeasured) before the run")
    p.add_argument("--plain-openai", action="store_true",
                   help="leave out the fields only vLLM-like servers know (ignore_eos, timings)")
    p.add_argument("--timeout", type=float, default=3600.0, help="per-request timeout, seconds")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--sweep", type=parse_sweep, nargs="?", default=None, const=("concurrency", [1.0, 4.0, 16.0, 64.0]),
                   metavar="rates:1,2,inf|concurrency:1,4,16",
                   help="run at each load level and plot; alone: concurrency:1,4,16,64")
    p.add_argument("--out-dir", default="bench-serve-out", help="where --sweep writes sweep.json and the plots")
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON here")
    p.add_argument("--record-trace", default=None, metavar="FILE.jsonl",
                   help="write the run's requests as a trace `pagedserve plan --trace` replays")
    p.set_defaults(func=run_serve_bench)


# ---- a run and its report -----------------------------------------------------------------------

def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def print_report(result: dict) -> None:
    line = "=" * 60
    rows = [("Successful requests:", result["completed"]), ("Failed requests:", result["failed"]),
            ("Request rate (configured):", result["request_rate"]),
            ("Max concurrency:", result["max_concurrency"]),
            ("Benchmark duration (s):", _fmt(result["duration_s"])),
            ("Total input tokens:", result["total_input_tokens"]),
            ("Total generated tokens:", result["total_output_tokens"]),
            ("Request throughput (req/s):", _fmt(result["request_throughput"])),
            ("Output token throughput (tok/s):", _fmt(result["output_throughput"])),
            ("Total token throughput (tok/s):", _fmt(result["total_token_throughput"]))]
    if result["goodput"] is not None:
        rows.append(("Request goodput (req/s):", _fmt(result["goodput"])))
    if result["prefix_cache_hit_rate"] is not None:
        rows.append(("Prefix cache hit rate:", f"{100 * result['prefix_cache_hit_rate']:.1f}%"))
    for replica, rate in sorted((result.get("prefix_cache_hit_rate_by_replica") or {}).items()):
        rows.append((f"  replica {replica}:", "n/a" if rate is None else f"{100 * rate:.1f}%"))
    spec = result.get("spec_decode")
    if spec is not None:
        drafted = spec["num_drafts"] > 0  # none: turned down (disable_by_batch_size, back-off)
        rows += [("Spec decode drafts:", int(spec["num_drafts"])),
                 ("Spec decode acceptance rate:", f"{100 * spec['acceptance_rate']:.1f}%" if drafted else "n/a"),
                 ("Spec decode mean acceptance length:",
                  f"{spec['mean_acceptance_length']:.2f}" if drafted else "n/a")]
    print(f"{' Serving Benchmark Result ':=^60}")
    for label, value in rows:
        print(f"{label:<40}{value!s:>20}")
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        short = key.removesuffix("_ms").upper()
        print(f"{' ' + title + ' ':-^60}")
        s = result[key]
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            print(f"{f'{label} {short} (ms):':<40}{_fmt(s[stat]):>20}")
    breakdown = result["ttft_breakdown_ms"]
    if breakdown:
        print(f"{' Where did my first token go (mean ms) ':-^60}")
        total = result["ttft_ms"]["mean"] or 0.0
        for stage, value in breakdown.items():
            share = f"{100 * value / total:5.1f}%" if total else ""
            print(f"{stage:<40}{value:>12.2f}{share:>8}")
        print(f"{'client TTFT (mean)':<40}{total:>12.2f}")
    for error in result["errors"][:3]:
        print(f"failed: {error}")
    print(line)


def run_once(args, model: str, requests: list[BenchRequest], tokenizer, request_rate: float,
             max_concurrency: int | None, progress: bool) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    bodies = [request_body(q, model, args.endpoint, args.plain_openai, tokenizer) for q in requests]
    with httpx.Client(timeout=30) as http_sync:
        before = read_prefix_cache_counters(http_sync, args.base_url, headers)
        spec_before = read_spec_counters(http_sync, args.base_url, headers)
        results, duration = asyncio.run(run_requests(
            args.base_url, args.endpoint, bodies, headers, request_rate, max_concurrency, args.seed,
            args.burstiness, args.timeout, progress))
        # our gateway answers /metrics from a copy shared for ~0.5 s: a run shorter than that would read
        # `before` again; wait it out (outside the timed run)
        time.sleep(METRICS_SHARED_S)
        after = read_prefix_cache_counters(http_sync, args.base_url, headers)
        spec_after = read_spec_counters(http_sync, args.base_url, headers)
    result = aggregate(results, requests, duration, args.slo_ttft_ms, args.slo_tpot_ms)
    # Overall and per engine replica (a `replica` label on the counters; docs/scale-out.md).
    result["prefix_cache_hit_rate"], result["prefix_cache_hit_rate_by_replica"] = prefix_hit_rates(before, after)
    result["spec_decode"] = spec_rates(spec_before, spec_after)
    result.update(request_rate="inf" if math.isinf(request_rate) else request_rate,
                  max_concurrency=max_concurrency)
    return result


def run_serve_bench(args) -> dict:
    import httpx

    args.base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model
    if model is None:
        with httpx.Client(timeout=30) as http_sync:
            model = resolve_model(http_sync, args.base_url, headers)
    tokenizer = load_tokenizer(args.tokenizer, model)
    requests, prompt_format = build_dataset(args, tokenizer)
    config = {"base_url": args.base_url, "model": model, "endpoint": args.endpoint, "dataset": args.dataset,
              "dataset_path": args.dataset_path, "num_prompts": len(requests), "prompt_format": prompt_format,
              "input_len": args.input_len, "output_len": args.output_len, "range_ratio": args.range_ratio,
              "num_prefixes": args.num_prefixes, "suffixes_per_prefix": args.suffixes_per_prefix,
              "prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "burstiness": args.burstiness,
              "seed": args.seed, "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms}
    if args.num_warmups > 0:
        warm = requests[:args.num_warmups]
        run_once(args, model, warm, tokenizer, math.inf, args.max_concurrency, progress=False)
    if args.sweep is None:
        result = {**run_once(args, model, requests, tokenizer, args.request_rate, args.max_concurrency,
                             progress=not args.disable_tqdm), **config}
        print_report(result)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
        if getattr(args, "record_trace", None):
            write_trace(args.record_trace, requests, result, args)
        return result

    kind, levels = args.sweep
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    per_level = []
    base_seed = args.seed
    for index, level in enumerate(levels):
        rate = level if kind == "rates" else args.request_rate
        concurrency = int(level) if kind == "concurrency" else args.max_concurrency
        if index:
            # Fresh prompts of the same distribution at each level: repeating the previous level's
            # prompts would turn every prefill into a prefix-cache hit and flatter the later levels.
            args.seed = base_seed + index
            requests, _ = build_dataset(args, tokenizer)
        print(f"--- {kind} {_level_label(level)}", flush=True)
        result = {**run_once(args, model, requests, tokenizer, rate, concurrency, progress=not args.disable_tqdm),
                  **config, "seed": args.seed, "sweep_kind": kind, "sweep_level": _level_label(level)}
        print_report(result)
        per_level.append(result)
    (out_dir / "sweep.json").write_text(json.dumps(per_level, indent=2))
    plots = plot_sweep(per_level, kind, out_dir)
    summary = {"sweep_kind": kind, "levels": [_level_label(v) for v in levels], "results": per_level,
               "out_dir": str(out_dir), "plots": [str(p) for p in plots], **config}
    print(f"wrote {out_dir / 'sweep.json'} and {', '.join(p.name for p in plots)}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return summary


def write_trace(path: str, requests: list[BenchRequest], result: dict, args) -> None:
    """The run as a planner trace (pagedserve/planner/trace.py): each request's send time as the
    arrival process drew it, its prompt (token ids when it was sent as ids) and the tokens it got."""
    from pagedserve.bench.serve_client import arrival_gaps

    arrivals = np.cumsum(arrival_gaps(len(requests), args.request_rate, args.seed, args.burstiness)).tolist()
    with open(path, "w", encoding="utf-8") as f:
        for arrival, req, got in zip(arrivals, requests, result["requests"]):
            line = {"arrival_s": arrival, "prompt_tokens": got["prompt_tokens"] or req.prompt_len,
                    "output_tokens": got["output_tokens"] or req.output_len}
            if isinstance(req.prompt, list):
                line["prompt_token_ids"] = req.prompt
            f.write(json.dumps(line) + "\n")


def _level_label(level: float) -> str:
    return "inf" if math.isinf(level) else (str(int(level)) if level == int(level) else str(level))


# ---- plots --------------------------------------------------------------------------------------

def plot_sweep(results: list[dict], kind: str, out_dir: Path) -> list[Path]:
    """throughput.png, ttft.png and tpot.png against the load levels (evenly spaced: inf is one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["sweep_level"] for r in results]
    xs = list(range(len(results)))
    xlabel = "request rate (req/s)" if kind == "rates" else "max concurrency"
    paths = []

    def finish(fig, ax, title: str, ylabel: str, name: str) -> None:
        ax.set_xticks(xs, labels)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    left.plot(xs, [r["request_throughput"] for r in results], "o-", label="completed requests/s")
    for ax in (left, right):
        ax.set_xticks(xs, labels)
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
    left.set_ylabel("requests/s")
    left.set_title("Request throughput vs load")
    left.legend()
    right.plot(xs, [r["output_throughput"] for r in results], "o-", color="tab:green", label="output tokens/s")
    right.plot(xs, [r["total_token_throughput"] for r in results], "s--", color="tab:gray",
               label="total (input + output) tokens/s")
    finish(fig, right, "Token throughput vs load", "tokens/s", "throughput.png")

    for key, title, name in (("ttft_ms", "TTFT vs load", "ttft.png"), ("tpot_ms", "TPOT vs load", "tpot.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for stat, marker in (("median", "o-"), ("p90", "s-"), ("p99", "^-")):
            ys = [r[key][stat] if r[key][stat] is not None else float("nan") for r in results]
            ax.plot(xs, ys, marker, label=stat if stat != "median" else "p50")
        finish(fig, ax, title, key.replace("_ms", " (ms)").upper().replace("(MS)", "(ms)"), name)
    return paths
