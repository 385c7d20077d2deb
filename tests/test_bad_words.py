"""vLLM's bad_words and allowed_token_ids: the words' token sequences (common/bad_words.py, on
the default model's real tokenizer) and the sampler's masks, greedy and sampled, with logprobs
that stay the model's own."""

from __future__ import annotations

import pytest
import torch

from pagedserve.common import bad_words
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.worker.sampler import RowSampling, Sampler
from pagedserve.worker.seeded_draws import stream_key

VOCAB = 64
sampler = Sampler()


def row(output=(), seed=None, **kw) -> RowSampling:
    return RowSampling(SamplingParams(**kw), stream_key(seed, 0, 0) if seed is not None else None, [],
                       list(output), ())


def test_a_sequence_forbids_its_last_token_after_the_rest():
    seqs = [[7], [3, 4, 5], [9, 4]]
    assert bad_words.forbidden(seqs, []) == [7]  # longer sequences need an output to follow
    assert bad_words.forbidden(seqs, [1, 9]) == [7, 4]
    assert bad_words.forbidden(seqs, [3, 4]) == [7, 5]
    assert bad_words.forbidden(seqs, [4]) == [7]  # [3, 4] not there: 5 stays allowed
    assert bad_words.forbidden(seqs, [3]) == [7]


@pytest.mark.slow
def test_words_become_vllms_sequences_on_a_real_tokenizer(default_model_path):
    from pagedserve.model_files.tokenizer_files import load_tokenizer
    tok = load_tokenizer(default_model_path)

    def encode(text):
        return tok.encode(text, add_special_tokens=False)
    paris, spaced = encode("Paris"), encode(" Paris")
    assert paris != spaced and len(paris) == len(spaced)  # a byte-level BPE: the space is part of the word
    assert bad_words.token_sequences(["Paris"], encode) == [paris, spaced]
    assert bad_words.token_sequences(["  Paris"], encode) == [paris, spaced]  # leading spaces dropped
    hello = encode("hello world")
    with_space = encode(" hello world")
    want = [hello] + ([with_space] if with_space[0] != hello[0] and len(with_space) == len(hello) else [])
    assert bad_words.token_sequences(["hello world"], encode) == want
    for words, message in ((["  "], "bad_words[0] must be a word"), (["x"] * 101, "at most 100"),
                           (["a" * 2000], "tokens long")):
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            bad_words.token_sequences(words, encode)


def test_allowed_token_ids_hold_greedy_and_sampled_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    allowed = [3, 17, 40]
    best = max(allowed, key=lambda t: logits[0, t].item())
    rows = [row(temperature=0.0, allowed_token_ids=allowed), row(temperature=0.0),
            row(temperature=1.0, seed=5, allowed_token_ids=allowed), row(temperature=1.0, allowed_token_ids=[9])]
    out = sampler(logits, rows)
    assert out.token_ids[0] == best and out.token_ids[1] == logits[1].argmax().item() and out.token_ids[3] == 9
    drawn = {sampler(logits[2:3].repeat(64, 1), [row(temperature=1.5, allowed_token_ids=allowed)] * 64).token_ids[i]
             for i in range(64)}
    assert drawn <= set(allowed) and len(drawn) > 1
    # logprobs are the model's own (raw) distribution's, as with the other masks
    lp = sampler(logits[:1], [row(temperature=0.0, allowed_token_ids=allowed, logprobs=0)]).logprobs[0]
    assert abs(lp - logits[0].log_softmax(-1)[best].item()) < 1e-5


def test_bad_words_mask_the_token_that_would_complete_them():
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB)
    top2 = logits.topk(2, dim=-1).indices.tolist()
    seq = [11, 12, top2[0][0]]  # completes a bad word only after 11, 12
    rows = [row(output=[5, 11, 12], temperature=0.0, bad_words_token_ids=[seq]),
            row(output=[5, 12, 12], temperature=0.0, bad_words_token_ids=[[11, 12, top2[1][0]]]),
            row(output=[], temperature=0.0, bad_words_token_ids=[[top2[2][0]]])]
    out = sampler(logits, rows).token_ids
    assert out == [top2[0][1], top2[1][0], top2[2][1]]
    # a sampled row never draws it
    many = [row(output=[11, 12], temperature=2.0, bad_words_token_ids=[seq]) for _ in range(64)]
    assert seq[-1] not in sampler(logits[:1].repeat(64, 1), many).token_ids


def test_rules_of_the_params():
    for kw, message in ((dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty"),
                        (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
                        (dict(bad_words_token_ids=[[]]), "bad_words must come to"),
                        (dict(bad_words_token_ids=[[1]] * 201), "bad_words must come to")):
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kw)
    p = SamplingParams(bad_words_token_ids=[[1, 2]])
    assert p.reads_outputs and p.masks_tokens and SamplingParams(**p.to_dict()) == p


def masked_greedy(model, prompt: list[int], steps: int, allowed=None, sequences=()) -> list[int]:
    """Transformers' greedy decoding with vLLM's two masks written out here: every token but the
    allowed ones -inf; a bad sequence's last token -inf where the output ends with the rest of it."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].clone()
            if allowed is not None:
                keep = logits[allowed].clone()
                logits[:] = float("-inf")
                logits[allowed] = keep
            for seq in sequences:
                if len(seq) - 1 <= len(out) and (len(seq) == 1 or out[len(out) - len(seq) + 1:] == seq[:-1]):
                    logits[seq[-1]] = float("-inf")
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


@pytest.mark.parametrize("speculative", [False, True])
def test_engine_greedy_with_masks_equals_transformers(tiny_llama, speculative):
    """In one batch with plain rows, under n-gram speculation too (each verified position masked
    for the output it would follow)."""
    import transformers
    from test_speculative import SPEC
    from tiny_models import make_engine
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    engine = make_engine(tiny_llama, speculative_config=SPEC if speculative else None)
    prompt = [3, 4] * 10  # the tiny model repeats itself after it: proposals to make and to keep
    steps = 16
    plain = masked_greedy(model, prompt, steps)
    one, two = [[plain[2]]], [[plain[1], plain[2]]]  # a token banned everywhere; a token after another
    allowed = sorted(set(plain[1::2]) | {3, 200})
    want = [plain, masked_greedy(model, prompt, steps, allowed=allowed),
            masked_greedy(model, prompt, steps, sequences=one), masked_greedy(model, prompt, steps, sequences=two)]
    assert plain not in want[1:] and plain[2] not in want[2] and want[3][:2] == plain[:2] != want[3][1:3]
    params = [SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, **kw)
              for kw in ({}, {"allowed_token_ids": allowed}, {"bad_words_token_ids": one},
                         {"bad_words_token_ids": two})]
    got = [out[0].token_ids for out in engine.generate([prompt] * 4, params)]
    assert got == want
    if speculative:
        assert engine.stats()["spec_decode"]["num_accepted_tokens"] > 0


def test_allowed_ids_index_is_built_once_per_request():
    """A vocabulary-long allowed_token_ids list becomes its index tensor once, not every step (it
    would slow every row of the batch), ids past the logits' width dropped; the cache is bounded."""
    from pagedserve.worker.logit_rules import AllowedIds
    cache = AllowedIds()
    ids = list(range(0, 200, 3))
    first = cache.get(ids, VOCAB, torch.device("cpu"))
    assert first.tolist() == [t for t in ids if t < VOCAB] and cache.get(ids, VOCAB, torch.device("cpu")) is first
    assert cache.get(list(ids), VOCAB, torch.device("cpu")) is not first  # another request's list
    for _ in range(AllowedIds.MAX + 5):
        cache.get([1, 2], VOCAB, torch.device("cpu"))
    assert len(cache._cache) <= AllowedIds.MAX
