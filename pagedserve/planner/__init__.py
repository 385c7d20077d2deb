"""The capacity planner: `pagedserve calibrate` (a step-time cost model measured on the model
runner), `pagedserve plan` (a workload replayed through the real Scheduler in virtual time, in
`bench serve`'s report shape; --sweep ranks budgets under an SLO; --memory sizes the KV pool) and
`pagedserve plan-accuracy` (a plan beside a real `bench serve` run against `pagedserve serve`).

This module only builds the parsers: no torch, no numpy at import (the command line stays light);
calibrate loads torch when it runs, the simulator never does.
"""

from __future__ import annotations

import argparse

from pagedserve.bench.serve import add_workload_args as add_serve_workload_args
from pagedserve.common.engine_args import add_engine_args


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """`bench serve`'s own workload flags (the same function), and a trace to replay instead."""
    p.add_argument("--trace", default=None, metavar="FILE.jsonl",
                   help="replay this trace (arrival_s, prompt_tokens, output_tokens[, prefix_id, prefix_tokens]) "
                        "instead of a dataset")
    add_serve_workload_args(p)


def add_planner_parsers(sub) -> None:
    cal = sub.add_parser("calibrate", help="measure the model runner's step times and fit the planner's cost model")
    cal.add_argument("--out", default="profile.json", help="the profile to write")
    cal.add_argument("--repeats", type=int, default=3, help="timed runs per step shape (median kept)")
    cal.add_argument("--quick", action="store_true", help="a small grid (tests, a first look)")
    cal.add_argument("--step-overhead-ms", type=float, default=0.0,
                     help="per-step cost beyond the forward pass: `bench services`' scheduler->worker round trip")
    cal.add_argument("--request-overhead-ms", type=float, default=0.0,
                     help="per-request latency before the scheduler sees it (gateway, tokenizer, network)")
    add_engine_args(cal)

    def run_calibrate(args):
        from pagedserve.planner.calibrate import run_calibrate as run
        return run(args)

    cal.set_defaults(func=run_calibrate)

    plan = sub.add_parser("plan", help="replay a workload through the real scheduler on a calibrated cost model")
    plan.add_argument("--profile", default=None, metavar="FILE", help="from `pagedserve calibrate --out FILE`")
    add_workload_args(plan)
    plan.add_argument("--loras", type=int, default=0, metavar="N",
                      help="spread the requests round robin over N LoRA adapters (with --enable-lora; the step "
                           "cost then has the adapters' term: docs/planner.md)")
    plan.add_argument("--sweep", nargs="+", default=None, metavar="KEY=V1,V2",
                      help="simulate every combination, e.g. max_num_batched_tokens=256,512 max_num_seqs=8,32")
    plan.add_argument("--out-dir", default="plan-out", help="where --sweep writes plan_sweep.json and its plot")
    plan.add_argument("--memory", action="store_true",
                      help="KV arithmetic: requests of --context-len that fit per pool size, block-size waste")
    plan.add_argument("--context-len", type=int, default=None, help="with --memory")
    plan.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON (bench serve's keys)")
    plan.add_argument("--compare", default=None, metavar="REAL.json",
                      help="a `bench serve --json` result of the same workload: write plan_vs_real.html beside it")
    add_engine_args(plan)

    def run_plan(args):
        from pagedserve.planner.plan_command import run_plan as run
        return run(args)

    plan.set_defaults(func=run_plan)

    from pagedserve.planner.accuracy import add_accuracy_parser
    add_accuracy_parser(sub)
