"""Seeded rows' random draws from a counter-based hash: no torch.Generator, no per-row launch.

A seeded sampling row has a 64-bit key (`stream_key`: its request's seed, sample index and output
position). Its draw at vocabulary index v is splitmix64's output number v + 1 from state key: x = key +
(v + 1) * golden, then the splitmix64 finalizer (xor-shift, multiply, xor-shift, multiply, xor-shift). The
top 52 bits of x make u = (m + 0.5) * 2**-52, exact in float64 and strictly inside (0, 1), and the
row's Exp(1) draw is q = -log(u) (float64, then float32). All of a step's seeded rows are drawn
together by the same fixed handful of elementwise ops over a [rows, vocab] int64 tensor, whatever the
number of rows: no launch per row, no host read (the keys go up once, without blocking).

A draw depends only on (key, v): not on what shares the batch, the row's place in it, earlier calls,
or the process (a preempted or restarted request draws the same). The integer part is exact two's
complement arithmetic (torch's int64 multiply wraps; right shifts of negative int64 are arithmetic, so
each shift is masked to a logical one; the CPU's numpy path has uint64), so the uniforms are bit for bit
the same on the CPU and on CUDA (tests/test_seeded_draws.py checks both paths against a plain-Python
splitmix64, on the CPU: there is no GPU in CI). The token can still differ between devices where the
floats do (the model's logits, softmax, the last bit of a log), as with any sampling.

On the CPU the race does not need every token's draw (`race_cpu`): kernels/cpu/seeded_race.cpp hashes
every token but keeps only those whose ratio can reach the winner's (bounds of -log u that need no
logarithm), and numpy takes the logarithm of those few u: the same q and the same token, bit for bit,
at a fifth of the full form's time (64 rows of 49,152: 126 -> 26 ms on a Zen 1 EPYC).

On CUDA one Triton kernel computes the same (kernels/triton/seeded_draws.py: one launch, 4 bytes a
cell, tested under the interpreter against the numpy path). The torch ops (other devices) cost more:
the ints are [rows, vocab] int64 (8 bytes a cell, reused in place as the float64 uniform), with a
shifted copy of them for each xor-shift, and q comes out float32: about 20 bytes a cell at the peak.

Threads: the worker's torch thread only.
"""

from __future__ import annotations

import numpy as np
import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_ONE_BITS = 0x3FF0000000000000  # float64 1.0: with 52 random mantissa bits, a value in [1, 2)


def _signed(value: int) -> int:
    """A 64-bit value as the int64 holding the same bits."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


def splitmix64(state: int) -> int:
    """The splitmix64 finalizer on a Python int (the reference the tensor version matches), unsigned."""
    x = state & _MASK64
    x = ((x ^ (x >> 30)) * _M1) & _MASK64
    x = ((x ^ (x >> 27)) * _M2) & _MASK64
    return x ^ (x >> 31)


def stream_key(seed: int, sample_index: int, position: int) -> int:
    """The int64 key of a seeded row: (seed, sample, output position) mixed as the generators were
    seeded before, then finalized, so that nearby triples give unrelated streams."""
    mixed = (seed * 0x9E3779B1 + sample_index * 0x85EBCA77 + position * 0xC2B2AE3D) % (2**63)
    return _signed(splitmix64(mixed))


def exponentials(keys: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(keys), vocab] float32 Exp(1) draws q = -log(u) on `device`, row r from keys[r] alone. On the
    CPU in numpy, one thread: on a busy 2-core machine torch's intra-op threads made each of these
    memory-bound passes wait (64 rows x 49152: torch ops 90-175 ms, numpy 21, the per-row generators 65).
    Elsewhere in torch ops. The same uniforms bit for bit either way."""
    if device.type == "cpu":
        return torch.from_numpy(_exponentials_numpy(np.array(keys, dtype=np.int64), vocab))
    host = torch.tensor(keys, dtype=torch.int64)
    if device.type == "cuda":  # one Triton launch, no [rows, vocab] intermediates (kernels/triton/seeded_draws.py)
        from pagedserve.kernels.triton.seeded_draws import seeded_exponentials
        return seeded_exponentials(host.pin_memory().to(device, non_blocking=True), vocab)
    return exponentials_torch(host.to(device), vocab)


# ---- numpy (the CPU): uint64 wraps and shifts logically by itself ---------------------------------

def _exponentials_numpy(keys: np.ndarray, vocab: int) -> np.ndarray:
    x = np.arange(1, vocab + 1, dtype=np.uint64) * np.uint64(_GOLDEN)
    x = keys.view(np.uint64)[:, None] + x[None, :]
    for shift, factor in ((30, _M1), (27, _M2), (31, None)):
        x ^= x >> np.uint64(shift)
        if factor is not None:
            x *= np.uint64(factor)
    x >>= np.uint64(12)
    x |= np.uint64(_ONE_BITS)
    u = x.view(np.float64)
    u -= 1.0 - 2.0**-53  # as in unit_
    return neg_log_(u)


def neg_log_(u: np.ndarray) -> np.ndarray:
    """float32(-log(u)) of float64 uniforms (u overwritten): q, as every CPU path takes it (numpy's
    logarithm of a contiguous float64 array: the same bits for an element wherever it sits)."""
    np.log(u, out=u)
    return np.negative(u, out=np.empty(u.shape, dtype=np.float32), casting="same_kind")


def race_cpu(probs: torch.Tensor, keys: list[int], ops) -> torch.Tensor:
    """argmax(probs / exponentials(keys)) row by row, the same tokens bit for bit, from the few tokens
    that can win (ops.seeded_race_candidates, kernels/cpu/seeded_race.cpp: bounds of -log(u) with no
    logarithm) instead of a logarithm a token. probs: [rows, vocab] float32 on the CPU."""
    counts, index, u = ops.seeded_race_candidates(probs.contiguous(), torch.tensor(keys, dtype=torch.int64))
    q = neg_log_(u.numpy())
    flat = probs.reshape(-1).numpy()
    rows = np.repeat(np.arange(len(keys)) * probs.shape[1], counts.numpy())
    ratios = flat[rows + index.numpy()] / np.maximum(q, np.finfo(np.float32).tiny)  # _race's clamp, then division
    tokens, start = [], 0
    for c in counts.tolist():  # numpy's argmax: the first maximum, or the first NaN (torch's answer)
        tokens.append(int(index[start + int(np.argmax(ratios[start:start + c]))]))
        start += c
    return torch.tensor(tokens, dtype=torch.long)


# ---- torch (the device): int64 with masked shifts -----------------------------------------------

def _xorshift_(x: torch.Tensor, shift: int) -> torch.Tensor:
    """x ^= x >>> shift, in place (>> of int64 is arithmetic: the mask makes it logical)."""
    return x.bitwise_xor_((x >> shift).bitwise_and_((1 << (64 - shift)) - 1))


def hash_bits(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] int64: splitmix64's outputs 1 .. vocab from each row's state key (keys: [rows] int64)."""
    counters = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device).mul_(_signed(_GOLDEN))
    x = keys[:, None] + counters  # wraps, as unsigned addition does
    _xorshift_(x, 30).mul_(_signed(_M1))
    _xorshift_(x, 27).mul_(_signed(_M2))
    return _xorshift_(x, 31)


def uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] float64 u = (m + 0.5) * 2**-52, m the top 52 bits of hash_bits: never 0 nor 1."""
    return unit_(hash_bits(keys, vocab))


def unit_(x: torch.Tensor) -> torch.Tensor:
    """int64 bits -> float64 (m + 0.5) * 2**-52, m their top 52 bits, in x's own memory."""
    x.bitwise_right_shift_(12).bitwise_and_((1 << 52) - 1).bitwise_or_(_ONE_BITS)
    # 1 + m 2**-52 minus (1 - 2**-53) is exact (the operands are within a factor 2 of each other).
    return x.view(torch.float64).sub_(1.0 - 2.0**-53)


def exponentials_torch(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """exponentials in torch ops on keys' device: a fixed dozen elementwise ops for any number of rows."""
    q = torch.empty(keys.shape[0], vocab, device=keys.device)
    torch.log(uniforms(keys, vocab), out=q)
    return q.neg_()
