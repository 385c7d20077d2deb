"""top_p's nucleus for chosen rows of a logits matrix, in place, in one Triton launch and without a sort.

The rule is worker/truncation.py's: a row keeps token i when the probability mass of the tokens more likely
than i is below top_p (the smallest prefix of the row sorted by probability that reaches top_p; tokens of
equal probability at the prefix's edge are kept together); the others become -inf. A GPU step may not read
a device value to decide how many candidates to look at, so until now those rows sorted the whole
vocabulary (torch.sort: a segmented radix sort of rows x vocabulary keys).

One program a row: its maximum m, its Z = sum(exp(x - m)), then the kept set as a threshold. With
e = exp(x - m) in [0, 1], non-negative floats order as their int32 bits, so "mass(e > e_i) < top_p * Z" holds
exactly for the tokens whose bits are at least the smallest bit pattern B with mass(e > B) < top_p * Z. B is
found by bisection over the integers [-1, bits(1.0)]: 30 halvings (the range holds under 2**30 patterns)
leave it exact, each pass summing the row's masses above the middle pattern. A last pass writes -inf below
B. The row is read 33 times, from L1 and L2 after the first (a 49,152-token float32 row is 192 KB); its
sums are float32, as the sort's cumulative sums are, so a token whose preceding mass lies within rounding
of top_p may fall on the other side than the sort puts it.

A row whose tokens are all -inf is left as it is. Rows are given by index (int64), top_p per row (float32,
in (0, 1]); the kernel reads and writes x's dtype and computes in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton import is_interpreted

BISECTION_STEPS = 30  # 0x3F800000 + 2 patterns in [-1, bits(1.0)] < 2**30
ONE_BITS = 0x3F800000  # bits of 1.0: e of the row's most likely token


@triton.jit
def _nucleus_kernel(x_ptr, rows_ptr, top_p_ptr, vocab, stride, BLOCK: tl.constexpr, STEPS: tl.constexpr,
                    ONE: tl.constexpr):
    """Program (row of the index)."""
    pid = tl.program_id(0)
    row = tl.load(rows_ptr + pid).to(tl.int64)
    top_p = tl.load(top_p_ptr + pid).to(tl.float32)
    base = x_ptr + row * stride
    offs = tl.arange(0, BLOCK)
    peak = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        peak = tl.maximum(peak, tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32))
    m = tl.max(peak, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every token -inf: e = 0 everywhere, nothing changes
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        total += tl.exp(tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) - m)
    need = tl.where(top_p < 1.0, top_p, 2.0) * tl.sum(total, 0)  # top_p 1 keeps all, whatever the rounding
    lo = tl.full([], -1, tl.int32)  # mass(e > lo) >= need: every token's mass (lo's pattern is below 0.0)
    hi = tl.full([], ONE, tl.int32)  # mass(e > 1.0) = 0 < need
    for _ in range(STEPS):
        mid = lo + (hi - lo) // 2
        above = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + offs
            e = tl.exp(tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) - m)
            above += tl.where(e.to(tl.int32, bitcast=True) > mid, e, 0.0)
        below = tl.sum(above, 0) < need
        hi = tl.where(below, mid, hi)
        lo = tl.where(below, lo, mid)
    drop = tl.full([BLOCK], float("-inf"), tl.float32).to(x_ptr.dtype.element_ty)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        inside = cols < vocab
        e = tl.exp(tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32) - m)
        tl.store(base + cols, drop, mask=inside & (e.to(tl.int32, bitcast=True) < hi))


def nucleus_(x: torch.Tensor, rows: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Masks to -inf, in place, the tokens outside top_p's nucleus of x's rows `rows` (int64 [R], on x's
    device), top_p [R] float32 in (0, 1] (1: the row as it is); returns x ([N, V], rows contiguous)."""
    if x.stride(1) != 1:
        raise ValueError("nucleus_ needs rows of contiguous tokens")
    if rows.numel():
        block = 256 if is_interpreted(x) else 4096
        _nucleus_kernel[(rows.numel(),)](x, rows, top_p, x.shape[1], x.stride(0), BLOCK=block,
                                          STEPS=BISECTION_STEPS, ONE=ONE_BITS, num_warps=8)
    return x
