"""`pagedserve bench sampler`: one step's sampling (worker/sampler.py) for --rows rows over a --vocab-token
vocabulary, by the rows' settings: greedy; temperature 1.0, unseeded and seeded; top_k 50; top_p 0.95 on
peaked logits (a nucleus of ~20 tokens, as a trained model's usually is) and on flat ones (a nucleus of
thousands, as on random prompts). Logits of random normals x 3 (peaked: 20 of them raised by 25), float32,
on the CPU (where the sampler's time is the step's: on a GPU it is the device's); the median milliseconds a
call over --rounds rounds of --calls calls, the sampled ids' read back included.
"""

from __future__ import annotations

import argparse

from pagedserve.bench.host_timing import timing_parser, write_rows

CASES = (("greedy", {"temperature": 0.0}, False), ("temperature 1.0", {"temperature": 1.0}, False),
         ("temperature 1.0, seeded", {"temperature": 1.0, "seed": 7}, False),
         ("top_k 50", {"temperature": 0.8, "top_k": 50}, False),
         ("top_p 0.95, peaked", {"temperature": 0.8, "top_p": 0.95}, True),
         ("top_p 0.95, flat", {"temperature": 0.8, "top_p": 0.95}, False))


def add_sampler_parser(bench_sub) -> None:
    p = timing_parser(bench_sub, "sampler", "one step's sampling by the rows' settings (CPU)", __doc__,
                      run_sampler_bench, calls=5, rounds=3)
    p.add_argument("--rows", type=int, default=64, help="sampler rows (W64's decode step: 64)")
    p.add_argument("--vocab", type=int, default=49152, help="vocabulary (the default model's: 49,152)")


def sample_call(rows: int, vocab: int, settings: dict, peaked: bool):
    """A call of Sampler.sample over rows built once, with its result taken."""
    import torch

    from pagedserve.common.sampling_params import SamplingParams
    from pagedserve.worker.sampler import RowSampling, Sampler
    from pagedserve.worker.step_sampling import sample_key

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    if peaked:
        logits[:, :20] += 25
    params = SamplingParams(**settings)
    batch = [RowSampling(params, sample_key(params, 0, i), [], [], (0,)) for i in range(rows)]
    sampler = Sampler()
    return lambda: sampler.sample(logits, batch).result()


def run_sampler_bench(args: argparse.Namespace) -> int:
    from pagedserve.kernels.host_cost import median_us  # (torch loads when the bench runs)

    if min(args.rows, args.vocab, args.calls, args.rounds) < 1:
        raise SystemExit("--rows, --vocab, --calls and --rounds must be at least 1")
    out = []
    for name, settings, peaked in CASES:
        ms = median_us(sample_call(args.rows, args.vocab, settings, peaked), args.calls, args.rounds) / 1e3
        out.append({"rows": name, "ms": ms})
        print(f"{name}: {ms:.2f} ms a step of {args.rows} rows", flush=True)
    write_rows(args.json, out)
    return 0
