"""Bidirectional blocks in paged attention (AttentionMetadata.key_limits: Gemma 3's images): each query sees keys
up to its limit (its own position, or past it to its block's end) and, in a sliding variant, none older than the
window; against a dense reference, for the torch backend, the compiled CPU kernels' backend (whose causal
prefill kernel hands such steps to the torch ops) and the Triton backend (its prefill kernel reads the limits)."""

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


@pytest.mark.parametrize("window", [0, 4])
def test_cpu_kernel_backend_takes_the_torch_ops(window):
    ops = cpu_ops.load()
    if ops is None:
        pytest.skip("no C++ compiler for the CPU kernel here")
    check(CpuKernelAttentionBackend(ops).variant(window=window), window)


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
