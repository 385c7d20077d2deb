"""`pagedserve bench sampler`: one step's sampling (worker/sampler.py) for --rows rows over a --vocab-token
vocabulary, by the rows' settings: greedy; temperature 1.0, unseeded and seeded; top_k 50; top_p 0.95 on
peaked logits (a nucleus of ~20 tokens, as a trained model's usually is) and on flat ones (a nucleus of
thousands, as on random prompts); repetition, presence and frequency penalties over 200 prompt and 1,000 output
tokens a row, each call one more output token a row, the histories read from the rows kept between steps
(worker/penalty_counts.py: the call adds the new tokens) and, for comparison, from the token lists as they
were read before. Logits of random normals x 3 (peaked: 20 of them raised by 25), float32,
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
PENALTIES = {"temperature": 0.0, "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5}
PENALTY_CASES = (("penalties, 1,000 outputs, rows kept", True), ("penalties, 1,000 outputs, from lists", False))


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


def penalty_call(rows: int, vocab: int, kept: bool):
    """A step's sampling with penalties: each row's state gains a token, then its histories are read (kept:
    from its rows of a PenaltyCounts table, after the table adds the new tokens; else from its lists)."""
    from types import SimpleNamespace

    import torch

    from pagedserve.common.sampling_params import SamplingParams
    from pagedserve.worker.penalty_counts import PenaltyCounts
    from pagedserve.worker.sampler import RowSampling, Sampler

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    states = [SimpleNamespace(token_ids=torch.randint(0, vocab, (1200,), generator=gen).tolist(), num_prompt_tokens=200,
                              held_at=-1) for _ in range(rows)]
    params = SamplingParams(**PENALTIES)
    sampler, counts = Sampler(), PenaltyCounts(vocab, torch.device("cpu"))

    def call():
        for i, state in enumerate(states):
            state.token_ids.append(i)
        if kept:
            batch = [RowSampling(params, None, [], [], (0,), row) for row in counts.sync(states)]
            return sampler.sample(logits, batch, counts=counts).result()
        batch = [RowSampling(params, None, s.token_ids[:200], s.token_ids[200:], (0,)) for s in states]
        return sampler.sample(logits, batch).result()
    return call


def run_sampler_bench(args: argparse.Namespace) -> int:
    from pagedserve.kernels.host_cost import median_us  # (torch loads when the bench runs)

    if min(args.rows, args.vocab, args.calls, args.rounds) < 1:
        raise SystemExit("--rows, --vocab, --calls and --rounds must be at least 1")
    out = []
    for name, settings, peaked in CASES:
        ms = median_us(sample_call(args.rows, args.vocab, settings, peaked), args.calls, args.rounds) / 1e3
        out.append({"rows": name, "ms": ms})
        print(f"{name}: {ms:.2f} ms a step of {args.rows} rows", flush=True)
    for name, kept in PENALTY_CASES:
        ms = median_us(penalty_call(args.rows, args.vocab, kept), args.calls, args.rounds) / 1e3
        out.append({"rows": name, "ms": ms})
        print(f"{name}: {ms:.2f} ms a step of {args.rows} rows", flush=True)
    write_rows(args.json, out)
    return 0
