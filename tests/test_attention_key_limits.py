"""Bidirectional blocks in paged attention (AttentionMetadata.key_limits: Gemma 3's images): each query sees keys
up to its limit (its own position, or past it to its block's end) and, in a sliding variant, none older than the
window; against a dense reference, for the torch backend, the compiled CPU kernels' backend and the Triton
backend (both prefill kernels read the limits)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_ops
from pagedserve.worker.attention import TritonAttentionBackend
from pagedserve.worker.torch_attention import CpuKernelAttentionBackend, TorchAttentionBackend
from test_attention import DIM, build_step

CONTEXTS, QUERIES = (0, 1, 9, 0), (1, 1, 7, 12)  # two decodes, a chunk after 9 cached tokens, a first chunk
# (flat row of the step, rows, last key position): a block at positions 11..14 of the third sequence (rows 4..7
# of the step, whose rows 2..8 are positions 9..15), and one at 3..6 of the fourth (rows 12..15)
BLOCKS = ((4, 4, 14), (12, 4, 6))


def reference(q, keys, values, scale, positions, limits, window):
    group = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(group, dim=1).float(), values.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,lhd->hql", q.float(), k) * scale
    key_pos = torch.arange(keys.shape[0])[None, :]
    allowed = key_pos <= limits[:, None]
    if window:
        allowed &= key_pos > positions[:, None] - window
    return torch.einsum("hql,lhd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def check(backend, window: int, tol: float = 1e-5):
    q, k, v, k_cache, v_cache, meta, seqs = build_step(torch.float32, CONTEXTS, QUERIES, seed=3)
    positions = torch.cat([torch.arange(ctx, ctx + qlen) for ctx, qlen, _ in seqs])
    limits = positions.clone()
    for row, rows, last in BLOCKS:
        limits[row:row + rows] = last
    meta.key_limits = limits
    out = backend.forward(q, k, v, k_cache, v_cache, meta, DIM ** -0.5)
    start, moved = 0, 0.0
    for ctx, qlen, blocks in seqs:
        rows = slice(start, start + qlen)
        flat_k = k_cache[torch.tensor(blocks)].flatten(0, 1)[:ctx + qlen]
        flat_v = v_cache[torch.tensor(blocks)].flatten(0, 1)[:ctx + qlen]
        want = reference(q[rows], flat_k, flat_v, DIM ** -0.5, positions[rows], limits[rows], window)
        causal = reference(q[rows], flat_k, flat_v, DIM ** -0.5, positions[rows], positions[rows], window)
        assert (out[rows] - want).abs().max().item() <= tol, (ctx, qlen)
        moved = max(moved, (want - causal).abs().max().item())
        start += qlen
    assert moved > 1e-2  # the blocks change the answer: a causal backend would fail here


@pytest.mark.parametrize("window", [0, 4, 16])
def test_torch_backend(window):
    check(TorchAttentionBackend().variant(window=window), window)


def cpu_kernels():
    ops = cpu_ops.load()
    if ops is None or not ops.prefill_attention_available():
        pytest.skip("no compiled CPU prefill kernel here (a C++ compiler and AVX-512, or AVX2 with FMA)")
    return ops


@pytest.mark.parametrize("window", [0, 4, 16])
def test_cpu_kernel_backend(window):
    backend = CpuKernelAttentionBackend(cpu_kernels()).variant(window=window)
    assert backend.prefill_kernel  # the compiled prefill kernel, not the torch ops, computes the blocks
    check(backend, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 6])
def test_cpu_prefill_kernel_alone_at_every_split(window, dtype):
    """The compiled prefill kernel with key_limits against the torch backend, for blocks that start and end at
    every offset of its work items (16 tokens of a group of 3 at AVX-512, 8 at AVX2) and of its 16-key tiles,
    and cross them; the ops called directly, so no fallback can stand in for them."""
    from pagedserve.worker.attention import packed_prefills

    ops = cpu_kernels()
    q, k, v, k_cache, v_cache, meta, seqs = build_step(dtype, (5, 0), (40, 24), seed=4)
    positions = torch.cat([torch.arange(ctx, ctx + qlen) for ctx, qlen, _ in seqs])
    chunks, tables = packed_prefills(meta, k_cache.shape[1], torch.device("cpu"))
    torch_backend = TorchAttentionBackend().variant(window=window)
    for row, rows in ((0, 40), (3, 20), (7, 2), (8, 8), (14, 4), (16, 16), (41, 9), (63, 1)):
        limits = positions.clone()
        limits[row:row + rows] = positions[row + rows - 1]
        meta.key_limits = limits
        caches = k_cache.clone(), v_cache.clone()
        want = torch_backend.forward(q, k, v, *caches, meta, DIM ** -0.5)  # (writes the step's K/V)
        got = torch.zeros_like(q)
        ops.paged_prefill_attention(q, *caches, tables, chunks, DIM ** -0.5, got, window, 0.0, limits)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (got.float() - want.float()).abs().max().item() <= tol, (row, rows)
    with pytest.raises(RuntimeError, match="key_limits: contiguous int64"):
        ops.paged_prefill_attention(q, *caches, tables, chunks, DIM ** -0.5, got, window, 0.0, limits[:-1])


@pytest.mark.parametrize("window", [0, 4, 16])
def test_triton_prefill_kernel(window):
    """The Triton backend's own kernels (under the interpreter here): the prefill kernel reads each row's
    limit, the decodes take the decode kernel, tiles of 16 rows whose limits reach past the tile's end."""
    from triton_device import triton_device

    if triton_device() != "cpu":
        pytest.skip("the step is built on the CPU")
    check(TritonAttentionBackend().variant(window=window), window)


def test_triton_prefill_kernel_alone_at_every_split():
    """paged_prefill_attention with key_limits against the torch backend, for a block that starts and ends at
    each offset of a 16-row tile and crosses the next one, with and without the causal split."""
    from triton_device import triton_device

    if triton_device() != "cpu":
        pytest.skip("the step is built on the CPU")
    from pagedserve.kernels.triton.paged_attention import paged_prefill_attention
    from pagedserve.worker.attention import kernel_metadata

    q, k, v, k_cache, v_cache, meta, seqs = build_step(torch.float32, (5, 0), (40, 24), seed=4)
    positions = torch.cat([torch.arange(ctx, ctx + qlen) for ctx, qlen, _ in seqs])
    for row, rows in ((3, 20), (14, 4), (16, 16), (41, 9)):
        limits = positions.clone()
        limits[row:row + rows] = positions[row + rows - 1]
        meta.key_limits = limits
        caches = k_cache.clone(), v_cache.clone()
        want = TorchAttentionBackend().forward(q, k, v, *caches, meta, DIM ** -0.5)  # (writes the step's K/V)
        tables, lens, starts = kernel_metadata(meta, k_cache.shape[1], k_cache.device)
        for split in (0, 1):
            got = paged_prefill_attention(q, *caches, tables, lens, starts, DIM ** -0.5, causal_split=split,
                                          key_limits=limits)
            assert (got - want).abs().max().item() <= 1e-5, (row, rows, split)
