"""Speculative decoding (n-gram prompt lookup): greedy output with speculation equals
transformers' (and the engine's without it) token for token in float32, across batching, chunked
prefill, preemption by recompute and swap, prefix-cache hits, stop ids and max_tokens, n > 1;
seeded sampling draws the same tokens with and without it; the block pool's bookkeeping holds
after every step and nothing is left held at the end. The config's checks, the proposer and the
step delta's wire form too. (Sampling's distribution: test_speculative_sampling.py; TP 2 there.)"""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.common import wire
from pagedserve.common.messages import SchedulerOutput
from pagedserve.common.sampling_params import SamplingParams, StructuredOutput
from pagedserve.common.speculative import SpeculativeConfig, parse_speculative_config
from pagedserve.scheduler.core.ngram_proposer import propose_ngram
from pagedserve.scheduler.core.request import Request
from pagedserve.scheduler.core.speculation import Speculation
from block_checks import check_cache_index, check_pool
from test_engine_equivalence import random_prompts
from tiny_models import hf_greedy, make_engine

# Speculating at any batch size (the default stops at 6 running requests): the batches here are bigger.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "disable_by_batch_size": 0}
MAX_NEW = 28


def greedy(max_tokens: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def generate_checked(engine, prompts, params):
    """engine.generate, with the block pool's invariants checked after every step; returns
    (tokens per prompt and sample, finish reasons)."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(rid, prompt, p)
    tokens = {rid: [[] for _ in range(p.n)] for rid, p in zip(ids, params)}
    reasons = {rid: [None] * p.n for rid, p in zip(ids, params)}
    bm = engine.scheduler.block_manager
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id][out.sample_index] += [t.token_id for t in out.new_tokens]
            if out.finished:
                reasons[out.request_id][out.sample_index] = out.finish_reason
        check_pool(bm.pool, bm.tables)
        check_cache_index(bm.pool)
    assert bm.num_free_blocks == bm.num_total_blocks, "blocks leaked"
    assert not bm.tables and not engine.scheduler.requests
    return [tokens[r] for r in ids], [reasons[r] for r in ids]


def spec_stats(engine) -> dict:
    return engine.stats()["spec_decode"]


@pytest.fixture(scope="module")
def case(tiny_llama):
    rng = np.random.default_rng(7)
    prompts = random_prompts(6, 256, seed=5) + [[5, 6, 7, 8, 9, 10] * 8, rng.integers(3, 256, 12).tolist() * 4]
    return tiny_llama, prompts, hf_greedy(tiny_llama, prompts, MAX_NEW)


def engine_on(folder, speculative: bool = True, **overrides):
    # A small pool: check_pool walks every block after every step.
    overrides = {"kv_cache_memory": 128 * 8192, **overrides}
    return make_engine(folder, speculative_config=SPEC if speculative else None, **overrides)


def spec_engine(folder, **overrides):
    return engine_on(folder, **overrides)


def assert_greedy_equal(engine, prompts, expected):
    got, _ = generate_checked(engine, prompts, greedy())
    assert [samples[0] for samples in got] == expected
    stats = spec_stats(engine)
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats  # both accepted and rejected
    return stats


def test_greedy_equals_transformers(case):
    folder, prompts, expected = case
    stats = assert_greedy_equal(spec_engine(folder), prompts, expected)
    assert stats["accepted_per_pos"][3] > 0  # whole runs of proposals kept, with the bonus token
    assert stats["mean_acceptance_length"] == 1 + stats["num_accepted_tokens"] / stats["num_drafts"]


def test_chunked_prefill_small_blocks_and_a_tight_budget(case):
    folder, prompts, expected = case
    assert_greedy_equal(spec_engine(folder, max_num_batched_tokens=16, block_size=4, max_num_seqs=4),
                        prompts, expected)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(case, mode):
    folder, prompts, expected = case
    engine = spec_engine(folder, kv_cache_memory=24 * 8192, preemption_mode=mode, swap_space=64 * 8192)
    assert_greedy_equal(engine, prompts, expected)
    assert engine.stats()["num_preemptions"] > 0


def test_prefix_cache_hits(case):
    folder, prompts, expected = case
    engine = spec_engine(folder, block_size=4)
    assert_greedy_equal(engine, prompts[-2:], expected[-2:])
    hits_before = engine.stats()["prefix_cache_hits"]
    assert_greedy_equal(engine, prompts, expected)
    assert engine.stats()["prefix_cache_hits"] - hits_before >= 2 * 40  # outputs' blocks too


def test_stop_ids_and_max_tokens_cut_accepted_runs(case):
    folder, prompts, expected = case
    # A stop id that lands inside an accepted run, and max_tokens that end one.
    looping = expected[-2]
    params = [greedy(max_tokens=7 + i) for i in range(len(prompts))]
    params[-2] = greedy(stop_token_ids=[looping[12]])
    plain, plain_reasons = generate_checked(engine_on(folder, speculative=False), prompts, params)
    engine = spec_engine(folder)
    got, reasons = generate_checked(engine, prompts, params)
    assert got == plain and reasons == plain_reasons
    assert len(got[-2][0]) == looping.index(looping[12]) + 1 and reasons[-2] == ["stop"]
    assert [len(s[0]) for s in got[:-2]] == [7 + i for i in range(len(prompts) - 2)]
    assert spec_stats(engine)["num_accepted_tokens"] > 0


def test_seeded_sampling_and_n_samples_equal_without_speculation(case):
    folder, prompts, _ = case
    prompts = prompts[-4:]
    # top_k 5: the tiny model's samples meet the n-gram proposals often enough that some are kept (7 of 68
    # proposals with these seeds; with top_k 20, 0 to 2 of ~60 for most seed sets)
    params = [SamplingParams(temperature=0.8, top_k=5, max_tokens=16, ignore_eos=True, seed=100 + i, n=3,
                             repetition_penalty=1.1 if i % 2 else 1.0) for i in range(len(prompts))]
    plain, _ = generate_checked(engine_on(folder, speculative=False), prompts, params)
    engine = spec_engine(folder)
    got, _ = generate_checked(engine, prompts, params)
    assert got == plain
    assert spec_stats(engine)["num_accepted_tokens"] > 0


def test_speculation_skips_structured_rows_and_respects_limits():
    spec = Speculation(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2))
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    req = Request("a", list(tokens), 4, SamplingParams(max_tokens=100))
    assert spec.propose(req, budget=100, max_model_len=100, step_id=1) == [3, 4, 5, 6]
    assert spec.propose(req, budget=2, max_model_len=100, step_id=1) == [3, 4]  # the step's budget
    assert spec.propose(req, budget=100, max_model_len=11, step_id=1) == [3, 4]  # the context
    short = Request("b", list(tokens), 4, SamplingParams(max_tokens=6))  # 4 out: one more, then the last
    assert spec.propose(short, budget=100, max_model_len=100, step_id=1) == [3]
    constrained = Request("c", list(tokens), 4, SamplingParams(structured_output=StructuredOutput(regex="a+")))
    assert spec.propose(constrained, budget=100, max_model_len=100, step_id=1) == []
    # Nothing accepted twice in a row: the request pauses, then tries again with a smaller limit.
    spec.record(req, 4, 0, step_id=1)
    spec.record(req, 2, 0, step_id=2)
    assert spec.propose(req, budget=100, max_model_len=100, step_id=3) == []
    assert spec.propose(req, budget=100, max_model_len=100, step_id=4) == [3]
    spec.record(req, 1, 1, step_id=4)
    assert spec.propose(req, budget=100, max_model_len=100, step_id=5) == [3, 4]
    assert (req.num_draft_tokens, req.num_accepted_tokens) == (7, 1)
    # Globally: a step with disable_by_batch_size running requests or more proposes nothing.
    assert spec.begin_step({"a": req}, num_running=5) and not spec.begin_step({"a": req}, num_running=6)
    assert Speculation(SpeculativeConfig(disable_by_batch_size=0)).begin_step({}, num_running=500)


def test_steps_wait_for_results_while_speculation_would_propose():
    # An ahead step carries no proposals, and steps that go ahead keep going ahead: the step loop
    # waits for the running step's results whenever a running request would get proposals.
    from pagedserve.scheduler.core.scheduler import Scheduler, SchedulerConfig
    from scheduler_driver import make_request

    def scheduler(limit: int) -> Scheduler:
        cfg = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2,
                                disable_by_batch_size=limit)
        return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, num_gpu_blocks=64,
                                         block_size=4, max_model_len=256), speculative=cfg)

    sched = scheduler(limit=3)
    assert not sched.waits_for_speculation()  # nothing running
    sched.add_request(make_request("plain", [7, 8, 9, 10, 11], max_tokens=20))
    sched.schedule()
    assert not sched.waits_for_speculation()  # no n-gram match: steps may go ahead
    sched.add_request(make_request("repeats", [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], max_tokens=20))
    sched.schedule()
    assert sched.waits_for_speculation()
    sched.add_request(make_request("third", [20, 21, 22], max_tokens=20))
    sched.schedule()
    assert not sched.waits_for_speculation()  # disable_by_batch_size running: no proposals anyway
    assert not Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, num_gpu_blocks=64,
                                         block_size=4, max_model_len=256)).waits_for_speculation()


def test_ngram_proposer():
    def propose(tokens, lo=1, hi=3, k=4):
        return propose_ngram(np.array(tokens), lo, hi, k).tolist()
    assert propose([1, 2, 3, 9, 1, 2]) == [3, 9, 1, 2]  # the suffix [1, 2] seen before
    assert propose([1, 2, 3, 9, 7, 2, 3, 5, 2, 3]) == [9, 7, 2, 3]  # [2, 3] twice: the earliest
    assert propose([2, 3, 5, 1, 2, 3, 6, 0, 1, 2, 3]) == [6, 0, 1, 2]  # [1, 2, 3] beats the earlier [2, 3]
    assert propose([1, 2, 3, 4]) == []  # no earlier occurrence
    assert propose([5, 1, 6, 1], lo=2) == []  # only 1-grams match
    assert propose([7, 7, 7, 7], k=2) == [7]  # the longest suffix [7, 7, 7] is followed by one token
    assert propose([3]) == []


def test_config_checks():
    assert parse_speculative_config(None) is None and parse_speculative_config("") is None
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (3, 2, 4)
    assert cfg.disable_by_batch_size == 6
    bad = {"{not json": "not valid JSON", "[1]": "must be a JSON object",
           '{"method": "ngram"}': "num_speculative_tokens is required",
           '{"method": "eagle", "num_speculative_tokens": 2}': "method must be one of ngram, draft_model",
           '{"method": "draft", "model": "x", "num_speculative_tokens": 2}': "method must be one of ngram, draft_model",
           '{"method": "ngram", "num_speculative_tokens": 0}': "num_speculative_tokens must be between 1 and 16",
           '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}':
               r"prompt_lookup_min \(5\) must be at most prompt_lookup_max \(3\)",
           '{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}': "unknown field\\(s\\) lookahead"}
    for text, message in bad.items():
        with pytest.raises(ValueError, match=message):
            parse_speculative_config(text)


def test_step_delta_carries_proposals_over_the_wire():
    step = SchedulerOutput(3, [], [], {"a": 1, "b": 4}, spec_token_ids={"b": [7, 8, 9]})
    back = wire.step_from_proto(wire.step_to_proto(step))
    assert back.spec_token_ids == {"b": [7, 8, 9]} and back.num_scheduled_tokens == {"a": 1, "b": 4}


def test_bench_serve_reports_the_runs_acceptance():
    from pagedserve.bench.serve_client import spec_rates
    before = {"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 20}
    after = {"num_drafts": 30, "num_draft_tokens": 110, "num_accepted_tokens": 76}
    run = spec_rates(before, after)
    assert (run["num_drafts"], run["num_draft_tokens"], run["num_accepted_tokens"]) == (20, 70, 56)
    assert run["acceptance_rate"] == 0.8 and run["mean_acceptance_length"] == 1 + 56 / 20
    assert spec_rates(None, after) is None
