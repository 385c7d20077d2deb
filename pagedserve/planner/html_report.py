"""A static HTML page that shows plans beside real runs: for each pair (a `pagedserve plan --json`
result and a `bench serve --json` result of the same workload), every figure both report, side by
side with the plan's relative error, a bar chart of the headline figures (matplotlib, inlined as a
PNG) and the plan's own view (KV usage over time, waiting reasons). One self-contained file: no
server, no script. `pagedserve plan --compare REAL.json` and `pagedserve plan-accuracy` write it.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

ROWS = [("Successful requests", "completed", None), ("Duration (s)", "duration_s", None),
        ("Request throughput (req/s)", "request_throughput", None),
        ("Output throughput (tok/s)", "output_throughput", None),
        ("Total token throughput (tok/s)", "total_token_throughput", None), ("Goodput (req/s)", "goodput", None),
        ("Prefix cache hit rate", "prefix_cache_hit_rate", None)]
ROWS += [(f"{label} {stat} (ms)", key, stat) for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"),
                                                                  ("itl_ms", "ITL"), ("e2el_ms", "E2EL"))
         for stat in ("mean", "median", "p90", "p99")]
STYLE = ("body{font-family:system-ui,sans-serif;margin:2em;max-width:70em}table{border-collapse:collapse;"
         "margin:1em 0}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}th{background:#f4f4f4}"
         "td:first-child{text-align:left}.bad{color:#b00}.ok{color:#070}")


def _value(result: dict, key: str, stat: str | None):
    value = result.get(key)
    return value.get(stat) if stat and isinstance(value, dict) else value


def _fmt(value) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3f}" if isinstance(value, float) and abs(value) < 10 else (
        f"{value:.1f}" if isinstance(value, float) else str(value))


def _chart(pairs: list[tuple[str, dict, dict]]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    width = 0.38
    xs = list(range(len(pairs)))
    for ax, (title, get) in zip(axes, (("median TTFT (ms)", lambda r: r["ttft_ms"]["median"]),
                                       ("median TPOT (ms)", lambda r: r["tpot_ms"]["median"]),
                                       ("output throughput (tok/s)", lambda r: r["output_throughput"]))):
        ax.bar([x - width / 2 for x in xs], [get(p) or 0 for _, p, _ in pairs], width, label="plan")
        ax.bar([x + width / 2 for x in xs], [get(r) or 0 for _, _, r in pairs], width, label="real")
        ax.set_xticks(xs, [name for name, _, _ in pairs], fontsize=7, rotation=15)
        ax.set_title(title)
        ax.legend()
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def section(name: str, plan: dict, real: dict) -> str:
    out = [f"<h2>{html.escape(name)}</h2><table><tr><th>figure</th><th>plan</th><th>real</th><th>plan error</th></tr>"]
    for label, key, stat in ROWS:
        p, r = _value(plan, key, stat), _value(real, key, stat)
        if p is None and r is None:
            continue
        err = ""
        if isinstance(p, (int, float)) and isinstance(r, (int, float)) and r:
            e = (p - r) / r
            err = f"<span class={'ok' if abs(e) <= 0.2 else 'bad'}>{100 * e:+.1f}%</span>"
        out.append(f"<tr><td>{label}</td><td>{_fmt(p)}</td><td>{_fmt(r)}</td><td>{err}</td></tr>")
    out.append("</table>")
    extra = plan.get("planner")
    if extra:
        waits = ", ".join(f"{k}: {v:.1f}" for k, v in extra["waiting_request_seconds"].items()) or "none"
        usage = extra["kv_usage_over_time"]
        points = " ".join(f"{40 + 560 * t / (usage[-1][0] or 1):.1f},{140 - 120 * u:.1f}" for t, u in usage)
        out.append(f"<p>plan: {extra['num_steps']} steps, mean {extra['mean_step_ms']:.1f} ms of "
                   f"{extra['mean_step_tokens']:.0f} tokens; {extra['num_preemptions']} preemptions; KV usage peak "
                   f"{100 * extra['kv_usage_peak']:.0f}%; waiting request-seconds by reason: {waits}</p>")
        out.append('<svg width="620" height="160" style="border:1px solid #ddd"><text x="5" y="15" font-size="11">'
                   f'KV usage over time (0-100%)</text><polyline fill="none" stroke="#36c" points="{points}"/></svg>')
    return "\n".join(out)


def write_html(path: str | Path, pairs: list[tuple[str, dict, dict]]) -> Path:
    body = [f"<!doctype html><html><head><meta charset=utf-8><title>pagedserve: plan vs real</title>"
            f"<style>{STYLE}</style></head><body><h1>Plan vs real run</h1>"
            "<p>Plan: <code>pagedserve plan</code> (the real scheduler in virtual time on a calibrated cost model). "
            "Real: <code>pagedserve bench serve</code> against <code>pagedserve serve</code>. Errors within 20% "
            "are green.</p>"]
    if pairs:
        body.append(f'<img alt="plan vs real" src="data:image/png;base64,{_chart(pairs)}">')
    body.extend(section(name, plan, real) for name, plan, real in pairs)
    body.append("</body></html>")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(body), encoding="utf-8")
    return path
