"""Sampler: greedy, temperature/top-k/top-p/min-p, penalties, min_tokens, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.worker.penalties import apply_penalties
from pagedserve.worker.logit_rules import block_min_tokens
from pagedserve.worker.sampler import RowSampling, Sampler, truncate
from pagedserve.worker.seeded_draws import stream_key
from sampling_rows import mixed_truncation_rows

sampler = Sampler()


def row(params=None, seed=None, position=0, prompt=(), output=(), eos=(), **kw) -> RowSampling:
    """A seeded row's draw is a function of (seed, position): a fresh draw needs a new position."""
    params = params or SamplingParams(**kw)
    key = stream_key(seed, 0, position) if seed is not None else None
    return RowSampling(params, key, list(prompt), list(output), tuple(eos))


def logits_from_probs(probs, order=None) -> torch.Tensor:
    """[1, V] logits whose softmax is probs, placed at token ids `order` (default identity)."""
    lp = torch.tensor(probs, dtype=torch.float32).log()
    if order is None:
        return lp[None]
    out = torch.empty_like(lp)
    out[torch.tensor(order)] = lp
    return out[None]


def support(logits: torch.Tensor, n: int = 1000, seed: int = 0, **kw) -> set[int]:
    return {sampler(logits, [row(seed=seed, position=i, **kw)]).token_ids[0] for i in range(n)}


# ---- greedy -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    logits = torch.randn(8, 97, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = sampler(logits, [row(temperature=0.0) for _ in range(8)])
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_input_logits_not_modified():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    sampler(logits, [row(temperature=0.0, repetition_penalty=2.0, output=[1, 2], logprobs=3),
                     row(seed=1, min_tokens=5, eos=[int(logits[1].argmax())], top_p=0.5)])
    assert torch.equal(logits, before)


# ---- temperature / top-k / top-p / min-p --------------------------------------------------------

def test_sampling_follows_softmax_over_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 6000
    counts = torch.bincount(torch.tensor([sampler(logits, [row(seed=3, position=i, temperature=2.0)]).token_ids[0]
                                          for i in range(n)]),
                            minlength=4).float() / n
    assert torch.allclose(counts, (logits[0] / 2.0).softmax(-1), atol=0.025)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: the device's cumsum and search"))])
def test_unseeded_rows_follow_softmax_and_never_draw_a_masked_token(device):
    """Rows without a seed draw by the inverse CDF (one uniform a row): 20,000 rows of one distribution with
    tokens of probability 0 (top_k truncates them, and a logit of -inf) land on the others in proportion."""
    logits = torch.tensor([[2.0, float("-inf"), 1.0, 0.0, -1.0, -3.0]], device=device).expand(20000, 6).contiguous()
    torch.manual_seed(11)
    out = sampler(logits, [row(temperature=1.5, top_k=4) for _ in range(20000)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=6).float() / 20000
    want = torch.tensor([2.0, float("-inf"), 1.0, 0.0, -1.0, float("-inf")]).div(1.5).softmax(-1)
    if device == "cuda":  # and a greedy batch's argmax in the logits' own dtype
        half = logits.to(torch.bfloat16)[:4]
        assert sampler(half, [row(temperature=0.0)] * 4).token_ids == [0] * 4
    assert counts[1] == 0 and counts[5] == 0
    assert torch.allclose(counts, want, atol=0.015), (counts, want)


def test_low_temperature_concentrates():
    logits = torch.tensor([[1.0, 0.6, 0.5, 0.2]])
    assert support(logits, n=300, temperature=0.01) == {0}


def test_top_k_restricts_support():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9, 0.0, 2.8, 1.0, 0.5]])
    assert support(logits, temperature=1.0, top_k=3) == {1, 3, 5}
    assert support(logits, temperature=1.0, top_k=1) == {1}
    assert support(logits, n=3000, temperature=1.0, top_k=-1) == set(range(8))


@pytest.mark.parametrize("top_p, kept", [(0.4, {0}), (0.75, {0, 1}), (0.9, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_smallest_set(top_p, kept):
    order = [3, 0, 2, 1]  # token ids holding probs 0.5, 0.3, 0.15, 0.05: not in id order
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05], order)
    assert support(logits, top_p=top_p) == {order[i] for i in kept}


def test_top_p_applies_after_top_k():
    # top_k=2 renormalises {0: .4, 1: .3} to {.57, .43}; top_p=.5 then keeps only token 0.
    # Without renormalisation, .4 < .5 would have kept token 1 as well.
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.1])
    assert support(logits, top_k=2, top_p=0.5) == {0}


@pytest.mark.parametrize("min_p, kept", [(0.2, {0, 1, 2}), (0.5, {0, 1}), (1.0, {0})])
def test_min_p_restricts_support(min_p, kept):
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05])
    assert support(logits, min_p=min_p) == kept


def _must(ok: bool) -> None:
    assert ok, "the data lies within rounding of a top_p or min_p edge"


def _reference_allowed(logits: list[float], p: SamplingParams, near_edge=assume) -> set[int]:
    """Plain-Python top-k -> top-p -> min-p over temperature-scaled logits (near_edge(False): the data is
    within float32 rounding of an edge: hypothesis's assume, else an assertion)."""
    ids = sorted(range(len(logits)), key=lambda i: -logits[i])
    if p.top_k > 0:
        ids = ids[:p.top_k]
    scaled = [logits[i] / p.temperature for i in ids]
    m = max(scaled)
    w = [math.exp(s - m) for s in scaled]
    probs = [v / sum(w) for v in w]
    keep, mass = [], 0.0
    for i, pr in zip(ids, probs):
        if p.top_p < 1.0 and mass >= p.top_p:
            break
        near_edge(p.top_p == 1.0 or abs(mass - p.top_p) > 1e-4)  # float32 cumsum may round either way this close
        keep.append((i, pr))
        mass += pr
    total = sum(pr for _, pr in keep)
    top = max(pr for _, pr in keep) / total
    near_edge(p.min_p == 0.0 or all(abs(pr / total - p.min_p * top) > 1e-5 for _, pr in keep))
    return {i for i, pr in keep if pr / total >= p.min_p * top}


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_truncate_matches_reference(data):
    vocab = data.draw(st.integers(2, 12))
    logits = data.draw(st.lists(st.integers(-8, 8), min_size=vocab, max_size=vocab, unique=True))
    logits = [v / 2 for v in logits]  # distinct values: no ties to break differently
    p = SamplingParams(temperature=data.draw(st.sampled_from([0.5, 1.0, 2.0])),
                       top_k=data.draw(st.integers(-1, vocab + 1)),
                       top_p=data.draw(st.sampled_from([0.1, 0.3, 0.6, 0.9, 1.0])),
                       min_p=data.draw(st.sampled_from([0.0, 0.05, 0.3])))
    # top_p alone: guesses of 1-4 candidates hold the nucleus or fall back to the next, then the sort; (): the sort
    guesses = data.draw(st.sampled_from([(1,), (2,), (1, 4), (2, 64), ()]))
    x = truncate(torch.tensor([logits]) / p.temperature, [p], nucleus_guesses=guesses)
    got = set(torch.nonzero(x[0] > float("-inf")).flatten().tolist())
    want = _reference_allowed(logits, p)
    assert got == want


def test_nucleus_from_candidates_or_the_sort_row_by_row():
    """A batch over a 1,000-token vocabulary: top_k rows from their candidates, top_p rows whose nucleus lies
    in the first guess (peaked) and rows whose nucleus is wider (flat: the sort), min_p on top, rows with
    nothing to truncate untouched; each row's kept set equals the plain-Python reference."""
    vocab = 1000
    rows, logits = mixed_truncation_rows(vocab, seed=0, wide_top_k=1500)
    flat = rows[1][0]
    for guesses in ((64,), (16, 64), (64, 900), ()):  # (): every top_p row sorts (a GPU's way)
        x = truncate(logits.clone(), [p for _, p in rows], nucleus_guesses=guesses)
        for i, (row, p) in enumerate(rows):
            got = set(torch.nonzero(x[i] > float("-inf")).flatten().tolist())
            assert got == _reference_allowed(row.tolist(), p, _must), (guesses, i, p)
            assert torch.equal(x[i][x[i] > float("-inf")], logits[i][x[i] > float("-inf")])  # values kept as they were
    # row 1's nucleus is past 64 tokens (the next guess or the sort), within 900 (the second guess holds it)
    assert 64 < len(_reference_allowed(flat.tolist(), SamplingParams(top_p=0.9), _must)) < 900


def unseeded_support(logits: torch.Tensor, n: int = 4000, **kw) -> torch.Tensor:
    """The draws of n unseeded rows of these logits ([1, V]) in one batch (a fixed torch seed)."""
    torch.manual_seed(5)
    batch = logits.expand(n, logits.shape[1]).contiguous()
    return torch.tensor(sampler(batch, [row(**kw) for _ in range(n)]).token_ids)


@pytest.mark.parametrize("settings", [dict(top_p=0.75), dict(top_p=0.9, min_p=0.2), dict(min_p=0.5),
                                      dict(temperature=2.0), dict(top_p=0.3, temperature=0.5), dict(top_k=3),
                                      dict(top_k=5, top_p=0.8, min_p=0.1), dict(top_k=1)])
def test_unseeded_rows_draw_from_the_reference_kept_set_in_proportion(settings):
    """Unseeded rows (the CPU's one-pass truncation and draw, logits_ops.cpp): every draw lies in the
    plain-Python reference's kept set, and each kept token comes up in proportion to its renormalised
    probability."""
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.6, 0.0, 2.2, 1.0, 0.5, float("-inf"), 1.7]])
    p = SamplingParams(**settings)
    allowed = _reference_allowed(logits[0].tolist(), p, _must) - {8}  # (probability 0: never drawn)
    draws = unseeded_support(logits, **settings)
    assert set(draws.tolist()) == allowed
    keep = torch.full((10,), float("-inf"))
    keep[list(allowed)] = 0.0
    want = (logits[0] / p.temperature + keep).softmax(-1)
    assert torch.allclose(torch.bincount(draws, minlength=10).float() / len(draws), want, atol=0.025)


def test_unseeded_rows_keep_ties_at_the_nucleus_edge_together():
    """Four tokens of 0.25 and top_p 0.5: the CPU's one pass keeps all four (the mass before each is 0), as the
    GPU's kernel does; the sort (seeded rows here) keeps two of them."""
    assert set(unseeded_support(torch.zeros(1, 4), n=2000, top_p=0.5).tolist()) == {0, 1, 2, 3}
    assert len(support(torch.zeros(1, 4), n=400, top_p=0.5)) == 2


def test_a_batch_of_every_kind_of_row_gives_seeded_rows_their_own_tokens():
    """Seeded rows, top_k rows, unseeded top_p / min_p rows and greedy rows in one call: the seeded and greedy
    rows' tokens are theirs alone, the others lie in their kept sets."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 300, generator=gen) * 3
    kinds = [dict(seed=1, temperature=0.9, top_p=0.8), dict(top_k=5, temperature=1.0), dict(top_p=0.7),
             dict(temperature=0.0), dict(min_p=0.3, temperature=0.7), dict(seed=2, temperature=1.2)]
    torch.manual_seed(0)
    batch = sampler(logits, [row(position=0, **k) for k in kinds]).token_ids
    for i, k in enumerate(kinds):
        if "seed" in k or k.get("temperature") == 0.0:
            assert batch[i] == sampler(logits[i:i + 1], [row(position=0, **k)]).token_ids[0]
        else:
            p = SamplingParams(**{key: v for key, v in k.items() if key != "seed"})
            assert batch[i] in _reference_allowed(logits[i].tolist(), p, _must)


def test_top_p_boundary_is_inclusive():
    # Four tokens at exactly .25: two of them reach top_p=.5, so a third must not be kept.
    x = truncate(torch.zeros(2, 4), [SamplingParams(top_p=0.5), SamplingParams(top_p=0.75)])
    assert (x > float("-inf")).sum(-1).tolist() == [2, 3]


def test_truncate_per_row_parameters():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4))
    ps = [SamplingParams(top_k=2), SamplingParams(top_p=0.75), SamplingParams(min_p=0.2), SamplingParams()]
    kept = (truncate(x.clone(), ps) > float("-inf")).tolist()
    assert kept == [[True, True, False, False], [True, True, False, False],
                    [True, True, True, False], [True, True, True, True]]


# ---- penalties and min_tokens -------------------------------------------------------------------

def test_penalties_exact():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0],
                           [2.0, -1.0, 0.5, -3.0, 1.0, 0.0]])
    rows = [row(prompt=[0, 1], output=[2, 2, 3], repetition_penalty=2.0,
                presence_penalty=0.5, frequency_penalty=0.25),
            row(prompt=[0, 1], output=[2, 2, 3])]  # no penalties: untouched
    apply_penalties(logits, rows)
    # repetition over {0,1,2,3}: 2/2, -1*2, .5/2, -3*2; presence .5 on {2,3}; frequency .25*{2:2, 3:1}
    expected = [1.0, -2.0, 0.25 - 0.5 - 0.5, -6.0 - 0.5 - 0.25, 1.0, 0.0]
    assert torch.allclose(logits[0], torch.tensor(expected))
    assert torch.equal(logits[1], torch.tensor([2.0, -1.0, 0.5, -3.0, 1.0, 0.0]))


def test_presence_frequency_ignore_prompt_and_repetition_alone():
    logits = torch.tensor([[1.0, 1.0, 1.0, -1.0], [1.0, 1.0, 1.0, -1.0]])
    apply_penalties(logits, [row(prompt=[0], output=[1, 1], presence_penalty=1.0, frequency_penalty=-0.5),
                             row(prompt=[3], output=[], repetition_penalty=0.5)])
    assert torch.allclose(logits, torch.tensor([[1.0, 1.0, 1.0, -1.0], [1.0, 1.0, 1.0, -0.5]]))


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.0, 1.0]])
    assert sampler(logits, [row(temperature=0.0, prompt=[0])]).token_ids == [0]
    assert sampler(logits, [row(temperature=0.0, prompt=[0], repetition_penalty=2.0)]).token_ids == [1]
    assert sampler(logits, [row(temperature=0.0, output=[0, 0, 1], frequency_penalty=1.5)]).token_ids == [2]


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 7.0]])  # eos=2, stop=3 dominate
    def greedy(n_out, **kw):
        return sampler(logits, [row(temperature=0.0, eos=[2], output=[0] * n_out, min_tokens=3,
                                    stop_token_ids=[3], **kw)]).token_ids[0]
    assert greedy(0) == 4
    assert greedy(2) == 4
    assert greedy(3) == 2  # min_tokens reached
    assert greedy(1, ignore_eos=True) == 2  # eos ends nothing, so nothing to block; stop ids still are
    assert support(logits, n=300, eos=[2], output=[0], min_tokens=2, stop_token_ids=[3]) <= {0, 1, 4}


def test_block_min_tokens_only_pending_rows():
    logits = torch.zeros(3, 6)
    block_min_tokens(logits, [row(eos=[5], output=[1], min_tokens=2, stop_token_ids=[0, 9]),
                              row(eos=[5], output=[1, 1], min_tokens=2),
                              row(eos=[4, 5], min_tokens=1)])
    inf = float("-inf")
    assert logits.tolist() == [[inf, 0, 0, 0, 0, inf], [0] * 6, [0, 0, 0, 0, inf, inf]]


# ---- seeds --------------------------------------------------------------------------------------

def _steps(vocab=500, n=6):
    g = torch.Generator().manual_seed(42)
    return [torch.randn(vocab, generator=g) * 2 for _ in range(n)]


def _run_seeded(position: int, others: list[RowSampling], params: SamplingParams, seed: int) -> list[int]:
    toks = []
    for i, step in enumerate(_steps()):
        rows = others[:position] + [row(params, seed=seed, position=i)] + others[position:]
        logits = torch.randn(len(rows), step.numel())
        logits[position] = step
        toks.append(sampler(logits, rows).token_ids[position])
    return toks


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.8, top_p=0.95, top_k=100, min_p=0.01)])
def test_seeded_rows_independent_of_batch(params):
    alone = _run_seeded(0, [], params, seed=1234)
    others = [row(temperature=1.0), row(seed=7, top_k=5), row(temperature=0.0), row(temperature=1.2)]
    assert _run_seeded(2, others, params, seed=1234) == alone
    others = [row(seed=99, top_p=0.5), row(temperature=0.7, logprobs=2)]
    assert _run_seeded(1, others, params, seed=1234) == alone
    assert _run_seeded(0, [row(seed=1234)], params, seed=1234) == alone  # even beside a same-seed twin


def test_different_seeds_differ():
    logits = torch.zeros(1, 1000)  # uniform: 10 bits of entropy per token
    seqs = set()
    for seed in range(8):
        seqs.add(tuple(sampler(logits, [row(seed=seed, position=i)]).token_ids[0] for i in range(5)))
    assert len(seqs) == 8


def test_unseeded_rows_use_global_rng():
    logits = torch.zeros(3, 1000)
    torch.manual_seed(5)
    a = sampler(logits, [row(), row(seed=1), row()]).token_ids
    torch.manual_seed(5)
    b = sampler(logits, [row(), row(seed=1), row()]).token_ids
    assert a == b and a[0] != a[2]


# ---- logprobs -----------------------------------------------------------------------------------

def test_logprobs_come_from_raw_logits():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    rows = [row(temperature=0.0, logprobs=5, output=[1, 2], repetition_penalty=1.5),
            row(seed=1, temperature=0.7, top_k=10, logprobs=0),
            row(seed=2, logprobs=None),
            row(seed=3, temperature=1.3, logprobs=20, presence_penalty=1.0, output=[4])]
    out = sampler(logits, rows)
    ref = torch.log_softmax(logits.float(), -1)
    for i, tok in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(ref[i, tok].item(), abs=1e-5)
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] is None
    for i, k in [(0, 5), (3, 20)]:
        top = out.top_logprobs[i]
        assert len(top) == k
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        vals, ids = ref[i].topk(k)
        assert [t for t, _ in top] == ids.tolist()
        assert torch.allclose(torch.tensor([lp for _, lp in top]), vals, atol=1e-5)


def test_no_logprobs_when_nobody_asks():
    out = sampler(torch.randn(2, 10), [row(seed=1), row(temperature=0.0, presence_penalty=1.0, output=[3])])
    assert out.logprobs is None and out.top_logprobs is None


# ---- mixed batch --------------------------------------------------------------------------------

def test_mixed_batch_matches_rows_alone():
    vocab = 300
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(11)) * 3
    specs = [dict(temperature=0.0),
             dict(temperature=0.0, prompt=[1, 2, 3], output=[4, 4], repetition_penalty=1.3,
                  frequency_penalty=0.5, logprobs=3),
             dict(seed=5, top_k=20, top_p=0.9),
             dict(seed=6, temperature=0.5, min_p=0.1, logprobs=2, output=[7], presence_penalty=2.0),
             dict(temperature=1.0),  # unseeded: only checked to be a valid id
             dict(temperature=0.0, eos=[int(logits[5].argmax())], min_tokens=1),
             dict(seed=8, temperature=1.5, output=[0], min_tokens=4, eos=[1], stop_token_ids=[2, 3])]
    batch = sampler(logits, [row(**s) for s in specs])
    for i, s in enumerate(specs):
        alone = sampler(logits[i:i + 1], [row(**s)])
        if s.get("temperature") == 0.0 or "seed" in s:
            assert batch.token_ids[i] == alone.token_ids[0], i
        assert 0 <= batch.token_ids[i] < vocab
        if "logprobs" in s:
            assert batch.logprobs[i] == pytest.approx(alone.logprobs[0], abs=1e-6)
            (ids_b, lps_b), (ids_a, lps_a) = zip(*batch.top_logprobs[i]), zip(*alone.top_logprobs[0])
            assert ids_b == ids_a and lps_b == pytest.approx(lps_a, abs=1e-6)
        else:
            assert batch.top_logprobs[i] is None
    assert batch.token_ids[5] != int(logits[5].argmax())


def test_the_memory_profile_samples_the_costliest_way(monkeypatch):
    """The worker's memory profile (ModelRunner._profile_peak on CUDA) samples its logits rows the costliest way
    (StepSampling.profile): every row through the sort (top_k past the candidates), min_p, the top 20
    logprobs, seeded draws for every other row, penalties from a table; the ids it returns are the rows'."""
    import pagedserve.worker.sampler as sampler_module
    import pagedserve.worker.truncation as truncation
    from pagedserve.worker.step_sampling import StepSampling

    seen = {}
    for module, name in ((truncation, "_truncate_sorted"), (sampler_module, "exponentials"),
                         (sampler_module, "_with_logprobs"), (sampler_module, "apply_penalties")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _o=original, _n=name, **k: (
            seen.setdefault(_n, []).append(a), _o(*a, **k))[1])
    logits = torch.randn(16, 3000, generator=torch.Generator().manual_seed(0))
    # (the device's forms: on the CPU unseeded rows would take the one-pass kernel instead of the sort)
    ids = StepSampling(Sampler(device_forms=True), None, (2,), torch.device("cpu")).profile(logits)
    assert len(ids) == 16 and all(0 <= t < 3000 for t in ids)
    assert len(seen["_truncate_sorted"][0][1]) == 16  # every row sorted
    assert len(seen["exponentials"][0][0]) == 8  # every other row seeded
    assert seen.keys() == {"_truncate_sorted", "exponentials", "_with_logprobs", "apply_penalties"}


def test_a_temperature_too_small_for_float32_is_raised_to_vllms_floor():
    """vLLM raises a positive temperature below 0.01 to 0.01: logits / 1e-300 are float32 infinities, whose
    softmax is NaN, and the device's forms then drew token 0 whatever the logits."""
    assert SamplingParams(temperature=1e-300).temperature == 0.01
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=0.02).temperature == 0.02
    logits = torch.tensor([[1.0, 0.6, 3.0, 0.2], [0.5, 4.0, 0.1, 3.9]])
    for forms in (Sampler(), Sampler(device_forms=True)):
        for i in range(20):
            rows = [row(seed=i, position=i, temperature=1e-300), row(temperature=1e-45, top_p=0.9)]
            assert forms(logits, rows).token_ids == [2, 1]
