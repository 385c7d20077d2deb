"""Seeded rows' draws (worker/seeded_draws.py): the counter-based hash is splitmix64 bit for bit (the
published outputs from state 0, and a plain-Python reference for any key, negative ones included), the
CPU's numpy path draws what the torch ops (the GPU's path, run here on the CPU) draw,
the uniforms are strictly inside (0, 1) down to the extreme bit patterns, and seeded sampling is
distributed as the probabilities: one row per seed (and one request's positions), in one sampler
call, against the exact probabilities, chi-square at the 1% level. The keys are fixed, so the test
is deterministic. Power: 24000 draws of a 12-token distribution with 5% of the mass moved between
two tokens give the statistic a noncentrality near 24000 * (0.05^2 / 0.35 + 0.05^2 / 0.2) = 470,
against a 1% critical value near 25: the test checks that such a shift is found."""

from __future__ import annotations

import pytest
import torch

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.worker.sampler import RowSampling, Sampler
from pagedserve.worker.seeded_draws import (exponentials, exponentials_torch, hash_bits, splitmix64, stream_key,
                                             uniforms, unit_)

P = torch.tensor([0.35, 0.2, 0.15, 0.1, 0.08, 0.05, 0.03, 0.02, 0.01, 0.005, 0.003, 0.002])
ROWS = 24000
GOLDEN = 0x9E3779B97F4A7C15


def unsigned(x: int) -> int:
    return x & ((1 << 64) - 1)


def test_hash_is_splitmix64():
    # splitmix64's first outputs from state 0 (Vigna's reference implementation)
    assert [unsigned(b) for b in hash_bits(torch.tensor([0]), 3)[0].tolist()] == \
        [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    keys = [stream_key(7, 0, 0), stream_key(7, 0, 1), stream_key(123456789, 3, 4000), -1, -(2**63), 2**63 - 1]
    bits = hash_bits(torch.tensor(keys), 50).tolist()
    for key, row in zip(keys, bits):
        assert [unsigned(b) for b in row] == [splitmix64(key + GOLDEN * (v + 1)) for v in range(50)]


def test_uniforms_are_strictly_inside_the_unit_interval():
    extremes = unit_(torch.tensor([0, -1, 2**63 - 1, -(2**63), 4095, -4096])).tolist()
    assert extremes == [2.0**-53, 1 - 2.0**-53, 0.5 - 2.0**-53, 0.5 + 2.0**-53, 2.0**-53, 1 - 2.0**-53]
    u = uniforms(torch.tensor([stream_key(s, 0, 0) for s in range(64)]), 4096)
    assert u.dtype == torch.float64 and 0 < u.min() and u.max() < 1
    # 2**18 uniforms in 64 bins: each near 4096 (a chi-square over 63 degrees of freedom)
    counts = torch.bincount((u * 64).long().flatten(), minlength=64).double()
    assert ((counts - 4096) ** 2 / 4096).sum() < 100  # 1% critical value: 92
    q = exponentials_torch(torch.tensor([stream_key(1, 0, 0)]), 8)
    assert q.dtype == torch.float32 and torch.equal(q, -u[1:2, :8].log().float())


def test_the_cpu_path_draws_what_the_device_path_draws():
    """The CPU's numpy path and the torch ops a GPU runs (here on the CPU): the same uniforms bit for bit
    (the hash is integer arithmetic), the same float32 q but for the last bit of a float64 log."""
    keys = [stream_key(s, 1, 2) for s in range(6)] + [-1, -(2**63), 2**63 - 1]
    numpy_q = exponentials(keys, 1000, torch.device("cpu"))
    torch_q = exponentials_torch(torch.tensor(keys), 1000)
    assert numpy_q.dtype == torch.float32 and numpy_q.shape == (9, 1000)
    assert torch.allclose(numpy_q, torch_q, rtol=2**-23, atol=0)
    assert (numpy_q != torch_q).float().mean() < 0.001
    u = uniforms(torch.tensor(keys), 1000)
    assert torch.allclose(numpy_q.double(), -u.log(), rtol=2**-24, atol=0)


def test_a_key_alone_decides_its_row():
    cpu = torch.device("cpu")
    keys = [stream_key(s, 0, 0) for s in range(5)]
    alone = exponentials(keys[2:3], 300, cpu)
    assert torch.equal(exponentials(keys, 300, cpu)[2], alone[0])
    assert torch.equal(exponentials(keys[::-1], 300, cpu)[2], alone[0])
    assert not torch.equal(exponentials(keys[3:4], 300, cpu), alone)
    on_device = exponentials_torch(torch.tensor(keys), 300)
    assert torch.equal(on_device[2], exponentials_torch(torch.tensor(keys[2:3]), 300)[0])


def gof_p(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 20.0) -> float:
    """Chi-square goodness of fit of counts to probs (sparse cells merged); its p-value."""
    order = torch.argsort(probs, descending=True)
    counts, expected = counts[order].double(), probs[order].double() * counts.sum()
    keep = int((expected >= min_expected).sum())
    if keep < len(counts):
        counts = torch.cat([counts[:keep], counts[keep:].sum(0, keepdim=True)])
        expected = torch.cat([expected[:keep], expected[keep:].sum(0, keepdim=True)])
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def seeded_counts(keys: list[int], **kw) -> torch.Tensor:
    params = SamplingParams(**kw)
    rows = [RowSampling(params, key, [], [], ()) for key in keys]
    tokens = Sampler()(P.log().repeat(len(keys), 1), rows).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=len(P))


def test_seeded_draws_follow_the_probabilities():
    per_seed = seeded_counts([stream_key(seed, 0, 0) for seed in range(ROWS)], temperature=1.0)
    assert gof_p(per_seed, P) > 0.01
    per_position = seeded_counts([stream_key(42, 1, pos) for pos in range(ROWS)], temperature=1.0)
    assert gof_p(per_position, P) > 0.01
    shifted = P.clone()
    shifted[0] -= 0.05
    shifted[1] += 0.05
    assert gof_p(per_seed, shifted) < 0.01 and gof_p(per_position, shifted) < 0.01
    # with truncation too: top_k=4 renormalises the first four
    top4 = seeded_counts([stream_key(seed, 0, 7) for seed in range(ROWS)], temperature=1.0, top_k=4)
    assert top4[4:].sum() == 0 and gof_p(top4[:4], P[:4] / P[:4].sum()) > 0.01


def full_race(probs: torch.Tensor, keys: list[int]) -> torch.Tensor:
    """The race over every token's draw, as the sampler ran it before the candidates (and still runs
    it off the CPU): argmax(probs / q), q = exponentials(keys)."""
    q = exponentials(keys, probs.shape[1], probs.device).clamp_min_(torch.finfo(torch.float32).tiny)
    return (probs / q).argmax(-1)


def test_the_candidates_race_draws_the_full_races_tokens_bit_for_bit():
    """race_cpu (seeded_race.cpp's bounds of -log u, then numpy's logarithm of the candidates' u alone)
    against the full race, on rows of every shape a sampler hands it: peaked and flat (temperature 2
    over a 49,152 vocabulary: thousands of near-equal ratios), rows truncated to a few tokens (zeros),
    two-token rows at exactly equal probability (ties), all over many keys. Also: numpy's logarithm
    gives an element the same bits whether it sits in the whole row or among a few (what the
    equality rests on), and the candidates are few."""
    import numpy as np
    from pagedserve.kernels import cpu_ops
    from pagedserve.worker.seeded_draws import neg_log_, race_cpu
    ops = cpu_ops.load()
    if ops is None:
        pytest.skip("no C++ compiler for the CPU kernels here")
    gen = torch.Generator().manual_seed(5)
    vocab = 49152
    logits = torch.randn(48, vocab, generator=gen) * torch.tensor([0.5, 2.0, 6.0, 12.0]).repeat(12)[:, None]
    probs = logits.softmax(-1)
    probs[40:44, 10:] = 0.0  # truncated rows: ten tokens left
    probs[40:44] /= probs[40:44].sum(-1, keepdim=True)
    probs[44:] = 0.0
    probs[44:, 7] = probs[44:, 9000] = 0.5  # a tie between two tokens
    for batch in range(4):
        keys = [stream_key(1000 * batch + r, r % 3, 17 * batch + r) for r in range(48)]
        assert torch.equal(race_cpu(probs, keys, ops), full_race(probs, keys)), batch
        counts, _, _ = ops.seeded_race_candidates(probs, torch.tensor(keys))
        assert counts.min().item() >= 1 and counts.float().mean().item() < 8, counts
    u = uniforms(torch.tensor(keys[:4]), vocab).numpy().copy()
    whole = neg_log_(u.copy())
    picked = np.sort(np.random.default_rng(0).choice(u.size, 997, replace=False))
    assert np.array_equal(neg_log_(u.reshape(-1)[picked].copy()), whole.reshape(-1)[picked])


def test_the_candidates_race_follows_nan_rows_as_the_full_race():
    """A row with NaN probabilities (a model that overflowed) answers the first NaN in both forms."""
    from pagedserve.kernels import cpu_ops
    from pagedserve.worker.seeded_draws import race_cpu
    ops = cpu_ops.load()
    if ops is None:
        pytest.skip("no C++ compiler for the CPU kernels here")
    probs = torch.full((2, 300), 1 / 300)
    probs[0, 123] = probs[0, 200] = float("nan")
    keys = [stream_key(3, 0, 0), stream_key(4, 0, 0)]
    got = race_cpu(probs, keys, ops).tolist()
    assert got == full_race(probs, keys).tolist() and got[0] == 123
