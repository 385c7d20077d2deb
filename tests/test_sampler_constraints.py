"""The sampler's constraints: grammar bitmasks (structured outputs) and logit_bias, on the batched
sampler directly, with and without constrained rows in the batch."""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.worker.sampler import RowSampling, Sampler
from pagedserve.worker.seeded_draws import stream_key
from pagedserve.worker.structured_output import TokenMasks, forbidden_tokens, forbidden_tokens_torch

VOCAB = 100
sampler = Sampler()


def row(seed=None, output=(), eos=(), **kw) -> RowSampling:
    return RowSampling(SamplingParams(**kw), stream_key(seed, 0, 0) if seed is not None else None,
                       [], list(output), tuple(eos))


def bitmask(allowed_sets: list[set[int]], vocab: int = VOCAB) -> torch.Tensor:
    words = np.zeros((len(allowed_sets), (vocab + 31) // 32), dtype=np.uint32)
    for i, allowed in enumerate(allowed_sets):
        for t in allowed:
            words[i, t // 32] |= np.uint32(1 << (t % 32))
    return torch.from_numpy(words.view(np.int32))


def test_bitmask_is_unpacked_in_llguidance_layout():
    sets = [{0, 31, 32, 63, 99}, set(range(VOCAB)), set()]
    allowed = ~forbidden_tokens(bitmask(sets), VOCAB)
    assert allowed.shape == (3, VOCAB)
    for i, s in enumerate(sets):
        assert set(torch.nonzero(allowed[i]).flatten().tolist()) == s
    assert torch.equal(~allowed, forbidden_tokens_torch(bitmask(sets), VOCAB))  # the GPU's way


def test_masks_hold_greedy_and_sampled_rows_and_leave_the_others_alone():
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    rows = [row(temperature=0.0), row(temperature=0.0), row(temperature=1.0, seed=1), row(temperature=1.0, seed=2)]
    allowed = [{3, 50, 97}, {10, 11}]
    masks = TokenMasks(torch.tensor([1, 2]), bitmask(allowed))
    free = sampler(logits, rows).token_ids
    for _ in range(50):
        rows[2].key = stream_key(int(torch.randint(0, 2**31, ())), 0, 0)
        out = sampler(logits, rows, masks).token_ids
        assert out[1] == max(allowed[0], key=lambda t: logits[1, t])  # greedy among the allowed
        assert out[2] in allowed[1]
        assert out[0] == free[0]  # an unconstrained greedy row is untouched
    free_seeded = sampler(logits[3:4], [rows[3]]).token_ids[0]
    assert sampler(logits, rows, masks).token_ids[3] == free_seeded  # and so is a seeded sampled row


def test_no_constrained_row_is_the_plain_path():
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB)
    rows = [row(temperature=0.0) for _ in range(3)]
    assert sampler(logits, rows, None).token_ids == logits.argmax(-1).tolist()


def test_grammar_outranks_min_tokens_when_only_eos_is_left():
    """The grammar is complete (only eos allowed) but min_tokens would block eos: the row still ends."""
    logits = torch.randn(1, VOCAB)
    r = row(temperature=1.0, min_tokens=5, eos=(2,))
    out = sampler(logits, [r], TokenMasks(torch.tensor([0]), bitmask([{2}])))
    assert out.token_ids == [2]


def test_logprobs_stay_the_models_own_under_a_mask():
    logits = torch.randn(1, VOCAB)
    out = sampler(logits, [row(temperature=0.0, logprobs=0)], TokenMasks(torch.tensor([0]), bitmask([{7}])))
    assert out.token_ids == [7]
    assert abs(out.logprobs[0] - torch.log_softmax(logits[0], -1)[7].item()) < 1e-5


def test_logit_bias_forces_and_bans():
    torch.manual_seed(2)
    logits = torch.randn(3, VOCAB)
    greedy = logits.argmax(-1).tolist()
    target = (greedy[0] + 1) % VOCAB
    rows = [row(temperature=0.0, logit_bias={target: 100.0}), row(temperature=0.0, logit_bias={greedy[1]: -100.0}),
            row(temperature=0.0)]
    out = sampler(logits, rows).token_ids
    assert out[0] == target
    assert out[1] != greedy[1] and out[1] == logits[1].topk(2).indices[1].item()
    assert out[2] == greedy[2]


def test_logit_bias_cannot_revive_a_token_the_grammar_forbids():
    logits = torch.randn(1, VOCAB)
    r = row(temperature=0.0, logit_bias={5: 100.0})
    assert sampler(logits, [r], TokenMasks(torch.tensor([0]), bitmask([{8, 9}]))).token_ids[0] in (8, 9)


def test_a_matcher_that_cannot_be_built_ends_its_row_alone(tmp_path):
    """A model folder without tokenizer.json: that row may only sample eos; the step goes on."""
    from pagedserve.common.sampling_params import StructuredOutput
    from pagedserve.worker.structured_output import FAILED, GrammarMatchers

    grammars = GrammarMatchers(tmp_path, VOCAB, (2, 40))
    matcher = grammars.new_matcher(StructuredOutput(regex="a+"), [])
    assert matcher is FAILED
    grammars.advance(matcher, 5)  # a no-op, not an error
    masks = TokenMasks(torch.tensor([1]), grammars.fill([matcher], [0]))
    out = sampler(torch.randn(2, VOCAB), [row(temperature=0.0), row(temperature=1.0, seed=3)], masks)
    assert out.token_ids[1] in (2, 40)


def test_the_gpu_way_of_applying_masks_equals_the_cpu_way():
    """The CUDA path (torch ops on the device) run on CPU tensors against the numpy path."""
    from pagedserve.worker.logit_rules import _apply_token_masks_numpy, _apply_token_masks_torch

    torch.manual_seed(4)
    raw = torch.randn(5, VOCAB)
    x = raw.clone()
    x[3, 2] = float("-inf")  # min_tokens blocked eos on row 3, the only token its grammar allows
    masks = TokenMasks(torch.tensor([0, 3, 4]), bitmask([{1, 50, 99}, {2}, set(range(0, VOCAB, 3))]))
    a, b = x.clone(), x.clone()
    _apply_token_masks_numpy(a, raw, masks)
    _apply_token_masks_torch(b, raw, masks)
    assert torch.equal(a, b)
    assert torch.isfinite(a[3]).sum() == 1 and a[3, 2] == raw[3, 2]
    assert torch.equal(a[[1, 2]], x[[1, 2]])


def test_logit_bias_of_many_rows_adds_exactly_the_entries_inside_the_vocabulary():
    """apply_logit_bias builds each row's entries as tensors whole (issue 42 row 1): the same sums
    as adding them one by one, ids past the vocabulary (a model's padded vocab) skipped."""
    from pagedserve.worker.logit_rules import apply_logit_bias
    torch.manual_seed(3)
    logits = torch.randn(4, VOCAB)
    biases = [{1: 5.0, VOCAB + 3: 50.0, 7: -2.5}, None, {0: 1.0}, {i: float(i) for i in range(VOCAB)}]
    rows = [row(logit_bias=b) for b in biases]
    expected = logits.clone()
    for i, bias in enumerate(biases):
        for token, value in (bias or {}).items():
            if token < VOCAB:
                expected[i, token] += value
    apply_logit_bias(logits, rows)
    assert torch.equal(logits, expected)
