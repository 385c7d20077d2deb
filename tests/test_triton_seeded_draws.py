"""The seeded draws' Triton kernel (pagedserve/kernels/triton/seeded_draws.py): the same float32 Exp(1) draws,
bit for bit, as the numpy path the CPU samples with and the torch ops (pagedserve/worker/seeded_draws.py).
Without CUDA the kernel runs under the Triton interpreter (TRITON_INTERPRET=1, set before triton is first
imported)."""

from __future__ import annotations


import numpy as np
import torch

from triton_device import triton_device  # sets up the interpreter before triton.language is imported

DEVICE = triton_device()

from pagedserve.kernels.triton.seeded_draws import seeded_exponentials  # noqa: E402
from pagedserve.worker import seeded_draws  # noqa: E402


def test_the_kernel_draws_what_the_cpu_draws():
    keys = [seeded_draws.stream_key(seed, sample, position)
            for seed, sample, position in [(0, 0, 0), (1, 0, 0), (7, 2, 31), (2**62 + 5, 3, 1000), (123, 0, 1)]]
    vocab = 777  # not a multiple of the block: the last block is masked
    got = seeded_exponentials(torch.tensor(keys, dtype=torch.int64, device=DEVICE), vocab).cpu()
    want = torch.from_numpy(seeded_draws._exponentials_numpy(np.array(keys, dtype=np.int64), vocab))
    assert torch.equal(got, want)
    torch_ops = (-torch.log(seeded_draws.uniforms(torch.tensor(keys), vocab))).float()
    assert torch.equal(got, torch_ops)
    assert torch.isfinite(got).all() and (got > 0).all()


def test_rows_are_independent_of_their_batch():
    keys = torch.tensor([seeded_draws.stream_key(s, 0, 4) for s in range(6)], dtype=torch.int64, device=DEVICE)
    together = seeded_exponentials(keys, 300)
    alone = torch.cat([seeded_exponentials(keys[i:i + 1], 300) for i in (3, 0, 5)])
    assert torch.equal(together[[3, 0, 5]], alone)
    assert seeded_exponentials(keys[:0], 300).shape == (0, 300)
