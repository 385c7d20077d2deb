"""Seeded rows' Exp(1) draws in one Triton kernel (pagedserve/worker/seeded_draws.py gives the scheme and
its numpy and torch forms, which this matches bit for bit in the uniforms): q[r, v] = -log(u), u = (m + 0.5)
* 2**-52, m the top 52 bits of splitmix64's output number v + 1 from state keys[r]. One launch for all
of a step's seeded rows and no [rows, vocab] intermediates: 4 bytes a cell (the float32 output) where
the torch ops' int64 passes peak near 20."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GOLDEN = 0x9E3779B97F4A7C15
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB


@triton.jit
def _seeded_exponentials_kernel(keys_ptr, out_ptr, vocab, stride_out, BLOCK: tl.constexpr):
    """Program (row, vocabulary block)."""
    row = tl.program_id(0)
    v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = v < vocab
    key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
    x = key + (v + 1).to(tl.uint64) * GOLDEN  # uint64: wraps, as splitmix64's state does
    x = (x ^ (x >> 30)) * M1
    x = (x ^ (x >> 27)) * M2
    x = x ^ (x >> 31)
    u = ((x >> 12).to(tl.float64) + 0.5) * 2.220446049250313e-16  # (m + 0.5) * 2**-52: exact, inside (0, 1)
    q = -tl.log(u)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + v, q.to(tl.float32), mask=mask)


def seeded_exponentials(keys: torch.Tensor, vocab: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, vocab] float32 draws for the int64 keys [rows] (on the kernel's device)."""
    rows = keys.shape[0]
    if out is None:
        out = torch.empty(rows, vocab, dtype=torch.float32, device=keys.device)
    if rows and vocab:
        block = 1024 if keys.device.type == "cuda" else 256
        _seeded_exponentials_kernel[(rows, triton.cdiv(vocab, block))](keys, out, vocab, out.stride(0), BLOCK=block)
    return out
