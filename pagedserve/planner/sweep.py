"""`pagedserve plan --sweep KEY=V1,V2 ...`: simulate every combination of the engine budgets given,
rank them by goodput under the SLO (output throughput without one), explain the winner and plot.

The explanation reads the simulation: which budget held requests back (the scheduler's waiting
reasons, weighted by how long they waited: seq_budget is max_num_seqs, token_budget is
max_num_batched_tokens, no_blocks is the KV pool) and where the queue formed (in the scheduler's
waiting queue, or at the client, held by --max-concurrency). Writes <out-dir>/plan_sweep.json and
plan_sweep.png. No torch here.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from pagedserve.planner.plan import ENGINE_KEYS, engine_values, simulate

SWEEPABLE = ("max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold", "block_size",
             "kv_cache_memory", "max_model_len", "preemption_mode", "no_prefix_caching", "no_chunked_prefill")
BINDS = {"seq_budget": "max_num_seqs", "token_budget": "max_num_batched_tokens", "no_blocks": "the KV pool"}


def parse_sweep_item(text: str) -> tuple[str, list]:
    key, _, values = text.partition("=")
    key = key.strip().removeprefix("--").replace("-", "_")
    if key not in SWEEPABLE or not values.strip():
        raise ValueError(f"--sweep takes KEY=V1,V2 with KEY one of {', '.join(SWEEPABLE)}; got {text!r}")
    out = []
    for v in values.split(","):
        v = v.strip()
        if key in ("no_prefix_caching", "no_chunked_prefill"):
            out.append(v.lower() in ("1", "true", "yes", "on"))
        elif key in ("kv_cache_memory", "preemption_mode"):
            out.append(v)
        else:
            try:
                out.append(int(v))
            except ValueError:
                raise ValueError(f"--sweep {key}: {v!r} is not an integer") from None
    return key, out


def combinations(items: list[str]) -> list[dict]:
    parsed = dict(parse_sweep_item(t) for t in items)
    keys = list(parsed)
    return [dict(zip(keys, values)) for values in itertools.product(*(parsed[k] for k in keys))]


def label(overrides: dict) -> str:
    short = {"max_num_batched_tokens": "tokens", "max_num_seqs": "seqs", "long_prefill_token_threshold": "chunk",
             "kv_cache_memory": "kv", "block_size": "block", "max_model_len": "len"}
    return " ".join(f"{short.get(k, k)}={v}" for k, v in overrides.items())


def score(result: dict) -> float:
    return result["goodput"] if result["goodput"] is not None else result["output_throughput"]


def explain(best: dict, slo: bool) -> str:
    p = best["planner"]
    waits = {k: v for k, v in p["waiting_request_seconds"].items() if v > 0}
    lines = [f"winner: {best['sweep_label']} — "
             + (f"goodput {best['goodput']:.2f} req/s under the SLO" if slo else
                f"output throughput {best['output_throughput']:.1f} tok/s")]
    if waits:
        reason = max(waits, key=waits.get)
        total = sum(waits.values())
        lines.append(f"binding budget: {BINDS[reason]} ({100 * waits[reason] / total:.0f}% of the "
                     f"{total:.1f} request-seconds spent waiting in the scheduler)")
    else:
        lines.append("no budget binds: no request waited in the scheduler once it arrived")
    client = p["mean_client_wait_ms"]
    ttft = best["ttft_ms"]["median"] or 0.0
    where = ("at the client (--max-concurrency holds requests back: mean wait %.0f ms)" % client
             if client > 0.5 * ttft and client > 1 else
             "in the scheduler's waiting queue (mean %.1f waiting per step)" % p["mean_waiting"]
             if p["mean_waiting"] >= 0.5 else "nowhere to speak of (arrivals are served as they come)")
    lines.append(f"the queue forms {where}")
    lines.append(f"KV usage peak {100 * p['kv_usage_peak']:.0f}%, {p['num_preemptions']} preemptions, "
                 f"mean step {p['mean_step_ms']:.1f} ms of {p['mean_step_tokens']:.0f} tokens")
    return "\n".join(lines)


def plot(results: list[dict], out_dir: Path, slo: bool) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["sweep_label"].replace(" ", "\n") for r in results]
    xs = list(range(len(results)))
    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(max(12, 1.6 * len(results) * 3 / 2), 4.8))
    left.bar(xs, [score(r) for r in results], color="tab:green")
    left.set_title("goodput under the SLO (req/s)" if slo else "output throughput (tok/s)")
    for ax, key, title in ((mid, "ttft_ms", "TTFT (ms)"), (right, "tpot_ms", "TPOT (ms)")):
        for stat, marker in (("median", "o-"), ("p90", "s-"), ("p99", "^-")):
            ax.plot(xs, [r[key][stat] if r[key][stat] is not None else float("nan") for r in results], marker,
                    label="p50" if stat == "median" else stat)
        ax.set_title(title)
        ax.legend()
    for ax in (left, mid, right):
        ax.set_xticks(xs, labels, fontsize=7)
        ax.grid(True, alpha=0.3)
    fig.suptitle("pagedserve plan: simulated sweep")
    fig.tight_layout()
    path = out_dir / "plan_sweep.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run_sweep(args, profile, trace, config: dict) -> dict:
    base = engine_values(args)
    slo = args.slo_ttft_ms is not None or args.slo_tpot_ms is not None
    results = []
    for overrides in combinations(args.sweep):
        engine = {**base, **{k: v for k, v in overrides.items() if k in ENGINE_KEYS}}
        result = simulate(profile, engine, trace, args.max_concurrency, args.request_rate, args.slo_ttft_ms,
                          args.slo_tpot_ms, config)
        result.update(sweep_overrides=overrides, sweep_label=label(overrides))
        results.append(result)
    ranked = sorted(results, key=lambda r: (-score(r), r["ttft_ms"]["median"] or 0.0))
    print(f"{'rank':<6}{'configuration':<44}{'goodput' if slo else 'out tok/s':>10}{'TTFT p50':>10}{'TPOT p50':>10}")
    for rank, r in enumerate(ranked, 1):
        print(f"{rank:<6}{r['sweep_label']:<44}{score(r):>10.2f}{r['ttft_ms']['median'] or 0:>10.1f}"
              f"{r['tpot_ms']['median'] or 0:>10.1f}")
    explanation = explain(ranked[0], slo)
    print(explanation)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot(results, out_dir, slo)
    summary = {"ranked": [r["sweep_label"] for r in ranked], "winner": ranked[0]["sweep_overrides"],
               "explanation": explanation, "results": results, "plot": str(png), **config}
    (out_dir / "plan_sweep.json").write_text(json.dumps(summary, indent=2))
    print(f"wrote {out_dir / 'plan_sweep.json'} and {png.name}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return summary
