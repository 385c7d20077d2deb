"""The Triton wrappers' own host time per call: python -m pagedserve.kernels.host_cost [--json FILE].

A GPU step that runs eagerly (a mixed step: issue 37's W1024 is two thirds mixed steps) pays, for every
kernel of every layer, the wrapper's Python (checks, launch parameters, tiles, output allocation) and
then Triton's launcher. This times the first part on any machine: each wrapper runs at the GPU kit's 1B
Llama shapes (hidden 2048, 32 heads, 8 KV heads, head dim 64, MLP 8192, bfloat16) on CPU tensors with
the GPU's tile choices and every kernel launch intercepted (nothing runs; compile_only's interception),
for a mixed step (4 decodes and a 508-token prefill chunk) and a decode step of 256 rows. It prints the
median microseconds a call and their sum for one layer's six calls (two norms, rotary, the KV write,
attention, the activation). Triton's own launch cost (argument binding, its kernel cache) comes on top
and needs a GPU to time.
The step's layout on the host, which every step pays, graphs or not: `pagedserve bench layout`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager

import torch

LAYER = ("rms_norm", "rms_norm + residual", "rotary", "kv write", "attention", "silu_and_mul")


@contextmanager
def launches_intercepted():
    """Triton launches do nothing, and the wrappers choose the GPU's tiles for CPU tensors."""
    from triton.runtime.jit import KernelInterface

    import pagedserve.kernels.triton as package
    from pagedserve.kernels.triton import paged_attention

    modules = (package, paged_attention)  # where is_interpreted is read (the fused ops pick no tiles by it)
    saved = KernelInterface.__getitem__, [m.is_interpreted for m in modules]
    KernelInterface.__getitem__ = lambda self, grid: (lambda *args, **kwargs: None)
    for module in modules:
        module.is_interpreted = lambda t: False
    try:
        yield
    finally:
        KernelInterface.__getitem__ = saved[0]
        for module, original in zip(modules, saved[1]):
            module.is_interpreted = original


def layer_calls(decodes: int, prefill: int, seed: int = 0) -> dict:
    """One layer's wrapper calls for a step of `decodes` decode rows (context 128) and one `prefill`-token
    chunk (context 0), as closures over inputs made once; attention as the Triton backend calls it."""
    from pagedserve.kernels import bench_cases
    from pagedserve.kernels.triton import attention_choice, fused_ops

    gen = torch.Generator().manual_seed(seed)
    tokens, bf16 = decodes + prefill, torch.bfloat16
    x = torch.randn(tokens, 2048, generator=gen).to(bf16)
    residual, weight = torch.randn_like(x), torch.ones(2048, dtype=bf16)
    q = torch.randn(tokens, 32, 64, generator=gen).to(bf16)
    k = torch.randn(tokens, 8, 64, generator=gen).to(bf16)
    cos, sin = torch.randn(4096, 64), torch.randn(4096, 64)
    positions = torch.arange(tokens) % 4096
    gate_up = torch.randn(tokens, 2 * 8192, generator=gen).to(bf16)
    case = bench_cases.attention_case("prefill attention", [128] * decodes + ([0] if prefill else []),
                                      [1] * decodes + ([prefill] if prefill else []), 32, 8, 64, 16, bf16, "cpu",
                                      bench_cases.TritonKernels())
    k_cache, v_cache = case.args[1:3]
    slots = torch.arange(tokens)
    step_cache: dict = {}  # the backends' cache of one step's tile map (step_tiles): built by the first layer
    return {
        "rms_norm": lambda: fused_ops.rms_norm(x, weight, 1e-5),
        "rms_norm + residual": lambda: fused_ops.rms_norm(x, weight, 1e-5, residual),
        "rotary": lambda: fused_ops.rotary_inplace(q, k, cos, sin, positions),
        "kv write": lambda: fused_ops.write_kv_cache(k, k, k_cache, v_cache, slots),
        "attention": lambda: attention_choice.paged_attention(*case.args, step_cache=step_cache),
        "silu_and_mul": lambda: fused_ops.act_and_mul(gate_up),
    }


def median_us(fn, calls: int, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def measure(calls: int = 200, rounds: int = 5) -> list[dict]:
    rows = []
    with launches_intercepted():
        for step, decodes, prefill in (("mixed", 4, 508), ("decode", 256, 0)):
            fns = layer_calls(decodes, prefill)
            for name in LAYER:
                rows.append({"step": step, "call": name, "us": median_us(fns[name], calls, rounds)})
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pagedserve.kernels.host_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200, help="calls a timing round")
    p.add_argument("--rounds", type=int, default=5, help="timing rounds (the median is reported)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = measure(args.calls, args.rounds)
    for step in ("mixed", "decode"):
        mine = [r for r in rows if r["step"] == step]
        print(f"{step} step: " + ", ".join(f"{r['call']} {r['us']:.1f}" for r in mine)
              + f" us a call; a layer's calls {sum(r['us'] for r in mine):.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
