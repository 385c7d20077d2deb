"""`pagedserve bench scheduler`: the scheduler's host time a step at N running decode rows, no model.

A GPU runs a decode step of a small model in about a millisecond; the host's part of each step (the
scheduler, the runner's layout and sampling bookkeeping, the outputs) runs on one thread beside it, and
at a few hundred rows it is what bounds a step (issue 37's W1024). This times the scheduler's part
alone: --rows requests of --prompt-len random tokens admitted, then steps of schedule() and update()
with one random sampled token per row (the results a worker would send), the first --warmup steps
left out; it reports the mean milliseconds a step of each and the same per row. No torch, no model.
"""

from __future__ import annotations

import argparse
import json
import random
import time


def add_scheduler_parser(bench_sub) -> None:
    p = bench_sub.add_parser("scheduler", help="the scheduler's host time a step at N decode rows (no model)",
                             description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=256, help="running requests, each a decode row every step")
    p.add_argument("--steps", type=int, default=200, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="steps first, untimed (the prompts' prefill among them)")
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--repeats", type=int, default=3, help="whole runs; each is printed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="FILE", help="write the runs as JSON here")
    p.set_defaults(func=run_scheduler_bench)


def one_run(args: argparse.Namespace, seed: int) -> dict:
    from pagedserve.common.messages import ModelRunnerOutput, SampledToken
    from pagedserve.common.sampling_params import SamplingParams
    from pagedserve.scheduler.core.config import SchedulerConfig
    from pagedserve.scheduler.core.request import Request
    from pagedserve.scheduler.core.scheduler import Scheduler

    rng = random.Random(seed)
    max_len = args.prompt_len + args.warmup + args.steps + 1
    blocks = args.rows * -(-max_len // args.block_size) + 1
    scheduler = Scheduler(SchedulerConfig(
        num_gpu_blocks=blocks, block_size=args.block_size, max_num_seqs=args.rows,
        max_num_batched_tokens=max(args.rows, args.rows * args.prompt_len), max_model_len=max_len,
        enable_prefix_caching=not args.no_prefix_caching))
    params = SamplingParams(temperature=0.0, max_tokens=args.warmup + args.steps + 1, ignore_eos=True)
    for i in range(args.rows):
        prompt = [rng.randrange(3, 30000) for _ in range(args.prompt_len)]
        scheduler.add_request(Request(f"r{i}", prompt, len(prompt), params, (2,)))
    schedule_s = update_s = 0.0
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        sched = scheduler.schedule()
        t1 = time.perf_counter()
        result = ModelRunnerOutput(sched.step_id, {r: [SampledToken(rng.randrange(3, 30000))]
                                                   for r in sched.num_scheduled_tokens})
        t2 = time.perf_counter()
        scheduler.update(sched, result)
        t3 = time.perf_counter()
        if step >= args.warmup:
            if len(sched.num_scheduled_tokens) != args.rows or sched.total_num_scheduled_tokens != args.rows:
                raise RuntimeError(f"step {step} ran {sched.total_num_scheduled_tokens} tokens, not one a row")
            schedule_s, update_s = schedule_s + t1 - t0, update_s + t3 - t2
    return {"rows": args.rows, "schedule_ms": 1e3 * schedule_s / args.steps, "update_ms": 1e3 * update_s / args.steps}


def run_scheduler_bench(args: argparse.Namespace) -> int:
    if args.rows < 1 or args.steps < 1 or args.warmup < 1 or args.prompt_len < 1:
        raise SystemExit("--rows, --steps, --warmup and --prompt-len must be >= 1")
    runs = []
    for repeat in range(args.repeats):
        run = one_run(args, args.seed + repeat)
        runs.append(run)
        per_row = 1e3 * (run["schedule_ms"] + run["update_ms"]) / args.rows
        print(f"{args.rows} decode rows: schedule {run['schedule_ms']:.3f} ms, update {run['update_ms']:.3f} ms "
              f"a step ({per_row:.2f} us a row)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs}, f, indent=1)
    return 0
