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
from pagedserve.scheduler.subscriptions import DeltaFilter, Outbox

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


def test_no_prefix_hits_chunks_in_order_and_the_list_once_per_request():
    sched = scheduler()
    run(sched, Request("warm", list(PROMPT), len(PROMPT), SamplingParams(max_tokens=2)))
    asking = Request("a", list(PROMPT), len(PROMPT), SamplingParams(max_tokens=3, prompt_logprobs=0, n=16))
    updates = run(sched, asking)
    assert asking.num_cached_tokens == 0  # the cache held the prompt, but no logits: no hits
    # Issue 42 row 3: once per request (it was copied into each of the 16 samples' first update),
    # with sample 0's first token, ahead of the other samples' first tokens.
    (first,) = [u for u in updates if u.prompt_logprobs is not None]
    assert first is next(u for u in updates if u.new_tokens) and first.request.sample_index == 0
    assert first.new_tokens and positions(first.prompt_logprobs) == list(range(1, len(PROMPT)))
    order = list(dict.fromkeys(u.request.sample_index for u in updates if u.new_tokens))  # by first token
    assert order[0] == 0 and sorted(order) == list(range(16))
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


# ---- through the scheduler service (fake worker, real Redis): what goes out on the streams ------------

def test_n16_sends_the_prompt_logprobs_once_and_a_reattach_only_what_it_lacks():
    """Issue 42 row 3: with n = 16 the prompt's logprobs went out 16 times (every sample's first
    delta), and a subscriber attaching to the running request was replayed 16 copies again. Now one
    copy per request on the first stream; a re-attach past sample 0's first token (a tokenizer whose
    stream broke) gets none; one from the start (an idempotent retry) gets the one copy it lacks;
    one whose schedule does not ask (the gateway's resume) gets none."""
    import asyncio

    from fake_workers import started_service

    from pagedserve.v1 import common_pb2, scheduler_pb2

    prompt = list(range(100, 160))
    service = started_service(0.01, 256)

    def schedule(asks: bool = True, **extra) -> scheduler_pb2.ScheduleRequest:
        params = common_pb2.SamplingParams(max_tokens=200, temperature=1.0, seed=1, ignore_eos=True, n=16)
        if asks:
            params.prompt_logprobs = 3
        return scheduler_pb2.ScheduleRequest(request_id="pl16", prompt_token_ids=prompt, params=params, **extra)

    async def follow(outbox, filters, until) -> list:
        deltas = []
        while not until(deltas):
            for sub, item in await asyncio.wait_for(outbox.next_batch(), 30):
                deltas += filters[sub.tag].deltas(*item)
        return deltas

    def subscribe(msg, tag):
        outbox = Outbox(asyncio.get_running_loop())
        sub, group = service.submit(msg, outbox, tag)
        deltas = DeltaFilter.for_request(group.group_id, group.n, msg.skip_tokens, sub.replayed, tag)
        deltas.prompt_logprobs = msg.params.HasField("prompt_logprobs")  # as server.py makes it
        return outbox, {tag: deltas}

    def carrying(deltas) -> list:
        return [d for d in deltas if d.prompt_logprobs]

    async def main():
        first = await follow(*subscribe(schedule(), 1), lambda ds: sum(len(d.token_ids) for d in ds) >= 16 * 3)
        received = [0] * 16
        for d in first:
            received[d.index] += len(d.token_ids)
        some = lambda ds: sum(len(d.token_ids) for d in ds) >= 16  # noqa: E731
        reattached = await follow(*subscribe(schedule(attach=True, skip_tokens=received), 2), some)
        retried = await follow(*subscribe(schedule(), 3), some)
        resumed = await follow(*subscribe(schedule(asks=False), 4), some)
        return first, reattached, retried, resumed

    try:
        first, reattached, retried, resumed = asyncio.run(main())
    finally:
        service.stop()
    (once,) = carrying(first)
    assert once is first[0] and once.index == 0 and list(once.token_ids)  # ahead of every other sample's
    assert [-e.logprob for e in once.prompt_logprobs] == list(range(1, len(prompt)))
    assert not carrying(reattached) and not carrying(resumed)
    (again,) = carrying(retried)
    assert again.index == 0 and list(again.prompt_logprobs) == list(once.prompt_logprobs)
