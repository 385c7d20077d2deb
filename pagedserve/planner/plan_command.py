"""`pagedserve plan`, the command: a simulation (plan.py), a sweep of budgets (sweep.py), the
KV-cache arithmetic (memory.py) or a page against a real run (html_report.py). It sits above all
of them, so none of them imports another's command (no cycle). No torch here.
"""

from __future__ import annotations

import json
from pathlib import Path

from pagedserve.planner.cost_model import Profile
from pagedserve.planner.plan import engine_values, load_workload, print_planner_lines, simulate, workload_config


def run_plan(args) -> dict | int:
    from pagedserve.bench.serve import print_report

    if args.memory:
        from pagedserve.planner.memory import run_memory
        return run_memory(args)
    if not args.profile:
        raise ValueError("pagedserve plan needs --profile FILE (from `pagedserve calibrate --out FILE`)")
    profile = Profile.load(args.profile)
    args.profile_model, args.profile_model_path = Path(profile.model).name, profile.model
    trace = load_workload(args)
    config = workload_config(args, trace)
    if args.sweep:
        from pagedserve.planner.sweep import run_sweep
        return run_sweep(args, profile, trace, config)
    result = simulate(profile, engine_values(args), trace, args.max_concurrency, args.request_rate,
                      args.slo_ttft_ms, args.slo_tpot_ms, config)
    print_report(result)
    print_planner_lines(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.compare:
        from pagedserve.planner.html_report import write_html
        real = json.loads(Path(args.compare).read_text())
        page = write_html(Path(args.out_dir) / "plan_vs_real.html", [(config["dataset"], result, real)])
        print(f"wrote {page}")
    return result
