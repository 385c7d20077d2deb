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
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from pagedserve.kernels import reference


@dataclass
class Case:
    """One benchmark row: inputs plus the two implementations and the traffic/work they imply."""
    kernel: str
    shape: str
    args: tuple
    triton_fn: Callable
    torch_fn: Callable
    bytes: float   # minimum HBM traffic: every input read once, the output written once
    flops: float
    error: Callable | None = None  # (got, want) -> error; None: max_rel_err


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


# ------------------------------------------------------------------------------------------- inputs


def paged_layout(seq_lens: list[int], page: int, device) -> tuple[torch.Tensor, int]:
    """Block tables [S, max_blocks] int32 over shuffled block ids; returns (tables, num_blocks)."""
    counts = [math.ceil(n / page) for n in seq_lens]
    num_blocks = sum(counts)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(counts), dtype=torch.int32, device=device)
    start = 0
    for s, n in enumerate(counts):
        tables[s, :n] = perm[start:start + n]
        start += n
    return tables, num_blocks


def step(ctx_lens: list[int], q_lens: list[int], device):
    seq_lens = torch.tensor([c + q for c, q in zip(ctx_lens, q_lens)], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return seq_lens, qsl


def attended_keys(ctx_lens: list[int], q_lens: list[int]) -> int:
    """Sum over the step's queries of the keys each attends to (causal)."""
    return sum(q * c + q * (q + 1) // 2 for c, q in zip(ctx_lens, q_lens))


def attention_case(name, ctx_lens, q_lens, heads, kv_heads, dim, page, dtype, device, tk):
    seq_lens, qsl = step(ctx_lens, q_lens, device)
    tables, num_blocks = paged_layout(seq_lens.tolist(), page, device)
    query = torch.randn(sum(q_lens), heads, dim, dtype=dtype, device=device)
    k_cache = torch.randn(num_blocks, page, kv_heads, dim, dtype=dtype, device=device)
    v_cache = torch.randn(num_blocks, page, kv_heads, dim, dtype=dtype, device=device)
    size = dtype.itemsize
    cached = sum(c + q for c, q in zip(ctx_lens, q_lens))
    traffic = cached * kv_heads * 2 * dim * size + 2 * query.numel() * size + tables.numel() * 4
    fn = {"decode": tk.paged_decode_attention, "split": tk.paged_split_decode_attention}.get(
        name.split()[0], tk.paged_prefill_attention)
    shape = (f"S={len(q_lens)} q={max(q_lens)} ctx={max(ctx_lens)} H={heads} KVH={kv_heads} D={dim} "
             f"page={page} {str(dtype).removeprefix('torch.')}")
    return Case(name, shape, (query, k_cache, v_cache, tables, seq_lens, qsl, dim ** -0.5), fn,
                reference.paged_attention, traffic, 2 * heads * attended_keys(ctx_lens, q_lens) * 2 * dim)


def mla_case(batch, context, heads, rank, rope, page, dtype, device, tk, q_len=1):
    ctx_lens, q_lens = [context] * batch, [q_len] * batch
    seq_lens, qsl = step(ctx_lens, q_lens, device)
    tables, num_blocks = paged_layout(seq_lens.tolist(), page, device)
    q_latent = torch.randn(batch * q_len, heads, rank, dtype=dtype, device=device)
    q_rope = torch.randn(batch * q_len, heads, rope, dtype=dtype, device=device)
    cache = torch.randn(num_blocks, page, 1, rank + rope, dtype=dtype, device=device)
    size = dtype.itemsize
    traffic = (batch * (context + q_len) * (rank + rope) + batch * q_len * heads * (2 * rank + rope)) * size
    flops = 2 * heads * attended_keys(ctx_lens, q_lens) * (2 * rank + rope)
    shape = (f"S={batch} q={q_len} ctx={context} H={heads} L={rank} R={rope} page={page} "
             f"{str(dtype).removeprefix('torch.')}")
    args = (q_latent, q_rope, cache, tables, seq_lens, qsl, (rank + rope) ** -0.5, rank)
    return Case("mla decode" if q_len == 1 else "mla mixed", shape, args,
                tk.paged_mla_attention, reference.paged_mla_attention, traffic, flops)


def moe_case(tokens, experts, top_k, hidden, inter, dtype, device, tk):
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=device) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device=device) / inter ** 0.5).to(dtype)
    logits = torch.randn(tokens, experts, device=device)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    used = ids.unique().numel()
    traffic = used * 3 * inter * hidden * dtype.itemsize + 2 * x.numel() * dtype.itemsize
    shape = f"T={tokens} E={experts} k={top_k} H={hidden} I={inter} {str(dtype).removeprefix('torch.')}"
    return Case("fused moe", shape, (x, w13, w2, weights, ids.to(torch.int32)), tk.fused_moe, reference.fused_moe,
                traffic, 2 * tokens * top_k * 3 * inter * hidden)


def nucleus_case(rows, vocab, device, tk):
    """top_p 0.95 over float32 logits (random normals x 3, a nucleus of ~thousands): the kernel (bisection
    over each row's float bits) against the sort every top_p row takes without it; both on a copy, the
    inputs untouched. The error is the share of tokens kept by one and not the other."""
    x = torch.randn(rows, vocab, device=device) * 3
    index = torch.arange(rows, device=device)
    top_p = torch.full((rows,), 0.95, device=device)
    return Case("top_p nucleus", f"R={rows} V={vocab} float32", (x, index, top_p),
                lambda x, index, top_p: tk.nucleus_(x.clone(), index, top_p), reference.top_p_nucleus,
                2 * x.numel() * 4, 0, error=kept_differ)


def kept_differ(got: torch.Tensor, want: torch.Tensor) -> float:
    """The share of tokens kept (not -inf) by one of two masked logits and not by the other."""
    return ((got > -math.inf) != (want > -math.inf)).float().mean().item()


class TritonKernels:
    """The Triton entry points, imported late: TRITON_INTERPRET must be settled before triton loads them."""

    def __init__(self):
        from pagedserve.kernels.triton import fused_moe, mla_attention, nucleus, paged_attention, split_decode
        self.paged_decode_attention = paged_attention.paged_decode_attention
        self.paged_split_decode_attention = split_decode.paged_split_decode_attention
        self.paged_prefill_attention = paged_attention.paged_prefill_attention
        self.paged_mixed_attention = paged_attention.paged_mixed_attention
        self.paged_mla_attention = mla_attention.paged_mla_attention
        self.fused_moe = fused_moe.fused_moe
        self.nucleus_ = nucleus.nucleus_


def gpu_cases(device, tk, moe_tokens=(16, 256, 2048), batch=64, context=2048, experts=64):
    dt = torch.bfloat16
    yield attention_case("decode attention", [context] * batch, [1] * batch, 32, 8, 128, 16, dt, device, tk)
    # one long sequence: what the split over the KV length is for (flash-decoding), beside the plain kernel
    yield attention_case("decode attention", [16 * context], [1], 32, 8, 128, 16, dt, device, tk)
    yield attention_case("split decode attention", [16 * context], [1], 32, 8, 128, 16, dt, device, tk)
    # the first batch split over the KV length: whether filling whole waves of multiprocessors beats the
    # combine's extra pass (attention_choice.py splits only below one program per multiprocessor)
    yield attention_case("split decode attention", [context] * batch, [1] * batch, 32, 8, 128, 16, dt, device, tk)
    yield attention_case("prefill attention", [1024] * 4, [512] * 4, 32, 8, 128, 16, dt, device, tk)
    # the same with FlashAttention-2's causal split (off by default): whether the unmasked loop pays here
    causal_split = attention_case("prefill causal split", [1024] * 4, [512] * 4, 32, 8, 128, 16, dt, device, tk)
    causal_split.triton_fn = functools.partial(tk.paged_prefill_attention, causal_split=1)
    yield causal_split
    yield from mixed_cases(dict(ctx=[200] * 190 + [100] * 4, q=[1] * 190 + [150] * 4, heads=32, kv_heads=8,
                                dim=64, page=16, dtype=dt), device, tk)
    yield mla_case(batch, context, 128, 512, 64, 16, dt, device, tk)
    # a small batch over a long context: too few (head block, sequence) programs, so the keys split into runs
    yield mla_case(4, 4 * context, 128, 512, 64, 16, dt, device, tk)
    for tokens in moe_tokens:
        yield moe_case(tokens, experts, 8, 2048, 1408, dt, device, tk)
    yield nucleus_case(4 * batch, 49152, device, tk)  # W1024's sampled step: 256 rows of the 1B's vocabulary


def mixed_cases(shape: dict, device, tk):
    """A mixed step (W1024's kind on the GPU shape: ~190 decodes beside 4 prefill chunks, the 1B Llama's heads)
    through the prefill kernel alone, and split by the number of queries (decodes to the decode kernel:
    paged_mixed_attention, what the worker runs)."""
    args = (shape["ctx"], shape["q"], shape["heads"], shape["kv_heads"], shape["dim"], shape["page"], shape["dtype"])
    yield attention_case("mixed attention", *args, device, tk)
    split = attention_case("mixed split attention", *args, device, tk)
    split.triton_fn = tk.paged_mixed_attention
    yield split


def tiny_cases(device, tk):
    dt = torch.float32
    yield attention_case("decode attention", [40, 7, 0], [1, 1, 1], 8, 2, 32, 16, dt, device, tk)
    yield attention_case("split decode attention", [40, 7, 0], [1, 1, 1], 8, 2, 32, 16, dt, device, tk)
    yield attention_case("prefill attention", [16, 0], [20, 5], 4, 2, 32, 16, dt, device, tk)
    causal_split = attention_case("prefill causal split", [16, 0], [20, 5], 4, 2, 32, 16, dt, device, tk)
    causal_split.triton_fn = functools.partial(tk.paged_prefill_attention, causal_split=1)
    yield causal_split
    yield from mixed_cases(dict(ctx=[40, 7, 16, 3], q=[1, 1, 20, 1], heads=8, kv_heads=2, dim=32, page=16, dtype=dt),
                           device, tk)
    yield mla_case(2, 40, 4, 32, 16, 16, dt, device, tk)
    yield moe_case(5, 4, 2, 32, 24, dt, device, tk)
    yield nucleus_case(3, 300, device, tk)


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
    for module in (pa, mla, moe, nucleus):
        module.is_interpreted = lambda t: False  # take the GPU tile sizes
    try:
        tk = TritonKernels()
        split_mla = mla_case(2, 40, 128, 512, 64, 16, torch.bfloat16, "cpu", tk)
        split_mla.triton_fn = functools.partial(tk.paged_mla_attention, num_splits=2)  # no multiprocessors here
        cases = [*gpu_cases("cpu", tk, moe_tokens=(16, 256), batch=2, context=40, experts=8),
                 mla_case(2, 40, 128, 512, 64, 16, torch.bfloat16, "cpu", tk, q_len=5), split_mla]
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
    p.add_argument("--hbm-gbps", type=float, default=4800.0, help="HBM bandwidth in GB/s (H200: 4800)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="peak dense bf16 TFLOP/s (H200: 989)")
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
