"""Tune the Triton kernels' launch configurations on this GPU: python -m pagedserve.kernels.tune --out FILE.

For each of kernels.bench's cases (and the attention shapes of the 1B Llama the GPU kit serves) it runs
candidate configurations (tiles, warps, pipeline stages, MLA's heads per program, fused MoE's tiles per
token count), keeps those whose result matches the torch reference, times them (median, CUDA events) and
writes the fastest per shape key as a table pagedserve.kernels.triton.tuning reads: name the file in
PAGEDSERVE_KERNEL_CONFIGS to use it at once, or commit it as
pagedserve/kernels/triton/configs/<device>.json to ship it. A candidate that fails to compile (too much
shared memory) or gives a wrong result is counted and passed over. The default configuration is always
tried first; the others in a fixed shuffled order, so a --budget-s cut samples the whole space.

Prints, per case: the default's and the best's time and share of the roofline floor (kernels.bench's).
--interpret runs tiny shapes on the CPU under the Triton interpreter with two candidates per kernel:
a check of the script end to end, not a tuning."""

from __future__ import annotations

import argparse
import itertools
import os
import random
import sys
import time
from dataclasses import dataclass

import torch

from pagedserve.kernels import bench


@dataclass
class Space:
    """How one bench case maps to a table entry, and the configurations to try."""
    kernel: str   # the table's kernel name (tuning.py)
    key: str      # its shape key, with " M=<n>" for a keyed size
    candidates: list[dict]


def _grid(**axes) -> list[dict]:
    names = list(axes)
    return [dict(zip(names, values)) for values in itertools.product(*axes.values())]


def space(case: bench.Case, interpreted: bool) -> Space:
    from pagedserve.kernels.triton import fused_moe, mla_attention, paged_attention

    a = case.args
    if case.kernel.endswith("attention") and not case.kernel.startswith("mla"):
        kernel = {"decode attention": "decode", "split decode attention": "split decode"}.get(case.kernel, "prefill")
        key = paged_attention.attention_key(a[0], a[1], a[2])
        if interpreted:
            return Space(kernel, key, [dict(block_n=16), dict(block_n=32)])
        if kernel == "prefill":
            tiles = [dict(block_m=m, block_n=n) for m, n in ((64, 64), (128, 64), (128, 128), (64, 128), (128, 32))]
            launch = _grid(num_warps=(4, 8), num_stages=(2, 3, 4))
            return Space(kernel, key, [{**t, **w} for t in tiles for w in launch])
        return Space(kernel, key, _grid(block_n=(32, 64, 128), num_warps=(2, 4, 8), num_stages=(2, 3)))
    if case.kernel.startswith("mla"):
        key = mla_attention.mla_key(a[0], a[1], a[2], case.kernel == "mla decode")
        if interpreted:
            return Space("mla", key, [dict(heads=4, block_n=16), dict(heads=2, block_n=32)])
        return Space("mla", key, _grid(heads=(16, 32, 64), block_n=(16, 32, 64), num_warps=(4, 8),
                                       num_stages=(1, 2, 3)))
    tokens, top_k = a[0].shape[0], a[4].shape[1]
    key = f"{fused_moe.moe_key(a[0], a[1], top_k)} M={tokens}"
    if interpreted:
        return Space("fused moe", key, [dict(block_m=16, block_n=16, block_k=16),
                                        dict(block_m=16, block_n=32, block_k=16)])
    per_expert = tokens * top_k / a[1].shape[0]
    block_m = [m for m in (16, 32, 64, 128) if m <= max(16, 2 * per_expert)]
    return Space("fused moe", key, _grid(block_m=block_m, block_n=(64, 128, 256), block_k=(64, 128),
                                         num_warps=(4, 8), num_stages=(2, 3, 4)))


def tuning_cases(device, tk):
    """kernels.bench's GPU cases (less its plain decode kernel at one long sequence, which the split kernel
    serves), then the attention shapes of the GPU kit's 1B Llama (32 heads, 8 kv heads, head dim 64): a
    batch of decodes, one stream's decode (the split kernel: a decode graph's tables are max_model_len
    wide) and a prefill."""
    for case in bench.gpu_cases(device, tk):
        if not (case.kernel == "decode attention" and case.shape.startswith("S=1 ")):
            yield case
    dt = torch.bfloat16
    yield bench.attention_case("decode attention", [1024] * 64, [1] * 64, 32, 8, 64, 16, dt, device, tk)
    yield bench.attention_case("split decode attention", [2048], [1], 32, 8, 64, 16, dt, device, tk)
    yield bench.attention_case("prefill attention", [0] * 4, [1024] * 4, 32, 8, 64, 16, dt, device, tk)


@dataclass
class Result:
    kernel: str
    key: str
    default_ms: float
    best_ms: float
    best: dict
    floor_ms: float
    tried: int
    rejected: int


def tune_case(case: bench.Case, sp: Space, args, cuda: bool, deadline: float) -> Result:
    """Time every candidate that compiles and matches the reference until `deadline`; the first is the
    default (no launch parameters given)."""
    want = case.torch_fn(*case.args)
    tol = 1e-3 if case.args[0].dtype == torch.float32 else 3e-2
    order = sp.candidates[:]
    random.Random(0).shuffle(order)
    timings: list[tuple[float, dict]] = []
    rejected = 0
    for config in [{}, *order]:
        if config and time.monotonic() > deadline:
            break
        def call(c=config):
            return case.triton_fn(*case.args, **c)

        try:
            err = bench.max_rel_err(call(), want)
        except Exception as exc:  # noqa: BLE001 - a config the compiler or the GPU refuses is passed over
            rejected += 1
            print(f"  {sp.kernel} {config}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", file=sys.stderr)
            continue
        if not err < tol:
            rejected += 1
            print(f"  {sp.kernel} {config}: wrong result (max rel err {err:.2e})", file=sys.stderr)
            continue
        timings.append((bench.median_ms(call, args.iters, args.warmup, cuda), config))
    if not timings or timings[0][1]:
        raise RuntimeError(f"{sp.kernel} {sp.key}: the default configuration failed")
    best_ms, best = min(timings, key=lambda t: t[0])
    floor = max(case.bytes / (args.hbm_gbps * 1e9), case.flops / (args.peak_tflops * 1e12)) * 1e3
    return Result(sp.kernel, sp.key, timings[0][0], best_ms, best, floor, len(timings) + rejected - 1, rejected)


HEADER = f"{'kernel':<13} {'shape key':<52} {'default ms':>10} {'best ms':>9} {'% floor':>15} {'tried':>5}  best config"


def result_line(r: Result) -> str:
    pct = f"{100 * r.floor_ms / r.default_ms:.1f} -> {100 * r.floor_ms / r.best_ms:.1f}"
    return (f"{r.kernel:<13} {r.key:<52} {r.default_ms:>10.4f} {r.best_ms:>9.4f} {pct:>15} {r.tried:>5}  "
            f"{r.best or 'default'}")


def table(results: list[Result]) -> dict:
    """The tuning table's "kernels": each case's best that beat its default; a default's entry is left out."""
    kernels: dict = {}
    for r in results:
        if r.best:
            kernels.setdefault(r.kernel, {})[r.key] = r.best
    return kernels


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pagedserve.kernels.tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="write the tuning table (JSON) here")
    p.add_argument("--interpret", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    p.add_argument("--budget-s", type=float, default=240.0, help="wall-clock seconds for all cases together")
    p.add_argument("--only", default="", help="comma-separated table kernel names to tune (default: all)")
    p.add_argument("--iters", type=int, default=10, help="timed calls per candidate (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per candidate first")
    p.add_argument("--hbm-gbps", type=float, default=4800.0, help="HBM bandwidth in GB/s (H200: 4800)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="peak dense bf16 TFLOP/s (H200: 989)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("pagedserve.kernels.tune needs a CUDA GPU (or --interpret for tiny shapes on the CPU)", file=sys.stderr)
        return 2
    os.environ.pop("PAGEDSERVE_KERNEL_CONFIGS", None)  # the defaults are what is compared against
    torch.manual_seed(0)
    cuda = not args.interpret
    device = "cuda" if cuda else "cpu"
    tk = bench.TritonKernels()
    cases = list(tuning_cases(device, tk) if cuda else bench.tiny_cases(device, tk))
    spaces = [space(c, args.interpret) for c in cases]
    only = {k for k in args.only.split(",") if k}
    chosen = [(c, s) for c, s in zip(cases, spaces) if not only or s.kernel in only]
    from pagedserve.kernels.triton.tuning import device_name, write_table
    name = device_name(torch.device("cuda")) if cuda else "interpreter"
    start, results = time.monotonic(), []
    print(HEADER, flush=True)
    for i, (case, sp) in enumerate(chosen):
        share = (args.budget_s - (time.monotonic() - start)) / (len(chosen) - i)
        results.append(tune_case(case, sp, args, cuda, time.monotonic() + share))
        write_table(args.out, name, table(results))  # after each case: a run cut short keeps what it measured
        print(result_line(results[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
