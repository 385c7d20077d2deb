"""The fused CPU kernels against the plain torch ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_ops
from pagedserve.worker.models.llama import apply_rotary

ops = cpu_ops.load()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ compiler for the CPU kernels here")

TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens, inter", [(1, 8), (7, 37), (33, 1536)])
def test_silu_and_mul(dtype, tokens, inter):
    x = (torch.randn(tokens, 2 * inter) * 4).to(dtype)
    gate, up = x.float().chunk(2, dim=-1)
    ref = F.silu(gate) * up
    got = ops.silu_and_mul(x).float()
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_qkv_views(dtype):
    tokens, heads, kv_heads, dim = 11, 6, 2, 32
    positions = torch.tensor([0, 5, 3, 100, 7, 8, 9, 60, 1, 2, 77])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(128).float(), inv_freq)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    ref_q, ref_k = apply_rotary(q.float(), c, s), apply_rotary(k.float(), c, s)
    untouched = qkv[:, (heads + kv_heads) * dim:].clone()
    ops.rotary_inplace(q, k, cos, sin, positions)
    tol = TOLERANCE[dtype]
    assert torch.allclose(q.float(), ref_q, rtol=tol, atol=tol)
    assert torch.allclose(k.float(), ref_k, rtol=tol, atol=tol)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], untouched)  # v is left alone


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 8])
def test_small_m_linear(rows):
    x, w = torch.randn(rows, 72), torch.randn(37, 72)
    assert torch.allclose(ops.small_m_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_small_m_linear_rejects_bad_input():
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ops.small_m_linear(torch.randn(2, 7), torch.randn(3, 7))
    with pytest.raises(RuntimeError, match="float32"):
        ops.small_m_linear(torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(3, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens, hidden", [(1, 64), (7, 37), (33, 576)])
def test_rms_norm_with_and_without_residual(dtype, tokens, hidden):
    from pagedserve.worker.models.llama import RMSNorm

    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = (torch.randn(hidden) * 0.5 + 1).to(dtype)
    x, residual = (torch.randn(tokens, hidden) * 3).to(dtype), (torch.randn(tokens, hidden) * 3).to(dtype)
    tol = TOLERANCE[dtype]
    assert torch.allclose(ops.rms_norm(x, norm.weight, 1e-5).float(), norm(x).float(), rtol=tol, atol=tol)
    total = residual + x
    got = ops.rms_norm(x, norm.weight, 1e-5, residual)
    assert torch.equal(residual, total)  # the residual add happened in place, rounded as torch rounds it
    assert torch.allclose(got.float(), norm(total).float(), rtol=tol, atol=tol)
    if dtype == torch.bfloat16:  # rounded where transformers rounds: equal, not just close
        assert torch.equal(got, norm(total))


def test_rms_norm_rejects_bad_input():
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="residual must match"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-5, torch.randn(3, 8))


@pytest.mark.parametrize("n", [1, 7, 16, 17, 100, 49152])
def test_argmax_rows_is_torch_argmax(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(9, n, generator=gen)
    x[1] = 3.0  # every element ties: the first index
    x[2, n // 2:] = x[2].max() + 1  # ties at the maximum: the first of them
    x[3] = float("-inf")
    x[4, n - 1] = float("nan")  # torch's argmax answers the (first) NaN
    x[5, :: max(1, n // 3)] = float("nan")
    x[6] = x[6].round()  # many ties across SIMD lanes
    assert torch.equal(ops.argmax_rows(x), x.argmax(-1))


def test_argmax_rows_rejects_bad_input():
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ops.argmax_rows(torch.zeros(2, 4, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ops.argmax_rows(torch.zeros(4, 2).t())


def _inverse_cdf_float64(y: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact rule draw_rows computes: the first token whose cumulative softmax(y) passes u (float64), and
    that cumulative sum."""
    cdf = torch.softmax(y.double(), -1).cumsum(-1)
    return torch.searchsorted(cdf, u.double()[:, None], right=True).squeeze(1).clamp_max(y.shape[1] - 1), cdf


@pytest.mark.parametrize("n", [1, 5, 16, 17, 100, 49152])
def test_draw_rows_is_the_inverse_transform_of_softmax(n):
    """Each row's token is the first whose cumulative softmax passes u, as in float64 (a token whose cumulative
    sum lies within float32's rounding of u may fall either way); -inf tokens are never drawn."""
    gen = torch.Generator().manual_seed(n)
    y = torch.randn(400, n, generator=gen) * 3
    y[::3, ::2] = float("-inf")  # truncated tokens
    y[::3, -1] = 0.5  # (one token left where n is 1)
    y[1::7] = y[1::7].round()  # ties
    u = torch.rand(400, generator=gen)
    got = ops.draw_rows(y.clone(), u)
    want, cdf = _inverse_cdf_float64(y, u)
    near = (cdf - u.double()[:, None]).abs().amin(-1) < 1e-5
    assert torch.equal(got[~near], want[~near]) and (got == want).float().mean() > 0.9
    before = torch.where(got > 0, cdf.gather(1, (got - 1).clamp_min(0)[:, None]).squeeze(1), 0.0)
    assert (before <= u + 1e-5).all() and (cdf.gather(1, got[:, None]).squeeze(1) > u - 1e-5).all()
    assert not torch.isinf(y.gather(1, got[:, None])).any()


def test_draw_rows_edges():
    """u at float32's largest value below 1 takes the last token of positive weight (the walk's rounding);
    a row of -inf draws its first token; scores far below the max get no weight; y becomes exp(y - max)."""
    y = torch.full((4, 37), float("-inf"))
    y[0, [3, 20, 30]] = torch.tensor([1.0, 2.0, 0.5])
    y[1, [3, 20, 30]] = torch.tensor([1.0, 2.0, 0.5])
    y[3, 0], y[3, 36] = 0.0, -200.0  # exp(-200) is 0 in float32 too
    u = torch.tensor([0.0, 1.0 - 2 ** -24, 0.5, 1.0 - 2 ** -24])
    work = y.clone()
    assert ops.draw_rows(work, u).tolist() == [3, 30, 0, 0]
    assert torch.allclose(work[0, [3, 20, 30]], torch.exp(y[0, [3, 20, 30]] - 2.0))
    assert work[0].count_nonzero() == 3


def test_draw_rows_follows_the_distribution():
    """20,000 draws of one row (a fixed torch seed: deterministic) against its probabilities."""
    gen = torch.Generator().manual_seed(3)
    row = torch.tensor([0.0, 1.0, float("-inf"), 2.0, -1.0, 0.3] * 6)
    draws = ops.draw_rows(row.repeat(20000, 1), torch.rand(20000, generator=gen))
    freq = torch.bincount(draws, minlength=36).double() / 20000
    assert (freq - torch.softmax(row.double(), -1)).abs().max() < 0.01 and freq[2::6].sum() == 0


def _nucleus_draw_float64(y: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                          u: torch.Tensor):
    """nucleus_draw_rows' rule in float64: token i stays when fewer than top_k tokens are more likely (0: no
    top_k), when the mass of the tokens more likely than i is below top_p x the mass top_k kept (ties together)
    and when exp(y_i - max) >= min_p; then the first kept token whose cumulative weight passes u x the kept
    total. Returns (tokens, the rows' distance to an edge of the rules' sums)."""
    e = (y.double() - y.double().amax(-1, keepdim=True)).exp()
    more = e[:, None, :] > e[:, :, None]  # [rows, i, j]: j more likely than i
    by_k = (top_k[:, None] == 0) | (more.sum(-1) < top_k[:, None])
    total = torch.where(by_k, e, 0.0).sum(-1, keepdim=True)
    above = (e[:, None, :] * more).sum(-1)  # [rows, n]: mass of the more likely
    need = torch.where(top_p[:, None] < 1, top_p[:, None].double() * total, 2 * total)
    kept = by_k & (above < need) & (e >= min_p[:, None].double()) & (e > 0)
    w = torch.where(kept, e, 0.0)
    cdf = w.cumsum(-1) / w.sum(-1, keepdim=True)
    tokens = torch.searchsorted(cdf, u.double()[:, None], right=True).squeeze(1).clamp_max(y.shape[1] - 1)
    edge = torch.minimum(((above - need) / total).abs().amin(-1), (cdf - u.double()[:, None]).abs().amin(-1))
    return tokens, edge


@pytest.mark.parametrize("n", [7, 16, 515])
def test_nucleus_draw_rows_is_the_rule_in_float64(n):
    """Rows of random logits (peaked ones, flat ones, ties, -inf tokens) with top_k, top_p, min_p and their
    mixes: each row's token is the float64 rule's, unless the row lies within float32 rounding of an edge."""
    gen = torch.Generator().manual_seed(n)
    y = torch.randn(300, n, generator=gen) * 2
    y[::5, : max(1, n // 8)] += 6  # peaked
    y[1::5] = y[1::5].round()  # ties
    y[2::5, 1::3] = float("-inf")
    top_p = torch.tensor([0.2, 0.6, 0.9, 0.95, 1.0, 0.5])[torch.arange(300) % 6]
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.3, 0.05, 0.0])[torch.arange(300) % 7]
    top_k = torch.tensor([0, 3, 0, 0, 1, 40, 0, 5, 0, 11, 0])[torch.arange(300) % 11].clamp_max(n - 1)
    u = torch.rand(300, generator=gen)
    got = ops.nucleus_draw_rows(y.clone(), top_k, top_p, min_p, u)
    want, edge = _nucleus_draw_float64(y, top_k, top_p, min_p, u)
    clear = edge > 1e-5
    assert clear.float().mean() > 0.9 and torch.equal(got[clear], want[clear])


def test_nucleus_draw_rows_keeps_ties_at_the_edge_together():
    """Four tokens of 0.25 and top_p 0.5, or top_k 2: all four stay (the mass before each is 0 < 0.5; none has
    2 more likely), so over many u the draws reach every one; with a fifth token of 0.3, top_k 1 keeps it alone;
    no top_k, top_p 1 and min_p 0 is draw_rows; all -inf draws the first token."""
    y = torch.zeros(4000, 4)
    u = torch.rand(4000, generator=torch.Generator().manual_seed(1))
    none, half = torch.zeros(4000, dtype=torch.long), torch.full((4000,), 0.5)
    assert set(ops.nucleus_draw_rows(y.clone(), none, half, torch.zeros(4000), u).tolist()) == {0, 1, 2, 3}
    two = torch.full((4000,), 2, dtype=torch.long)
    assert set(ops.nucleus_draw_rows(y.clone(), two, torch.ones(4000), torch.zeros(4000), u).tolist()) == {0, 1, 2, 3}
    five = torch.log(torch.tensor([[0.175, 0.175, 0.3, 0.175, 0.175]])).expand(4000, 5).contiguous()
    one = torch.ones(4000, dtype=torch.long)
    assert set(ops.nucleus_draw_rows(five, one, torch.ones(4000), torch.zeros(4000), u).tolist()) == {2}
    z = torch.randn(50, 100, generator=torch.Generator().manual_seed(2))
    v = torch.rand(50, generator=torch.Generator().manual_seed(3))
    whole = ops.nucleus_draw_rows(z.clone(), torch.zeros(50, dtype=torch.long), torch.ones(50), torch.zeros(50), v)
    assert torch.equal(whole, ops.draw_rows(z.clone(), v))
    dead = torch.full((2, 9), float("-inf"))
    top_k, top_p, min_p = torch.tensor([3, 0]), torch.tensor([0.5, 1.0]), torch.tensor([0.1, 0.0])
    assert ops.nucleus_draw_rows(dead, top_k, top_p, min_p, torch.rand(2)).tolist() == [0, 0]


def test_draw_rows_rejects_bad_input():
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ops.draw_rows(torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(2))
    with pytest.raises(RuntimeError, match="u must be"):
        ops.draw_rows(torch.zeros(2, 4), torch.zeros(3))
    with pytest.raises(RuntimeError, match="top_p and min_p"):
        ops.nucleus_draw_rows(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), torch.zeros(3), torch.zeros(2),
                              torch.zeros(2))
    with pytest.raises(RuntimeError, match="top_k must be"):
        ops.nucleus_draw_rows(torch.zeros(2, 4), torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.zeros(2))


@pytest.mark.parametrize("n, k", [(8, 8), (20, 3), (21, 5), (100, 8), (49152, 8)])
def test_top_indices_is_torch_topk(n, k):
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(7, n, generator=gen)
    x[1, : n // 2] = float("-inf")
    x[2, n - 1] = 50.0  # the largest in the last element (a tail past the vectors)
    got = ops.top_indices(x, k)
    want = x.topk(k, dim=1).values
    assert torch.equal(x.gather(1, got).sort(dim=1, descending=True).values, want)
    assert all(len(set(row)) == k for row in got.tolist())
    with pytest.raises(RuntimeError, match="k must be"):
        ops.top_indices(x, n + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(8, 8), (20, 3), (100, 8), (49152, 8)])
def test_logits_top_is_float_copy_and_topk(dtype, n, k):
    gen = torch.Generator().manual_seed(n + k)
    x = (torch.randn(6, n, generator=gen) * 4).to(dtype)
    x[1] = x[1].sort().values  # rising: every vector changes the candidates
    x[2] = 1.0  # all ties
    out, top = ops.logits_top(x, k)
    assert out.dtype == torch.float32 and torch.equal(out, x.float())
    assert top.shape == (6, k) and all(len(set(row)) == k for row in top.tolist())
    # Ties may pick other indices than torch; the values picked are the same.
    assert torch.equal(out.gather(1, top).sort(1).values, x.float().topk(k, 1).values.sort(1).values)


def test_logits_top_rejects_bad_k():
    with pytest.raises(RuntimeError, match="k must be in 1..4"):
        ops.logits_top(torch.zeros(2, 4), 5)


def test_every_process_of_one_environment_builds_with_its_own_ninja(monkeypatch):
    """A process started without the environment activated found another ninja on PATH, whose log
    disagreed with the environment's: each rebuilt the kernels the other had built."""
    import os
    import sys
    from pathlib import Path

    from pagedserve.kernels import cpu_ops
    own = Path(sys.executable).parent
    if not (own / "ninja").exists():
        pytest.skip("no ninja beside this python")
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", "/bin"]))
    cpu_ops._prefer_own_ninja()
    assert os.environ["PATH"].split(os.pathsep) == [str(own), "/usr/bin", "/bin"]
    cpu_ops._prefer_own_ninja()  # once is enough
    assert os.environ["PATH"].split(os.pathsep)[:2] == [str(own), "/usr/bin"]


def test_rows_with_inf_or_nan_logits_draw_within_the_row():
    """A logit over a tiny temperature is +inf; a model that overflowed gives NaN. e = exp(y - max) was then
    NaN (+inf - +inf, or a NaN token), and the thresholds' histograms, which index buckets by e's bits, wrote
    past their end (the worker's heap corrupted under the stack's fuzz test, on an AVX2 EPYC). Now the +inf
    tokens of a row share it, NaN tokens are never drawn, and an all-NaN row draws its first token, with every
    truncation (top_k, top_p, min_p) and without (draw_rows)."""
    n, rows = 300, 64
    u = torch.rand(rows, generator=torch.Generator().manual_seed(3))
    y = torch.randn(rows, n, generator=torch.Generator().manual_seed(4))
    y[:, 17] = y[:, 250] = float("inf")
    y[:, 40] = y[:, 299] = float("nan")
    nan_rows = torch.randn(rows, n, generator=torch.Generator().manual_seed(5))
    nan_rows[:, ::3] = float("nan")
    all_nan = torch.full((rows, n), float("nan"))
    cases = [(torch.zeros(rows, dtype=torch.long), torch.ones(rows), torch.zeros(rows)),  # no truncation
             (torch.full((rows,), 5, dtype=torch.long), torch.ones(rows), torch.zeros(rows)),
             (torch.zeros(rows, dtype=torch.long), torch.full((rows,), 0.9), torch.zeros(rows)),
             (torch.full((rows,), 50, dtype=torch.long), torch.full((rows,), 0.5), torch.full((rows,), 0.05))]
    for top_k, top_p, min_p in cases:
        assert set(ops.nucleus_draw_rows(y.clone(), top_k, top_p, min_p, u).tolist()) <= {17, 250}
        got = ops.nucleus_draw_rows(nan_rows.clone(), top_k, top_p, min_p, u)
        assert not torch.isnan(nan_rows[torch.arange(rows), got]).any()
        assert ops.nucleus_draw_rows(all_nan.clone(), top_k, top_p, min_p, u).tolist() == [0] * rows
    assert set(ops.draw_rows(y.clone(), u).tolist()) == {17, 250}
    got = ops.draw_rows(nan_rows.clone(), u)
    assert not torch.isnan(nan_rows[torch.arange(rows), got]).any()
