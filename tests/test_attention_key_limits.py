"""Bidirectional blocks in paged attention (AttentionMetadata.key_limits: Gemma 3's images): each query sees keys
up to its limit (its own position, or past it to its block's end) and, in a sliding variant, none older than the
window; against a dense reference, for the torch backend, the compiled CPU kernels' backend (whose causal
prefill kernel hands such steps to the torch ops) and the Triton backend (which hands them to its reference)."""

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


@pytest.mark.parametrize("window", [0, 4])
def test_triton_hands_the_step_to_its_reference(window):
    """No kernel is launched (the step never reaches Triton): the platform's reference backend answers."""
    check(TritonAttentionBackend(reference=TorchAttentionBackend()).variant(window=window), window)
    q, k, v, k_cache, v_cache, meta, _ = build_step(torch.float32, CONTEXTS, QUERIES)
    meta.key_limits = torch.zeros(q.shape[0], dtype=torch.long)
    with pytest.raises(ValueError, match="causal"):
        TritonAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 1.0)
