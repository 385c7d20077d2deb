"""Prompt logprobs (vLLM's prompt_logprobs; completions' echo + logprobs) on the in-process engine
and the default model in float32, against transformers' own forward pass over the same weights:
each prompt token's logprob, its rank and the top k, whatever the chunking, a prefix the cache
holds (such a request takes no hits), a recompute preemption (no position twice) or n > 1."""

from __future__ import annotations

import pytest
import torch

from pagedserve.common.messages import PromptLogprobs, SampledToken
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.scheduler.core.request import Request
from tiny_models import make_engine

pytestmark = pytest.mark.slow  # the default model, twice (ours and transformers')

TEXTS = ["The capital of France is Paris, and the capital of Germany is Berlin. Both cities are large.",
         "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5, the sum of two and three",
         "Once upon a time there was a small fox who lived in a deep forest near a quiet river bank."]


@pytest.fixture(scope="module")
def hf(default_model_path, default_model_hf):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(default_model_path), default_model_hf


@pytest.fixture(scope="module")
def prompts(hf):
    return [hf[0](text)["input_ids"] for text in TEXTS]


def reference(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: the log-distribution at each position that predicts a prompt token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return logits[:-1].log_softmax(-1)


def check(entries: list[SampledToken], prompt: list[int], ref: torch.Tensor, k: int) -> None:
    assert len(entries) == len(prompt) - 1
    got = torch.tensor([e.logprob for e in entries])
    want = ref.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    assert torch.allclose(got, want, atol=1e-3), (got - want).abs().max()
    assert [e.token_id for e in entries] == prompt[1:]
    ranks = (ref >= want[:, None]).sum(-1).tolist()
    assert [e.rank for e in entries] == ranks
    top_vals, top_ids = ref.topk(k, dim=-1)
    for e, ids, vals in zip(entries, top_ids.tolist(), top_vals.tolist()):
        assert len(e.top_logprobs) == k
        assert [t for t, _ in e.top_logprobs] == ids
        assert all(abs(a - b) < 1e-3 for (_, a), b in zip(e.top_logprobs, vals))


def run(engine, prompts, params):
    return [samples for samples in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def refs(hf, prompts):
    return [reference(hf[1], p) for p in prompts]


def test_prompt_logprobs_match_transformers_with_chunks_and_a_cached_prefix(default_model_path, hf, prompts, refs):
    engine = make_engine(default_model_path, tokenizer=hf[0], max_num_batched_tokens=16)
    assert min(map(len, prompts)) > 16  # every prompt is prefilled in chunks
    # Fill the prefix cache with the prompts first: a request without prompt logprobs takes hits.
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    run(engine, prompts, plain)
    hits = engine.stats()["prefix_cache_hits"]
    run(engine, prompts, plain)
    assert engine.stats()["prefix_cache_hits"] > hits
    hits = engine.stats()["prefix_cache_hits"]
    out = run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3, logprobs=1))
    assert engine.stats()["prefix_cache_hits"] == hits  # computed, not taken from the cache
    for samples, prompt, ref in zip(out, prompts, refs):
        check(samples[0].prompt_logprobs, prompt, ref, 3)
        assert len(samples[0].token_ids) == 2 and len(samples[0].logprobs) == 2


def test_max_tokens_zero_returns_the_prompt_logprobs_only(default_model_path, hf, prompts, refs):
    engine = make_engine(default_model_path, tokenizer=hf[0])
    out = run(engine, prompts, SamplingParams(max_tokens=0, prompt_logprobs=0))
    for samples, prompt, ref in zip(out, prompts, refs):
        assert samples[0].token_ids == [] and samples[0].finish_reason == "length"
        check(samples[0].prompt_logprobs, prompt, ref, 0)
    assert not engine.has_unfinished()
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks


def test_recompute_preemption_and_n_deliver_each_position_once(default_model_path, hf, prompts, refs):
    # Blocks for about two of the prompts at a time: the running requests preempt each other.
    from pagedserve.worker.kv_cache import bytes_per_block
    engine = make_engine(default_model_path, tokenizer=hf[0], max_num_batched_tokens=24,
                         kv_cache_memory=12 * bytes_per_block(engine_config(default_model_path), 16, torch.float32))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=2, n=2)
    out = run(engine, prompts * 2, params)
    assert engine.stats()["num_preemptions"] > 0
    for samples, prompt, ref in zip(out, prompts * 2, refs * 2):
        for sample in samples:
            check(sample.prompt_logprobs, prompt, ref, 2)


def engine_config(folder):
    from pagedserve.common.model_config import ModelConfig
    return ModelConfig.from_folder(folder)


def test_positions_are_kept_once():
    req = Request("r", list(range(10)), 10, SamplingParams(prompt_logprobs=0))
    tokens = [SampledToken(t, -float(t)) for t in range(1, 10)]
    req.add_prompt_logprobs(1, tokens[:4])      # positions 1-4
    req.add_prompt_logprobs(1, tokens[:4])      # a recompute: again
    req.add_prompt_logprobs(5, tokens[4:6])     # 5-6
    req.add_prompt_logprobs(3, tokens[2:9])     # overlapping: 7-9 are new
    assert [t.token_id for t in req.prompt_logprobs] == list(range(1, 10))
    assert PromptLogprobs(1, []).start == 1


@pytest.mark.parametrize("bad", [dict(logprobs=-1), dict(prompt_logprobs=-1), dict(max_tokens=0, n=2),
                                 dict(max_tokens=-1)])
def test_bounds(bad):
    with pytest.raises(ValueError, match=next(iter(bad)) if "n" not in bad else "n=1"):
        SamplingParams(**bad)


def test_prompt_logprobs_are_capped_by_their_entries():
    """Issue 42 row 3: n x prompt x (k + 1) entries at most 2^20 (the tokenizer refuses past it,
    INVALID_ARGUMENT, before the scheduler stores anything)."""
    from pagedserve.common.sampling_params import MAX_PROMPT_LOGPROB_ENTRIES, prompt_logprobs_problem
    assert prompt_logprobs_problem(16, 8000, None) is None
    assert prompt_logprobs_problem(1, 32768, 20) is None  # a whole 32k context at k = 20
    problem = prompt_logprobs_problem(16, 8000, 20)
    assert problem.startswith("prompt_logprobs=20") and "2688000" in problem
    assert str(MAX_PROMPT_LOGPROB_ENTRIES) in problem


def test_a_steps_deltas_are_split_into_messages_by_size():
    """Issue 42 row 3: one step's deltas for a tokenizer went in one message, however large (a
    request's prompt logprobs, megabytes), up to gRPC's 64 MiB cap, holding back every other
    request's tokens. Now messages of about 1 MiB, in order, the errors in the first."""
    from pagedserve.scheduler.server import split_step_message
    from pagedserve.v1 import common_pb2, scheduler_pb2
    out = scheduler_pb2.StepDeltas(errors=[scheduler_pb2.SubscriptionError(tag=9, message="x")])
    for i in range(6):
        delta = out.deltas.add(request_id=f"r{i}", token_ids=[i])
        if i in (1, 4):  # ~0.6 MB of prompt logprobs each
            delta.prompt_logprobs.extend([common_pb2.TokenLogprob(token_id=t, logprob=-1.5, rank=3)
                                          for t in range(60_000)])
    parts = split_step_message(out, limit=1 << 20)
    assert len(parts) >= 2 and all(p.ByteSize() <= (1 << 20) or len(p.deltas) == 1 for p in parts)
    assert [d.request_id for p in parts for d in p.deltas] == [f"r{i}" for i in range(6)]
    assert list(parts[0].errors) == list(out.errors) and not any(p.errors for p in parts[1:])
    small = scheduler_pb2.StepDeltas(deltas=[scheduler_pb2.TokenDelta(request_id="a", token_ids=[1])])
    assert split_step_message(small) == [small]
