"""The scheduler's rules for prompt logprobs, on the real scheduler core with a fake worker whose
"logprob" of prompt position p is -p: no prefix-cache hits for a request that asks (others still
take them), chunks stitched in order, each position once across a recompute, the whole list with
each sample's first token only, max_tokens 0 finishing "length" without a token; and the
subscription filter that sends them once across a re-attach."""

from __future__ import annotations

from pagedserve.common.messages import ModelRunnerOutput, PromptLogprobs, SampledToken
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.scheduler.core.request import Request
from pagedserve.scheduler.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.scheduler.subscriptions import Delivery
from pagedserve.scheduler.subscriptions import DeltaFilter

PROMPT = list(range(100, 118))  # 18 tokens: 4 full blocks of 4


def fake_step(sched: Scheduler) -> tuple[list, object]:
    out = sched.schedule()
    sampled, prompt = {}, {}
    for rid, n in out.num_scheduled_tokens.items():
        req = sched.requests[rid]
        c = req.num_computed_tokens
        m = min(c + n, req.num_prompt_tokens - 1) - c
        if req.params.prompt_logprobs is not None and m > 0:
            span = range(c + 1, c + 1 + m)
            prompt[rid] = PromptLogprobs(c + 1, [SampledToken(req.token_ids[p], -float(p)) for p in span])
        if c + n == req.num_tokens and req.params.max_tokens:
            sampled[rid] = [SampledToken(7 + i) for i in range(1 + len(req.child_req_ids))]
    return sched.update(out, ModelRunnerOutput(out.step_id, sampled, prompt_logprobs=prompt)), out


def scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=5))


def run(sched: Scheduler, req: Request) -> list:
    sched.add_request(req)
    updates = []
    while sched.has_unfinished():
        updates += fake_step(sched)[0]
    return updates


def positions(entries) -> list[float]:
    return [-e.logprob for e in entries]


def test_no_prefix_hits_chunks_in_order_and_the_list_with_the_first_token_only():
    sched = scheduler()
    run(sched, Request("warm", list(PROMPT), len(PROMPT), SamplingParams(max_tokens=2)))
    asking = Request("a", list(PROMPT), len(PROMPT), SamplingParams(max_tokens=3, prompt_logprobs=0, n=2))
    updates = run(sched, asking)
    assert asking.num_cached_tokens == 0  # the cache held the prompt, but no logits: no hits
    firsts = [u for u in updates if u.prompt_logprobs is not None]
    assert sorted(u.request.sample_index for u in firsts) == [0, 1]  # each sample's first token carries it
    for u in firsts:
        assert u.new_tokens and positions(u.prompt_logprobs) == list(range(1, len(PROMPT)))
    plain = Request("b", list(PROMPT), len(PROMPT), SamplingParams(max_tokens=1))
    run(sched, plain)
    assert plain.num_cached_tokens == 16  # the same prompt without prompt logprobs does take hits


def test_a_recompute_delivers_each_position_once():
    sched = scheduler()
    req = Request("r", list(PROMPT), len(PROMPT), SamplingParams(max_tokens=2, prompt_logprobs=1))
    sched.add_request(req)
    fake_step(sched)
    fake_step(sched)  # 10 of 18 prompt tokens computed
    assert sched.preempt_all_for_new_session(64, 0) == 1  # the workers lost the KV: it re-runs the prompt
    updates = []
    while sched.has_unfinished():
        updates += fake_step(sched)[0]
    (first,) = [u for u in updates if u.prompt_logprobs is not None]
    assert positions(first.prompt_logprobs) == list(range(1, len(PROMPT)))
    assert [t.token_id for t in first.prompt_logprobs] == PROMPT[1:]
    assert req.num_output_tokens == 2 and req.finish_reason == "length"


def test_max_tokens_zero_finishes_after_the_prefill_without_a_token():
    sched = scheduler()
    req = Request("z", list(PROMPT), len(PROMPT), SamplingParams(max_tokens=0, prompt_logprobs=0))
    updates = run(sched, req)
    assert [(u.new_tokens, u.finished) for u in updates] == [([], True)]
    assert positions(updates[0].prompt_logprobs) == list(range(1, len(PROMPT)))
    assert req.finish_reason == "length" and req.token_ids == PROMPT
    assert sched.block_manager.num_free_blocks == 64


def test_a_reattached_subscriber_past_the_first_token_gets_no_second_copy():
    lps = [SampledToken(t, -1.0) for t in PROMPT[1:]]
    first = Delivery(0, 0, [7], prompt_logprobs=lps)
    fresh = DeltaFilter.for_request("r", 1, [], replayed=True)
    (msg,) = fresh.deltas(False, [first])
    assert [t.token_id for t in msg.prompt_logprobs] == PROMPT[1:]
    (later,) = fresh.deltas(False, [Delivery(0, 1, [8])])
    assert not later.prompt_logprobs
    reattached = DeltaFilter.for_request("r", 1, [1], replayed=True)  # it had the first token already
    (replay,) = reattached.deltas(True, [Delivery(0, 0, [7, 8], prompt_logprobs=lps)])
    assert list(replay.token_ids) == [8] and not replay.prompt_logprobs
