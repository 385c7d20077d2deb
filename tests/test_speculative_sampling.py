"""Speculative sampling keeps the target distribution exactly: the worker's verification of a row's
proposals (StepSampling.sample over k + 1 positions, then spec_verify.accept), fed the same
logits, emits tokens whose histogram matches plain sampling's (chi-square at the 1% level).

One row of 3 positions over a 12-token vocabulary, 24000 times in one sampler call (the global RNG
seeded, so the test is deterministic; and again with a seed a row, drawn from the rows' keys): the
first emitted token must be distributed as position 0's p0 (a proposal accepted with probability
p0(d0), else the rejection's draw), and the second, among rows that kept d0, as p1. Power: a shift
of 5% of the mass between two tokens gives the two-sample statistic a noncentrality of n1 n2 / (n1 +
n2) * sum (p - q)^2 / p, about 235 for the first histogram (24000 rows a side) and about 180 for the
second (~4800), against a 1% critical value near 20: such a shift is found (the test checks one).
Seeded requests drawing the same tokens with speculation as without: tests/test_speculative.py
(through the engine)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.worker.step_sampling import StepSampling
from pagedserve.worker.request_states import RequestState
from pagedserve.worker.sampler import Sampler

VOCAB = 12
ROWS = 24000
P0 = torch.tensor([0.35, 0.2, 0.15, 0.1, 0.08, 0.05, 0.03, 0.02, 0.01, 0.005, 0.003, 0.002])
P1 = torch.tensor([0.05, 0.1, 0.4, 0.2, 0.1, 0.05, 0.04, 0.03, 0.02, 0.005, 0.003, 0.002])
PROPOSALS = [1, 2]  # d0 has probability 0.2 under p0, d1 0.4 under p1


def verifier() -> StepSampling:
    return StepSampling(Sampler(), None, (), torch.device("cpu"))  # the model runner's sampling half: no model


def chi_square_p(a: torch.Tensor, b: torch.Tensor, min_expected: float = 20.0) -> float:
    """Two-sample chi-square test of homogeneity on counts a, b (sparse cells merged); its p-value."""
    order = torch.argsort(a + b, descending=True)
    a, b = a[order].double(), b[order].double()
    keep = int(((a + b) * min(a.sum(), b.sum()) / (a.sum() + b.sum()) >= min_expected).sum())
    a = torch.cat([a[:keep], a[keep:].sum(0, keepdim=True)])
    b = torch.cat([b[:keep], b[keep:].sum(0, keepdim=True)])
    table = torch.stack([a, b])
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected.clamp_min(1e-12)).sum()
    dof = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("seeded", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(seeded):
    """Unseeded rows draw from the global RNG; seeded ones, one seed a row, from their keys (seeded_draws.py)."""
    torch.manual_seed(1234)
    params = [SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, seed=i if seeded else None)
              for i in range(ROWS)]
    states = [RequestState(f"r{i}", [5, 6, 7], 3, params[i], [], 2, 0, [], [], spec_token_ids=PROPOSALS)
              for i in range(ROWS)]
    logits = torch.stack([P0.log(), P1.log(), P1.roll(3).log()]).repeat(ROWS, 1)
    emitted = verifier().sample(logits, states).result()
    runs = [[t.token_id for t in emitted[s.req_id]] for s in states]
    first = torch.bincount(torch.tensor([r[0] for r in runs]), minlength=VOCAB)
    second = torch.bincount(torch.tensor([r[1] for r in runs if len(r) > 1]), minlength=VOCAB)
    kept_d0 = int(first[PROPOSALS[0]])
    assert 0.17 * ROWS < kept_d0 < 0.23 * ROWS  # d0 kept as often as p0 draws it
    assert int(second.sum()) == kept_d0
    plain_first = torch.bincount(torch.multinomial(P0, ROWS, replacement=True), minlength=VOCAB)
    plain_second = torch.bincount(torch.multinomial(P1, kept_d0, replacement=True), minlength=VOCAB)
    assert chi_square_p(first, plain_first) > 0.01
    assert chi_square_p(second, plain_second) > 0.01
    # And the test can fail: p0 with 5% of its mass moved from token 0 to token 1.
    shifted = P0.clone()
    shifted[0] -= 0.05
    shifted[1] += 0.05
    assert chi_square_p(first, torch.bincount(torch.multinomial(shifted, ROWS, replacement=True),
                                              minlength=VOCAB)) < 0.01


def test_greedy_verification_keeps_the_argmax_prefix_and_one_more():
    params = SamplingParams(temperature=0.0, max_tokens=64)
    states = [RequestState("a", [5, 6, 7], 3, params, [], 2, 0, [], [], spec_token_ids=[4, 9, 3]),
              RequestState("b", [5, 6, 7], 3, params, [], 2, 0, [], [], spec_token_ids=[4, 9])]
    argmaxes = [4, 9, 1, 8, 4, 2, 3]  # a: 4, 9 kept, 1 instead of 3; b: 4 kept, 2 instead of 9
    logits = torch.nn.functional.one_hot(torch.tensor(argmaxes), VOCAB).float()
    emitted = verifier().sample(logits, states).result()
    assert [t.token_id for t in emitted["a"]] == [4, 9, 1]
    assert [t.token_id for t in emitted["b"]] == [4, 2]
