"""`pagedserve bench behind`: a short prompt's time to first token when it arrives while a long prompt
prefills, against its time alone, with short prompts first (the default: scheduler/core/short_first.py)
and first come, first served, alternating in one sitting.

The in-process engine, one thread, the way a server's loop takes a request in between two steps: the
long prompt (--long-len tokens) is added and stepped; the short one (--short-len tokens, max_tokens 1)
"arrives" at an offset from the long one's start, is added at the first step boundary after it, and its
TTFT runs from that arrival to its first token. --offsets arrivals spread evenly over the long prompt's
first two chunk steps (a chunk: --long-prefill-token-threshold tokens, by default a quarter of the step
budget), each run on fresh prompts (numpy.random.default_rng(seed) over [100, vocab): no prefix-cache
hit). The long prompt's own TTFT is reported too: what the short ones cost it. Medians; the ratios are
each median against the lone TTFT's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from pagedserve.common.engine_args import add_engine_args
from pagedserve.common.gc_heap import frozen_heap
from pagedserve.common.sampling_params import SamplingParams

FIRST_TOKEN = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)


class Prompts:
    """Fresh prompt ids each call (a new seed): no run finds another's prefix cached."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.seed = vocab, 1000

    def __call__(self, n: int) -> list[int]:
        self.seed += 1
        return np.random.default_rng(self.seed).integers(100, self.vocab, n).tolist()


def lone_ttft(engine, prompt: list[int], request_id: str) -> float:
    start = time.perf_counter()
    engine.add_request(request_id, prompt, FIRST_TOKEN)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def behind_run(engine, long_prompt: list[int], short_prompt: list[int], offset_s: float,
               tag: str) -> tuple[float, float, list[float]]:
    """(short TTFT from its arrival, long TTFT, the step times) of one run."""
    start = time.perf_counter()
    engine.add_request(f"{tag}-long", long_prompt, FIRST_TOKEN)
    arrival = start + offset_s
    added, short_ttft, long_ttft, steps = False, None, None, []
    while engine.has_unfinished() or not added:
        now = time.perf_counter()
        if not added and now >= arrival:
            engine.add_request(f"{tag}-short", short_prompt, FIRST_TOKEN)
            added = True
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrival - now))
            continue
        for out in engine.step():
            done = time.perf_counter()
            if out.new_tokens and out.request_id == f"{tag}-short" and short_ttft is None:
                short_ttft = done - arrival
            if out.new_tokens and out.request_id == f"{tag}-long" and long_ttft is None:
                long_ttft = done - start
        steps.append(time.perf_counter() - now)
    return short_ttft, long_ttft, steps


def run_behind(args: argparse.Namespace) -> int:
    from pagedserve.bench.throughput import build_engine, load_tokenizer
    from pagedserve.model_files.default_model import resolve_model

    if min(args.long_len, args.short_len, args.offsets, args.lone_runs) < 1:
        raise SystemExit("--long-len, --short-len, --offsets and --lone-runs must be at least 1")
    model_path = resolve_model(args.model, args.revision)
    engine = build_engine(args, model_path, load_tokenizer(model_path))
    try:
        prompts = Prompts(engine.model_config.vocab_size)
        config = engine.scheduler.config
        chunk = config.long_prefill_token_threshold or config.max_num_batched_tokens
        with frozen_heap():
            lone_ttft(engine, prompts(args.short_len), "warm-short")
            _, _, steps = behind_run(engine, prompts(args.long_len), prompts(args.short_len), 0.0, "warm")
            step_s = statistics.median(steps)
            lone = [lone_ttft(engine, prompts(args.short_len), f"lone-{i}") for i in range(args.lone_runs)]
            offsets = [2 * step_s * (i + 0.5) / args.offsets for i in range(args.offsets)]
            modes = {"short_first": True, "fcfs": False}
            got: dict[str, dict[str, list[float]]] = {m: {"short": [], "long": []} for m in modes}
            for i, offset in enumerate(offsets):
                order = list(modes) if i % 2 == 0 else list(modes)[::-1]  # alternate which goes first
                for mode in order:
                    config.short_prompts_first = modes[mode]
                    short, long, _ = behind_run(engine, prompts(args.long_len), prompts(args.short_len), offset,
                                                f"{mode}-{i}")
                    got[mode]["short"].append(short)
                    got[mode]["long"].append(long)
            config.short_prompts_first = True
    finally:
        engine.close()
    lone_median = statistics.median(lone)
    result = {"model": str(model_path), "long_len": args.long_len, "short_len": args.short_len, "chunk_tokens": chunk,
              "chunk_step_ms": step_s * 1e3, "lone_ttft_ms": lone_median * 1e3,
              "offsets_ms": [o * 1e3 for o in offsets]}
    print(f"{model_path.name}: a {args.short_len}-token prompt alone: TTFT {lone_median * 1e3:.1f} ms (median of "
          f"{len(lone)}); behind a {args.long_len}-token prompt prefilling in chunks of {chunk} tokens "
          f"(~{step_s * 1e3:.0f} ms a step), arriving at {len(offsets)} offsets over its first two steps:")
    for mode, label in (("short_first", "short prompts first (default)"), ("fcfs", "first come, first served")):
        short, long = statistics.median(got[mode]["short"]), statistics.median(got[mode]["long"])
        result[mode] = {"short_ttft_ms": [x * 1e3 for x in got[mode]["short"]], "short_ttft_median_ms": short * 1e3,
                        "ratio_to_lone": short / lone_median, "long_ttft_median_ms": long * 1e3}
        print(f"  {label:30s} short TTFT median {short * 1e3:7.1f} ms ({short / lone_median:.2f}x alone; "
              f"{min(got[mode]['short']) * 1e3:.0f}-{max(got[mode]['short']) * 1e3:.0f} ms), "
              f"the long prompt's TTFT median {long * 1e3:.0f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def add_behind_parser(bench_sub) -> None:
    p = bench_sub.add_parser("behind", help="a short prompt's TTFT behind a long prompt's prefill, against alone",
                             description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--long-len", type=int, default=1800, help="the long prompt's tokens (default 1800)")
    p.add_argument("--short-len", type=int, default=32, help="the short prompt's tokens (default 32)")
    p.add_argument("--offsets", type=int, default=8, help="arrival offsets over the long prompt's first two steps "
                                                          "(default 8)")
    p.add_argument("--lone-runs", type=int, default=5, help="runs of the short prompt alone (default 5)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON here")
    add_engine_args(p)
    p.set_defaults(func=run_behind)
