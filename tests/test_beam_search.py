"""vLLM's beam search (common/beam_search.py; LLM.beam_search): the algorithm on hand-made steps
(EOS completes a beam, the width prunes, the length penalty ranks), and the offline engine against
the same algorithm written out here over transformers' logprobs on the same weights (float32)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.common.beam_search import BeamSearch, BeamSearchParams, beam_score, beam_width_problem

EOS = 2


def test_eos_completes_a_beam_and_the_width_prunes_the_rest():
    search = BeamSearch([7, 8], BeamSearchParams(beam_width=2, max_tokens=3), EOS)
    search.step([[(5, -0.1), (EOS, -0.2), (6, -1.0), (9, -3.0)]])
    assert [b.tokens for b in search.live] == [[7, 8, 5], [7, 8, 6]]  # 9 pruned, EOS completed
    assert [(b.tokens, b.finish_reason, b.stop_reason) for b in search.completed] == [([7, 8, EOS], "stop", EOS)]
    search.step([[(3, -0.5), (4, -0.6)], [(3, -0.01), (4, -5.0)]])
    # candidates -0.6 (5, 3), -0.7 (5, 4), -1.01 (6, 3), -6.0 (6, 4): the two best go on
    assert [b.tokens[2:] for b in search.live] == [[5, 3], [5, 4]]
    assert [round(b.cum_logprob, 3) for b in search.live] == [-0.6, -0.7]
    search.step([[(1, -0.1)], [(1, -0.1)]])
    assert search.done
    best = search.best()
    # EOS not counted in the length: -0.2 / 2 beats -0.7 / 5 and -0.8 / 5
    assert [b.tokens for b in best] == [[7, 8, EOS], [7, 8, 5, 3, 1]]
    assert best[1].finish_reason == "length"


def test_length_penalty_and_ignore_eos():
    assert beam_score([1, 2, 3, EOS], -3.0, EOS, 1.0) == -1.0
    assert beam_score([1, 2, 3, 4], -4.0, EOS, 2.0) == -0.25
    search = BeamSearch([1], BeamSearchParams(beam_width=1, max_tokens=1, ignore_eos=True), EOS)
    search.step([[(EOS, -0.1), (4, -0.2)]])
    assert [b.tokens for b in search.live] == [[1, EOS]] and not search.completed
    for bad in (dict(beam_width=0), dict(beam_width=1.5), dict(max_tokens=0)):
        with pytest.raises(ValueError):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **bad})
    assert beam_width_problem(10, 20) is None and beam_width_problem(16, 32) is None
    assert "at most 10 beams" in beam_width_problem(11, 20)


def reference(model, prompt: list[int], width: int, steps: int, eos: int, penalty: float = 1.0):
    """vLLM's LLM.beam_search written out over transformers' logprobs: (tokens, cum_logprob) best first."""
    def score(tokens, cum):
        length = len(tokens) - (1 if tokens[-1] == eos else 0)
        return cum / length ** penalty
    beams, done = [(list(prompt), 0.0)], []
    for _ in range(steps):
        grown = []
        for tokens, cum in beams:
            with torch.no_grad():
                lp = model(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)
            top = lp.topk(2 * width)
            for token, value in zip(top.indices.tolist(), top.values.tolist()):
                (done if token == eos else grown).append((tokens + [token], cum + value))
        beams = sorted(grown, key=lambda b: score(*b), reverse=True)[:width]
        if not beams:
            break
    return sorted(done + beams, key=lambda b: score(*b), reverse=True)[:width]


@pytest.mark.slow
@pytest.mark.parametrize("width, penalty", [(2, 1.0), (3, 0.5)])
def test_offline_beam_search_equals_the_algorithm_over_transformers(default_model_path, tmp_path_factory,
                                                                   width, penalty):
    import transformers

    from pagedserve import LLM, BeamSearchParams
    from service_stack import tiny_model_with_tokenizer
    folder = tiny_model_with_tokenizer(tmp_path_factory.mktemp("beam"), default_model_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300]]
    with LLM(model=str(folder), dtype="float32", kv_cache_memory="64MiB") as llm:
        tok = llm.get_tokenizer()
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                               BeamSearchParams(beam_width=width, max_tokens=5, length_penalty=penalty))
        with pytest.raises(ValueError, match="--max-logprobs: at most 20"):  # 2 x 11 logprobs a step
            llm.beam_search([{"prompt_token_ids": prompts[0]}], BeamSearchParams(beam_width=11, max_tokens=2))
    for prompt, out in zip(prompts, outs):
        want = reference(model, prompt, width, 5, tok.eos_token_id, penalty)
        assert [b.tokens for b in out.sequences] == [tokens for tokens, _ in want]
        assert [b.cum_logprob for b in out.sequences] == pytest.approx([cum for _, cum in want], abs=1e-4)
        assert [b.text for b in out.sequences] == [tok.decode(tokens) for tokens, _ in want]
