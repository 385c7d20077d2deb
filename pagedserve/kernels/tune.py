"""Tune the Triton kernels' launch configurations on this GPU: python -m pagedserve.kernels.tune --out FILE.

For each of kernels.bench's cases (and the attention shapes of the 1B Llama the GPU kit serves) it runs
launch configurations (tiles, warps, pipeline stages, MLA's heads per program, fused MoE's tiles per
token count, the prefill kernel's causal split) by coordinate descent from the wrapper's own choice, keeps
those whose result matches the torch reference, times them (kernels.bench's median of the device's time:
each call queued behind an L2 wipe, the host's launch cost left out, so configurations differ by what the
GPU does) and writes the fastest per shape key as a table pagedserve.kernels.triton.tuning reads: name the
file in PAGEDSERVE_KERNEL_CONFIGS to use it at once, or commit it as
pagedserve/kernels/triton/configs/<device>.json to ship it. A candidate that fails to compile (too much
shared memory) or gives a wrong result is counted and passed over. --budget-s is shared among the cases;
the table is rewritten after each, so a run cut short keeps what it measured.

Prints, per case: the default's and the best's time and share of the roofline floor (kernels.bench's).
--interpret runs tiny shapes on the CPU under the Triton interpreter with two candidates per kernel:
a check of the script end to end, not a tuning."""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch

from pagedserve.kernels import bench, bench_cases
from pagedserve.kernels.bench import set_peaks
from pagedserve.kernels.peaks import REFERENCE_GPU


@dataclass
class Space:
    """How one bench case maps to a table entry: where the search starts (the wrapper's own choice) and the
    values each launch parameter may take."""
    kernel: str   # the table's kernel name (tuning.py)
    key: str      # its shape key, with " M=<n>" for a keyed size
    start: dict
    axes: dict[str, tuple]


def space(case: bench_cases.Case, interpreted: bool) -> Space:
    from pagedserve.kernels.triton import fused_moe, int4_matmul, mla_attention, paged_attention

    a = case.args
    if case.kernel == "int4 linear":
        start = int4_matmul.launch_params(a[0], a[1])
        rows = a[0].shape[0]
        axes = dict(block_n=(16, 32)) if interpreted else \
            dict(block_m=tuple(m for m in (16, 32, 64, 128) if m <= max(16, 2 * rows)), block_n=(32, 64, 128, 256),
                 block_k=(32, 64, 128, 256), num_warps=(4, 8), num_stages=(2, 3, 4, 5))
        return Space("int4_linear", f"{int4_matmul.int4_key(a[0], a[1])} M={rows}", start, axes)
    if case.kernel.startswith("mla"):
        decode = case.kernel == "mla decode"
        start = mla_attention.launch_params(a[0], a[1], a[2], decode)
        axes = dict(heads=(2, 4), block_n=(16, 32)) if interpreted else \
            dict(heads=(16, 32, 64), block_n=(16, 32, 64), num_warps=(4, 8), num_stages=(1, 2, 3, 4))
        return Space("mla", mla_attention.mla_key(a[0], a[1], a[2], decode), start, axes)
    if case.kernel == "fused moe":
        tokens, top_k = a[0].shape[0], a[4].shape[1]
        start = fused_moe.launch_params(a[0], a[1], top_k)
        per_expert = tokens * top_k / a[1].shape[0]
        axes = dict(block_n=(16, 32)) if interpreted else \
            dict(block_m=tuple(m for m in (16, 32, 64, 128) if m <= max(16, 2 * per_expert)),
                 block_n=(32, 64, 128, 256), block_k=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3, 4, 5))
        return Space("fused moe", f"{fused_moe.moe_key(a[0], a[1], top_k)} M={tokens}", start, axes)
    kernel = {"decode attention": "decode", "split decode attention": "split decode"}.get(case.kernel, "prefill")
    start = paged_attention.launch_params(kernel, a[0], a[1], a[2])
    if interpreted:
        axes = dict(block_n=(16, 32))
    elif kernel == "prefill":
        axes = dict(block_m=(32, 64, 128), block_n=(32, 64, 128), num_warps=(4, 8), num_stages=(1, 2, 3, 4),
                    causal_split=(0, 1))
    else:
        axes = dict(block_n=(16, 32, 64, 128), num_warps=(2, 4, 8), num_stages=(1, 2, 3, 4))
    return Space(kernel, paged_attention.attention_key(a[0], a[1], a[2]), start, axes)


def tuning_cases(device, tk):
    """kernels.bench's GPU cases (less its plain decode kernel at one long sequence, which the split kernel
    serves), then the attention shapes of the GPU kit's 1B Llama (32 heads, 8 kv heads, head dim 64): a
    batch of decodes, one stream's decode (the split kernel: a decode graph's tables are max_model_len
    wide) and a prefill."""
    for case in bench_cases.gpu_cases(device, tk):
        if not (case.kernel == "decode attention" and case.shape.startswith("S=1 ")):
            yield case
    dt = torch.bfloat16
    yield bench_cases.attention_case("decode attention", [1024] * 64, [1] * 64, 32, 8, 64, 16, dt, device, tk)
    yield bench_cases.attention_case("split decode attention", [2048], [1], 32, 8, 64, 16, dt, device, tk)
    yield bench_cases.attention_case("prefill attention", [0] * 4, [1024] * 4, 32, 8, 64, 16, dt, device, tk)


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


class CaseFailed(RuntimeError):
    """The wrapper's own configuration failed or was wrong: nothing to tune from (the others go on)."""


def tune_case(case: bench_cases.Case, sp: Space, args, cuda: bool, deadline: float) -> Result:
    """Coordinate descent from the wrapper's own choice: each parameter in turn takes each of its values with
    the others held, a change kept when it is at least 3% faster, rounds repeated until one changes nothing
    or the deadline passes. A candidate that fails to compile or run, or gives a wrong result, is passed
    over. Far fewer compiles than the whole grid (each takes seconds), which the budget could not afford."""
    want = case.torch_fn(*case.args)
    tol = 1e-3 if case.args[0].dtype == torch.float32 else 5e-2  # of the reference's largest magnitude
    seen: dict[tuple, float | None] = {}

    def measure(config: dict) -> float | None:
        key = tuple(sorted(config.items()))
        if key not in seen:
            seen[key] = _time(case, config, want, tol, args, cuda, sp.kernel)
        return seen[key]

    start = {k: sp.start[k] for k in sp.axes}
    default_ms = measure(start)
    if default_ms is None:
        raise CaseFailed(f"{sp.kernel} {sp.key}: the wrapper's own configuration failed (see above)")
    best, best_ms, changed = start, default_ms, True
    while changed and time.monotonic() < deadline:
        changed = False
        for param, values in sp.axes.items():
            if cuda:  # every unseen neighbour of the current best at once (cached: the next sweeps find them)
                precompile(case, [n for n in _neighbours(best, sp.axes) if tuple(sorted(n.items())) not in seen])
            for value in values:
                if value == best[param] or time.monotonic() > deadline:
                    continue
                ms = measure({**best, param: value})
                if ms is not None and ms < 0.97 * best_ms:
                    best, best_ms, changed = {**best, param: value}, ms, True
    floor = max(case.bytes / (args.hbm_gbps * 1e9), case.flops / (args.peak_tflops * 1e12)) * 1e3
    rejected = sum(v is None for v in seen.values())
    return Result(sp.kernel, sp.key, default_ms, best_ms, best if best != start else {}, floor, len(seen) - 1,
                  rejected)


def _neighbours(config: dict, axes: dict) -> list[dict]:
    return [{**config, p: v} for p, values in axes.items() for v in values if v != config[p]]


def precompile(case: bench_cases.Case, configs: list[dict], workers: int = 16) -> None:
    """Compile the kernels each config launches, in parallel threads, without launching them: each wrapper
    runs with its launches turned into Triton's warmup (compile only) under Triton's AsyncCompileMode. A
    compile that fails is left for the timed call to meet (and pass over). Where this Triton lacks the mode,
    or anything here goes wrong, the timed calls compile one by one as before."""
    if not configs:
        return
    try:
        from concurrent.futures import ThreadPoolExecutor

        from triton.runtime._async_compile import AsyncCompileMode
        from triton.runtime.jit import KernelInterface
    except ImportError:
        return
    launch = KernelInterface.__getitem__
    KernelInterface.__getitem__ = lambda kernel, grid: (lambda *a, **kw: kernel.warmup(*a, grid=grid, **kw))
    try:
        with ThreadPoolExecutor(workers) as pool, AsyncCompileMode(pool, ignore_errors=True):
            for config in configs:
                try:
                    case.triton_fn(*case.args, **config)
                except Exception:  # noqa: BLE001, S112 - the timed call meets it again and says why
                    continue
    except Exception as exc:  # noqa: BLE001 - compiling ahead is only a speed-up
        print(f"  precompile: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", file=sys.stderr)
    finally:
        KernelInterface.__getitem__ = launch


def _time(case: bench_cases.Case, config: dict, want, tol: float, args, cuda: bool, kernel: str) -> float | None:
    def call():
        return case.triton_fn(*case.args, **config)

    try:
        err = bench.max_rel_err(call(), want)
    except Exception as exc:  # noqa: BLE001 - a config the compiler or the GPU refuses is passed over
        print(f"  {kernel} {config}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", file=sys.stderr)
        return None
    if not err < tol:
        print(f"  {kernel} {config}: wrong result (max rel err {err:.2e})", file=sys.stderr)
        return None
    return bench.median_ms(call, args.iters, args.warmup, cuda)


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
    p.add_argument("--hbm-gbps", type=float, help="HBM bandwidth in GB/s (default: the GPU's own, kernels/peaks.py)")
    p.add_argument("--peak-tflops", type=float, help="peak dense bf16 TFLOP/s (default: the GPU's own)")
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
    tk = bench_cases.TritonKernels()
    cases = list(tuning_cases(device, tk) if cuda else bench_cases.tiny_cases(device, tk))
    only = {k for k in args.only.split(",") if k}
    chosen, keys = [], set()
    for case in cases:  # a shape key is tuned at its first case (the bench's small-batch MLA shares one)
        if case.kernel in ("prefill causal split", "mixed attention", "mixed split attention", "top_p nucleus"):
            continue  # the bench's rows for the prefill kernel's causal split (one of its parameters here), a
            # mixed step's two ways (their kernels' shapes are tuned at their own rows) and the nucleus kernel
            # (no table entry: its one block size is its wrapper's)
        sp = space(case, args.interpret)
        if (sp.kernel, sp.key) not in keys and (not only or sp.kernel in only):
            chosen.append((case, sp))
            keys.add((sp.kernel, sp.key))
    from pagedserve.kernels.triton.tuning import device_name, write_table
    name = device_name(torch.device("cuda")) if cuda else "interpreter"
    set_peaks(args, name if cuda else REFERENCE_GPU)
    start, results, failed = time.monotonic(), [], []
    print(HEADER, flush=True)
    for i, (case, sp) in enumerate(chosen):
        share = (args.budget_s - (time.monotonic() - start)) / (len(chosen) - i)
        try:
            results.append(tune_case(case, sp, args, cuda, time.monotonic() + share))
        except CaseFailed as exc:
            failed.append(str(exc))
            print(f"FAILED {exc}", flush=True)
            continue
        write_table(args.out, name, table(results))  # after each case: a run cut short keeps what it measured
        print(result_line(results[-1]), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
