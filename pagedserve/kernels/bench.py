"""Benchmark the Triton kernels against their torch references: python -m pagedserve.kernels.bench.

On a CUDA GPU, for each kernel at realistic shapes: median time of the Triton kernel and of the torch
reference (CUDA events), the roofline floor max(bytes moved / HBM bandwidth, FLOPs / peak FLOP/s), the
share of that floor the kernel reaches, and the kernel's max relative error against the reference.

"triton ms" is the device's time: each timed call is queued behind a wipe of the L2 cache and a wait on
the GPU, so the host has launched it before the GPU reaches it (its inputs come from HBM, and the
wrapper's Python and launch cost, which a CUDA graph does not pay, stays out; triton.testing.do_bench's
rule). "eager ms" is a call with nothing queued ahead of it: the device's time plus whatever the host
took to launch it, what a step run outside a graph pays. The "% floor" column is the device's time.

Without a GPU it exits 2, except:
  --interpret     tiny float32 shapes on the CPU under TRITON_INTERPRET=1: checks the script end to end;
  --compile-only  compiles every kernel exactly as the wrappers would launch it at the GPU shapes, for
                  sm_<arch> (no GPU needed: triton ships ptxas), and reports registers, spills and
                  shared memory per kernel configuration."""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from pagedserve.kernels.bench_cases import Case, TritonKernels, attention_case, gpu_cases, mla_case, tiny_cases
from pagedserve.kernels.peaks import REFERENCE_GPU, resolve_peaks


@dataclass
class Row:
    kernel: str
    shape: str
    triton_ms: float
    eager_ms: float
    torch_ms: float
    speedup: float
    floor_ms: float
    pct_of_floor: float
    max_rel_err: float


# ------------------------------------------------------------------------------------------- timing


# cycles the GPU waits before each timed call (torch.cuda._sleep: ~2 ms at an H200's clock), for the host
# to launch the call meanwhile; and a buffer larger than any GPU's L2, wiped before each call
HOST_LEAD_CYCLES = 4_000_000
L2_WIPE_BYTES = 256 << 20


def median_ms(fn: Callable, iters: int, warmup: int, cuda: bool, host_ahead: bool = True) -> float:
    """Median time of fn() in ms. On CUDA by events around each call; with host_ahead each call is queued
    behind an L2 wipe and a wait on the GPU (the device's time alone: module docstring), without it the
    GPU waits for the host's launch as an eager step does. On the CPU: wall time."""
    for _ in range(warmup):
        fn()
    wipe = torch.empty(L2_WIPE_BYTES, dtype=torch.int8, device="cuda") if cuda and host_ahead else None
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if wipe is not None:
                wipe.zero_()
                torch.cuda._sleep(HOST_LEAD_CYCLES)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def measure(case: Case, args: argparse.Namespace, cuda: bool) -> Row:
    err = (case.error or max_rel_err)(case.triton_fn(*case.args), case.torch_fn(*case.args))
    triton_ms = median_ms(lambda: case.triton_fn(*case.args), args.iters, args.warmup, cuda)
    eager_ms = triton_ms  # the CPU has no host lead to take away: the same wall time
    if cuda:
        eager_ms = median_ms(lambda: case.triton_fn(*case.args), args.iters, 1, cuda, host_ahead=False)
    torch_ms = median_ms(lambda: case.torch_fn(*case.args), max(1, args.iters // 4), 1, cuda)
    floor_ms = max(case.bytes / (args.hbm_gbps * 1e9), case.flops / (args.peak_tflops * 1e12)) * 1e3
    return Row(case.kernel, case.shape, triton_ms, eager_ms, torch_ms, torch_ms / triton_ms, floor_ms,
               100 * floor_ms / triton_ms, err)


def set_peaks(args: argparse.Namespace, gpu: str) -> None:
    """The floors' bandwidth and FLOP/s: the flags, else the GPU's own (the interpreter: the H200's)."""
    args.hbm_gbps, args.peak_tflops = resolve_peaks(gpu, args.hbm_gbps, args.peak_tflops)
    print(f"roofline: {gpu}: {args.hbm_gbps:.0f} GB/s, {args.peak_tflops:.0f} TFLOP/s", file=sys.stderr)


def print_table(rows: list[Row]) -> None:
    header = f"{'kernel':<18} {'shape':<58} {'triton ms':>10} {'eager ms':>10} {'torch ms':>10} {'speedup':>8} " \
             f"{'floor ms':>9} {'% floor':>8} {'max rel err':>12}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r.kernel:<18} {r.shape:<58} {r.triton_ms:>10.4f} {r.eager_ms:>10.4f} {r.torch_ms:>10.4f} "
              f"{r.speedup:>7.1f}x "
              f"{r.floor_ms:>9.4f} {r.pct_of_floor:>7.1f}% {r.max_rel_err:>12.2e}")


# ------------------------------------------------------------------------------------- compile only


def compile_only(arch: int) -> list[dict]:
    """Run the wrappers at GPU shapes (small batches, real head/hidden sizes) on CPU tensors with their
    launches intercepted; compile each distinct launch for sm_<arch> as triton's launcher would
    (same specialization) and report its resources. Raises if any kernel fails to compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import KernelInterface, create_function_from_signature

    import pagedserve.kernels.triton.fused_moe as moe
    import pagedserve.kernels.triton.int4_matmul as int4
    import pagedserve.kernels.triton.mla_attention as mla
    import pagedserve.kernels.triton.nucleus as nucleus
    import pagedserve.kernels.triton.paged_attention as pa

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    launches: dict[str, tuple] = {}

    def record(fn, kwargs_and_args):
        args, kwargs = kwargs_and_args
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        key = f"{fn.__name__} {signature} {constexprs} {attrs} {options.num_warps} {options.num_stages}"
        launches.setdefault(key, (fn, signature, constexprs, attrs, options))

    original_getitem = KernelInterface.__getitem__
    KernelInterface.__getitem__ = lambda self, grid: lambda *a, **kw: record(self, (a, kw))
    for module in (pa, mla, moe, nucleus, int4):
        module.is_interpreted = lambda t: False  # take the GPU tile sizes
    try:
        tk = TritonKernels()
        split_mla = mla_case(2, 40, 128, 512, 64, 16, torch.bfloat16, "cpu", tk)
        split_mla.triton_fn = functools.partial(tk.paged_mla_attention, num_splits=2)  # no multiprocessors here
        # Gemma 3's image step on a local layer: the prefill kernel reading each query's key limit
        image_step = attention_case("prefill attention", [0], [300], 8, 4, 256, 16, torch.bfloat16, "cpu", tk, 512)
        image_step.triton_fn = functools.partial(image_step.triton_fn, key_limits=torch.arange(300))
        cases = [*gpu_cases("cpu", tk, moe_tokens=(16, 256), batch=2, context=40, experts=8),
                 mla_case(2, 40, 128, 512, 64, 16, torch.bfloat16, "cpu", tk, q_len=5), split_mla, image_step]
        for case in cases:
            case.triton_fn(*case.args)
            case.triton_fn(*[a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in case.args])
    finally:
        KernelInterface.__getitem__ = original_getitem

    ptxas = _ptxas_for(arch)
    rows = []
    for fn, signature, constexprs, attrs, options in launches.values():
        t0 = time.perf_counter()
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
        rows.append(dict(kernel=fn.__name__, config=_short_config(fn, signature, constexprs, options),
                         shared_bytes=compiled.metadata.shared, seconds=round(time.perf_counter() - t0, 2),
                         mma=_mma_kind(compiled.asm["ptx"]), **_ptxas_usage(ptxas, compiled.asm["ptx"], arch)))
    return rows


def _mma_kind(ptx: str) -> str:
    """Which tensor-core instructions the kernel issues: Hopper's warpgroup MMA (wgmma, what reaches the
    tensor cores' peak there), the older per-warp mma.sync, or none (the dot fell back to FMA)."""
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    return "mma.sync" if "mma.sync" in ptx else "none"


def _short_config(fn, signature: dict, constexprs: dict, options) -> str:
    dtype = next(v for v in signature.values() if v.startswith("*"))[1:]
    consts = " ".join(f"{fn.arg_names[path[0]]}={value}" for path, value in constexprs.items())
    return f"{dtype} {consts} warps={options.num_warps} stages={options.num_stages}"


def _ptxas_for(arch: int) -> str:
    """The ptxas triton itself assembles sm_<arch> with: from sm_90 on its newer one (ptxas-blackwell);
    the older one rejects the PTX version triton writes for those."""
    import triton
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return get_ptxas(arch).path
    except (ImportError, TypeError, AttributeError):  # a Triton before the split (3.6 on the GPU kit's image)
        return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def _ptxas_usage(ptxas: str, ptx: str, arch: int) -> dict:
    """Registers and spill bytes per thread, from ptxas -v (empty when ptxas cannot run here)."""
    suffix = "a" if arch == 90 else ""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        try:
            out = subprocess.run([ptxas, f"-arch=sm_{arch}{suffix}", "-v", path, "-o", path + ".o"],
                                 capture_output=True, text=True, timeout=120).stderr
        except OSError:
            return {}
    usage = {}
    for line in out.splitlines():
        if "Used" in line and "registers" in line:
            usage["registers"] = int(line.split("Used")[1].split("registers")[0])
        if "spill stores" in line:
            usage["spill_bytes"] = int(line.split("bytes spill stores")[0].split(",")[-1])
    return usage


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pagedserve.kernels.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--interpret", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    mode.add_argument("--compile-only", action="store_true", help="compile for --arch and report resources")
    p.add_argument("--arch", type=int, default=90, help="compute capability for --compile-only (90: H100/H200)")
    p.add_argument("--hbm-gbps", type=float, help="HBM bandwidth in GB/s (default: the GPU's own, kernels/peaks.py)")
    p.add_argument("--peak-tflops", type=float, help="peak dense bf16 TFLOP/s (default: the GPU's own)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per kernel (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (the first compiles)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    elif args.compile_only:
        os.environ.pop("TRITON_INTERPRET", None)
    elif not torch.cuda.is_available():
        print("pagedserve.kernels.bench needs a CUDA GPU (or --interpret for tiny shapes on the CPU, "
              "--compile-only to compile for a GPU without one)", file=sys.stderr)
        return 2
    if args.compile_only:
        rows = compile_only(args.arch)
        for r in rows:
            print(f"{r['kernel']:<22} regs={r.get('registers', '?'):>3} spill={r.get('spill_bytes', '?'):>5}B "
                  f"shared={r['shared_bytes']:>6}B mma={r['mma']:<8} {r['config']}")
    else:
        torch.manual_seed(0)
        cuda = not args.interpret
        device = "cuda" if cuda else "cpu"
        set_peaks(args, torch.cuda.get_device_name() if cuda else REFERENCE_GPU)
        tk = TritonKernels()
        cases = gpu_cases(device, tk) if cuda else tiny_cases(device, tk)
        rows = [asdict(measure(case, args, cuda)) for case in cases]
        print_table([Row(**r) for r in rows])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
