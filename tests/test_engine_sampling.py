"""Engine-level sampling: seeds, n > 1 sharing blocks, stop rules, logprobs against transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.common.sampling_params import SamplingParams
from tiny_models import make_engine


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return make_engine(tiny_llama)


def prompts(num, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, int(n)).tolist() for n in rng.integers(5, 60, num)]


def test_seeded_request_same_alone_and_in_batch(engine):
    target = prompts(1, seed=10)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = engine.generate([target], params)[0][0].token_ids
    others = prompts(6, seed=11)
    batch = [others[0], others[1], target] + others[2:]
    mixed = [SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), params] + \
            [SamplingParams(temperature=1.2, seed=i, max_tokens=12, ignore_eos=True) for i in range(4)]
    inside = engine.generate(batch, mixed)[2][0].token_ids
    assert inside == alone
    other_seed = engine.generate([target], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=20,
                                                           ignore_eos=True))[0][0].token_ids
    assert other_seed != alone


def test_seeded_request_survives_preemption(tiny_llama):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=30, ignore_eos=True)
    batch = prompts(8, seed=12)
    calm = make_engine(tiny_llama).generate(batch, params)
    tight = make_engine(tiny_llama, kv_cache_memory=20 * 8192)
    assert tight.generate(batch, params) == calm
    assert tight.stats()["num_preemptions"] > 0


def test_n_samples_share_prompt_blocks(engine):
    prompt = prompts(1, seed=13)[0][:40]  # 2 full blocks and a partial one
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    engine.add_request("fork", prompt, params)
    bm = engine.scheduler.block_manager
    saw_shared = saw_copy = False
    while engine.has_unfinished():
        sched = engine.scheduler.schedule()
        saw_copy |= bool(sched.blocks_to_copy)
        result = engine.runner.execute(sched)
        engine.scheduler.update(sched, result)
        tables = [bm.tables.get(r.request_id, []) for r in engine.scheduler.running]
        if len(tables) == 4:
            saw_shared |= all(t[0] is tables[0][0] and t[0].ref_count >= 4 for t in tables)
    assert saw_shared and saw_copy
    samples = engine.generate([prompt], params)[0]
    assert len(samples) == 4 and all(len(s.token_ids) == 8 for s in samples)
    assert len({tuple(s.token_ids) for s in samples}) > 1
    assert bm.num_free_blocks == bm.num_total_blocks


def test_stop_rules(engine):
    prompt = prompts(1, seed=14)[0]
    free = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0][0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    stopped = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]))[0][0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:first + 1]
    late = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at],
                                                    min_tokens=first + 1))[0][0]
    assert late.token_ids[:first] == free.token_ids[:first] and late.token_ids[first] != stop_at


def test_eos_stops_unless_ignored(tiny_llama):
    prompt = prompts(1, seed=15)[0]
    free = make_engine(tiny_llama).generate([prompt], SamplingParams(temperature=0, max_tokens=20,
                                                                     ignore_eos=True))[0][0]

    class EosTokenizer:
        eos_token_id = free.token_ids[4]  # the tokenizer's eos joins config.json's eos (2)

    engine = make_engine(tiny_llama, tokenizer=EosTokenizer())
    assert set(engine.eos_token_ids) == {2, free.token_ids[4]}
    stop = free.token_ids.index(free.token_ids[4])
    normal = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=20))[0][0]
    assert normal.token_ids == free.token_ids[:stop + 1] and normal.finish_reason == "stop"
    ignored = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0][0]
    assert ignored.token_ids == free.token_ids


def test_logprobs_close_to_transformers(tiny_llama):
    import transformers
    engine = make_engine(tiny_llama)
    prompt = prompts(1, seed=16)[0]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3))[0][0]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), dim=-1)
    for step, sample in enumerate(out.logprobs):
        assert sample.logprob == pytest.approx(ref[step, sample.token_id].item(), abs=1e-4)
        top = ref[step].topk(3)
        assert [t for t, _ in sample.top_logprobs] == top.indices.tolist()
        assert [lp for _, lp in sample.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_every_sample_of_n_carries_a_logprob_for_every_token(engine):
    """Samples 1..n-1 fork on their first token: that token's logprob must come along."""
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, logprobs=2, ignore_eos=True)
    [samples] = engine.generate([[5, 6, 7, 8]], params)
    for sample in samples:
        assert len(sample.logprobs) == len(sample.token_ids) == 6
        assert [t.token_id for t in sample.logprobs] == sample.token_ids
        assert all(t.logprob <= 0.0 and len(t.top_logprobs) == 2 for t in sample.logprobs)


def test_plain_greedy_batches_skip_the_per_row_settings(tiny_llama, monkeypatch):
    """A step whose rows are all plain greedy (step_sampling.plain_greedy) samples by one argmax without building
    each row's settings; a row that changes its logits (min_tokens here, a bias, penalties), asks for logprobs,
    forks or samples sends the step the general way. Both give transformers' greedy tokens."""
    from pagedserve.worker.step_sampling import plain_greedy
    from pagedserve.worker.sampler import Sampler
    from tiny_models import hf_greedy

    batch = prompts(3, seed=21)
    expected = [hf_greedy(tiny_llama, [p], 6)[0] for p in batch]
    calls = {"greedy": 0, "sample": 0}
    for name in calls:
        original = getattr(Sampler, name)
        monkeypatch.setattr(Sampler, name, lambda self, *a, _o=original, _n=name, **k: (
            calls.__setitem__(_n, calls[_n] + 1), _o(self, *a, **k))[1])
    engine = make_engine(tiny_llama)
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert [s[0].token_ids for s in engine.generate(batch, plain)] == expected
    assert calls["greedy"] > 0 and calls["sample"] == 0
    held = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, min_tokens=2)
    assert [s[0].token_ids for s in engine.generate(batch, [plain, held, plain])] == expected
    assert calls["sample"] > 0
    state = type("State", (), {"params": plain, "child_req_ids": []})()
    assert plain_greedy(state)
    for change in (dict(logprobs=0), dict(logit_bias={5: 1.0}), dict(repetition_penalty=1.1), dict(min_tokens=1),
                   dict(temperature=0.7), dict(presence_penalty=0.5), dict(frequency_penalty=0.5)):
        state.params = SamplingParams(**{**dict(temperature=0.0, max_tokens=6), **change})
        assert not plain_greedy(state), change
    state.params, state.child_req_ids = plain, ["x-1"]
    assert not plain_greedy(state)


def test_max_logprobs_bounds_a_request_and_minus_one_is_the_vocabulary(engine):
    """--max-logprobs (vLLM's): 20 by default; -1 lets a request ask for the whole vocabulary (every
    token's logprob, which then sum to 1), never more."""
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match=r"logprobs 21 is more than this server allows \(--max-logprobs: at most 20"):
        engine.generate([prompts(1)[0]], SamplingParams(max_tokens=1, logprobs=21))
    with pytest.raises(ValueError, match="prompt_logprobs 21"):
        engine.generate([prompts(1)[0]], SamplingParams(max_tokens=1, prompt_logprobs=21))
    engine.config.max_logprobs = -1
    try:
        (sample,) = engine.generate([prompts(1)[0]], SamplingParams(max_tokens=1, logprobs=vocab))[0]
        with pytest.raises(ValueError, match=f"at most {vocab}"):
            engine.generate([prompts(1)[0]], SamplingParams(max_tokens=1, logprobs=vocab + 1))
    finally:
        engine.config.max_logprobs = 20
    top = sample.logprobs[0].top_logprobs
    assert len(top) == vocab and abs(sum(np.exp(lp) for _, lp in top) - 1.0) < 1e-4
