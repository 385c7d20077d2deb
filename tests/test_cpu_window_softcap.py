"""The compiled CPU attention kernels (pagedserve/kernels/cpu: decode and prefill) with a sliding window and Gemma 2's
score soft-capping, against the torch reference (kernels/reference.py); and the compiled backend's variants (what
Gemma 2 and 3 and Command R7B's layers run on the CPU) against the torch ones, whose greedy tokens
tests/test_gemma2.py, test_gemma3.py and test_cohere.py hold to transformers'. Table entries wholly before a
window name a block of NaNs where nothing may read it: a kernel that did would answer NaN."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.kernels import cpu_ops, reference
from window_steps import window_step

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def poisoned_step(ctx_lens, q_lens, heads, kv_heads, dim, page, window, dtype, seed):
    """(query, k_cache, v_cache, tables) of a step over scattered blocks: sequence s has ctx_lens[s] cached
    tokens and q_lens[s] queries, its table entries before its first query's window (and past its end) naming a
    block of NaNs."""
    gen = torch.Generator().manual_seed(seed)
    counts = [math.ceil((c + q) / page) for c, q in zip(ctx_lens, q_lens)]
    num_blocks = sum(counts) + 1
    perm = torch.randperm(num_blocks, generator=gen)
    poisoned = int(perm[-1])
    tables = torch.full((len(counts), max(counts)), poisoned, dtype=torch.long)
    used = 0
    for s, (context, count) in enumerate(zip(ctx_lens, counts)):
        tables[s, :count] = perm[used:used + count]
        used += count
        if window:
            tables[s, :max(0, context - window + 1) // page] = poisoned
    query = torch.randn(sum(q_lens), heads, dim, generator=gen).to(dtype)
    caches = [torch.randn(num_blocks, page, kv_heads, dim, generator=gen).to(dtype) for _ in range(2)]
    for cache in caches:
        cache[poisoned] = float("nan")
    return query, *caches, tables


def decode_step(lens, heads, kv_heads, dim, page, window, dtype, seed=0):
    """A pure decode step: (query, k_cache, v_cache, tables, seq_lens, scale)."""
    args = poisoned_step([n - 1 for n in lens], [1] * len(lens), heads, kv_heads, dim, page, window, dtype, seed)
    return *args, torch.tensor(lens), dim ** -0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, dim, page", [(4, 1, 256, 16), (8, 2, 64, 4), (6, 6, 32, 8)])
@pytest.mark.parametrize("window, cap", [(7, 0.0), (40, 0.0), (0, 1.5), (9, 2.0)])
def test_decode_kernel_equals_the_reference(dtype, heads, kv_heads, dim, page, window, cap):
    """Sequences shorter than the window, ending on a block edge past it, and far past it; the reference reads
    the window's keys only (the kernel does too: the NaN blocks before it stay unread)."""
    ops = cpu_ops.load()
    query, k_cache, v_cache, tables, lens, scale = decode_step([3, 16, 41, 70, 129], heads, kv_heads, dim, page,
                                                               window, dtype)
    got = ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale, window, cap)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    want = reference.paged_attention(query, k_cache, v_cache, tables, lens.int(), qsl, scale, window=window,
                                     softcap=cap)
    assert not got.isnan().any()
    assert (got.float() - want.float()).abs().max() < TOL[dtype] * max(1.0, want.float().abs().max().item())


def prefill_step(ctx_lens, q_lens, heads, kv_heads, dim, page, window, dtype, seed=1):
    """A step of prefill chunks in the kernel's layout (chunks int64 [P, 3] = row start, rows, context):
    (query, k_cache, v_cache, tables, chunks, seq_lens, query_start_loc)."""
    query, k_cache, v_cache, tables = poisoned_step(ctx_lens, q_lens, heads, kv_heads, dim, page, window, dtype, seed)
    starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    chunks = torch.tensor([(starts[i], q, c) for i, (c, q) in enumerate(zip(ctx_lens, q_lens))])
    lens = torch.tensor([c + q for c, q in zip(ctx_lens, q_lens)], dtype=torch.int32)
    return query, k_cache, v_cache, tables, chunks, lens, torch.tensor(starts, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, dim, page", [(4, 1, 256, 16), (8, 2, 64, 4), (6, 6, 32, 8)])
@pytest.mark.parametrize("window, cap", [(7, 0.0), (40, 0.0), (0, 1.5), (9, 2.0)])
def test_prefill_kernel_equals_the_reference(dtype, heads, kv_heads, dim, page, window, cap):
    """Chunks with context past the window, from 0 across it, long enough for several work items a kv head."""
    ops = cpu_ops.load()
    query, k_cache, v_cache, tables, chunks, lens, starts = prefill_step([20, 0, 45, 3], [9, 70, 5, 2], heads,
                                                                         kv_heads, dim, page, window, dtype)
    out = torch.zeros_like(query)
    ops.paged_prefill_attention(query, k_cache, v_cache, tables, chunks, dim ** -0.5, out, window, cap)
    want = reference.paged_attention(query, k_cache, v_cache, tables, lens, starts, dim ** -0.5, window=window,
                                     softcap=cap)
    assert not out.isnan().any()
    assert (out.float() - want.float()).abs().max() < TOL[dtype] * max(1.0, want.float().abs().max().item())


def test_decode_kernel_without_options_and_bad_ones():
    ops = cpu_ops.load()
    query, k_cache, v_cache, tables, lens, scale = decode_step([5, 33], 4, 2, 64, 8, 0, torch.float32)
    plain = ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale)
    assert torch.equal(plain, ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale, 0, 0.0))
    qsl = torch.arange(3, dtype=torch.int32)
    want = reference.paged_attention(query, k_cache, v_cache, tables, lens.int(), qsl, scale)
    assert (plain - want).abs().max() < 1e-5
    with pytest.raises(RuntimeError, match="window and softcap"):
        ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale, -1, 0.0)
    with pytest.raises(RuntimeError, match="window and softcap"):
        ops.paged_prefill_attention(query, k_cache, v_cache, tables, torch.tensor([[0, 2, 0], [2, 0, 0]])[:2], scale,
                                    torch.empty_like(query), 0, -1.0)


@pytest.mark.parametrize("windowed_layout", [True, False])
@pytest.mark.parametrize("prefills", [((3, 6), (12, 5), (0, 11)), ()])
@pytest.mark.parametrize("window, cap", [(6, 1.5), (6, 0.0), (0, 1.5)])
def test_compiled_variants_equal_the_torch_variants(windowed_layout, prefills, window, cap):
    """CpuKernelAttentionBackend's variants (the kernels' decodes and KV writes, torch's windowed or capped
    prefills) against the torch backend's on a sliding group's mixed and pure-decode steps, both decode
    layouts (the windowed one's rows shortened for the kernel)."""
    from pagedserve.worker.torch_attention import CpuKernelAttentionBackend, TorchAttentionBackend

    ops = cpu_ops.load()
    compiled = CpuKernelAttentionBackend(ops).variant(window=window, softcap=cap)
    assert compiled.ops is ops and (compiled.window, compiled.softcap) == (window, cap)
    query, key, value, caches, meta = window_step(window or 10**6, windowed_layout, prefills, decode_lens=(5, 14, 23),
                                                  dim=64, released="nan" if windowed_layout else "null")
    runs = []
    for backend in (TorchAttentionBackend().variant(window=window, softcap=cap), compiled):
        k_cache, v_cache = (c.clone() for c in caches)
        runs.append((backend.forward(query, key, value, k_cache, v_cache, meta, 0.3), k_cache, v_cache))
    (want, k_want, v_want), (got, k_got, v_got) = runs
    assert not want.isnan().any() and (got - want).abs().max() < 1e-5
    assert torch.equal(k_want.nan_to_num(), k_got.nan_to_num()) and torch.equal(v_want.nan_to_num(), v_got.nan_to_num())


def test_the_cpu_platform_gives_compiled_variants():
    from pagedserve.worker.platform import platform_for
    from pagedserve.worker.torch_attention import CpuKernelAttentionBackend

    backend = platform_for(torch.device("cpu")).attention_backend()
    local, capped = backend.variant(window=512, softcap=50.0), backend.variant(softcap=50.0)
    assert type(backend) is type(local) is type(capped) is CpuKernelAttentionBackend
    assert (local.window, local.softcap, capped.window, capped.softcap) == (512, 50.0, 0, 50.0)
    assert local.ops is capped.ops is backend.ops
