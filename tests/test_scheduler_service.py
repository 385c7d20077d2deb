"""SchedulerService driven in-process, without gRPC: a fake worker group that keeps its request
state with the model runner's own bookkeeping (RequestStates) and samples a known function of
the token ids, and the real Redis store under a fresh key prefix.

What the services rely on: a tokenizer's requests share one outbox and get one hand-over per
step (not one per request); tokens are in the store before a subscriber sees them; a second
subscriber attaching with skip_tokens sees no token twice; the last subscriber leaving aborts
the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from fake_workers import expected, started_service

from pagedserve.scheduler.subscriptions import DeltaFilter, Outbox
from pagedserve.v1 import common_pb2, scheduler_pb2



class CountingOutbox(Outbox):
    def __init__(self, loop) -> None:
        super().__init__(loop)
        self.posts = 0

    def post(self, items) -> None:
        self.posts += 1
        super().post(items)


@pytest.fixture
def service():
    service = started_service(0.002, 256)
    yield service
    service.stop()


def schedule(request_id: str, prompt: list[int], max_tokens: int, **extra) -> scheduler_pb2.ScheduleRequest:
    return scheduler_pb2.ScheduleRequest(
        request_id=request_id, prompt_token_ids=prompt,
        params=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), **extra)


async def drain(outbox: Outbox, filters: dict[int, DeltaFilter], tokens: dict[int, list[int]], on_delta=None):
    """Read the outbox until every subscription finished; tokens per tag."""
    while not all(f.done for f in filters.values()):
        for sub, item in await asyncio.wait_for(outbox.next_batch(), 30):
            assert not isinstance(item, Exception), item
            for delta in filters[sub.tag].deltas(*item):
                assert delta.tag == sub.tag
                if on_delta is not None:
                    on_delta(delta)
                tokens.setdefault(sub.tag, []).extend(delta.token_ids)


def test_one_outbox_carries_many_requests_with_one_hand_over_per_step(service):
    prompts = {tag: [tag, tag + 1, tag + 2] * (tag % 4 + 1) for tag in range(1, 17)}

    async def main():
        outbox = CountingOutbox(asyncio.get_running_loop())
        filters, tokens = {}, {}
        for tag, prompt in prompts.items():
            sub, group = service.submit(schedule(f"r{tag}", prompt, 12), outbox, tag)
            filters[tag] = DeltaFilter.for_request(group.group_id, group.n, [], sub.replayed, tag)
        await drain(outbox, filters, tokens)
        return outbox.posts, tokens

    steps_before = service.workers.num_steps
    posts, tokens = asyncio.run(main())
    assert tokens == {tag: expected(prompt, 12) for tag, prompt in prompts.items()}
    steps = service.workers.num_steps - steps_before
    # 16 requests x 12 tokens arrive in about as many hand-overs as there were steps, not 192.
    assert posts <= steps + 1 < 16 * 12 // 2, (posts, steps)


def test_tokens_are_stored_before_they_are_delivered(service):
    store = service.store

    def check(delta):
        record = store.load(delta.request_id)
        assert record is not None and len(record.outputs[0]) >= filters[1].sent[0], "delivered before stored"

    async def main():
        outbox = Outbox(asyncio.get_running_loop())
        sub, group = service.submit(schedule("durable", [5, 6, 7], 20), outbox, 1)
        filters[1] = DeltaFilter.for_request(group.group_id, 1, [], sub.replayed, 1)
        await drain(outbox, filters, tokens, on_delta=check)

    filters, tokens = {}, {}
    asyncio.run(main())
    assert tokens[1] == expected([5, 6, 7], 20)


def test_attach_with_skip_tokens_sends_no_token_twice(service):
    service.workers.step_delay_s = 0.02  # slow enough to attach mid-way

    async def main():
        loop = asyncio.get_running_loop()
        first = Outbox(loop)
        sub, group = service.submit(schedule("shared", [9, 9], 40), first, 1)
        filters = {1: DeltaFilter.for_request(group.group_id, 1, [], sub.replayed, 1)}
        seen: list[int] = []
        while len(seen) < 5:
            for _sub, item in await asyncio.wait_for(first.next_batch(), 30):
                for delta in filters[1].deltas(*item):
                    seen.extend(delta.token_ids)
        # A re-attach as a tokenizer does after its stream broke: skip what it already has.
        second = Outbox(loop)
        sub2, group2 = service.submit(schedule("shared", [9, 9], 40, attach=True, skip_tokens=[len(seen)]),
                                      second, 2)
        assert group2 is group and not sub2.replayed
        rest = {2: DeltaFilter.for_request(group.group_id, 1, [len(seen)], sub2.replayed, 2)}
        tokens: dict[int, list[int]] = {}
        await drain(second, rest, tokens)
        return seen, tokens[2]

    seen, rest = asyncio.run(main())
    assert seen + rest == expected([9, 9], 40)


class HeldStore:
    """The real store behind a gate: the record writer's writes wait until `gate` is set."""

    def __init__(self, store, gate: threading.Event) -> None:
        self.store, self.gate = store, gate

    def write(self, writes) -> None:
        assert self.gate.wait(30), "the gate was never opened"
        self.store.write(writes)


@pytest.mark.parametrize("ended_by", ["length", "abort"])
def test_attach_after_the_end_but_before_the_group_is_forgotten_replays_every_token(service, ended_by):
    """A re-attach (a tokenizer after its scheduler restarted, say) can reach a request that the
    Scheduler has already let go while its last records are still being written: the group is
    live, its samples' Requests are gone from the Scheduler. The replay still has their tokens."""
    gate = threading.Event()
    service.writer.store = HeldStore(service.store, gate)  # nothing durable, nothing forgotten yet

    async def main():
        loop = asyncio.get_running_loop()
        first = Outbox(loop)
        sub, group = service.submit(schedule("ended", [4, 2], 400 if ended_by == "abort" else 12), first, 1)
        while group.output_tokens < 12:  # the step loop goes on while the writer waits
            await asyncio.sleep(0.005)
        if ended_by == "abort":
            service.abort("ended")
        while not group.done:
            await asyncio.sleep(0.005)
        assert "ended" not in service.scheduler.groups and service.live.get("ended") is group
        second = Outbox(loop)
        sub2, group2 = service.submit(schedule("ended", [4, 2], 0, attach=True, skip_tokens=[2]), second, 2)
        assert group2 is group
        gate.set()
        rest = {2: DeltaFilter.for_request(group.group_id, 1, [2], sub2.replayed, 2)}
        tokens: dict[int, list[int]] = {}
        await drain(second, rest, tokens)
        return group.output_tokens, tokens[2], rest[2]

    made, rest, delta_filter = asyncio.run(main())
    assert made >= 12 and rest == expected([4, 2], made)[2:]
    assert delta_filter.done


def test_last_subscriber_leaving_aborts_and_frees_blocks(service):
    service.workers.step_delay_s = 0.02
    done = threading.Event()

    async def main():
        outbox = Outbox(asyncio.get_running_loop())
        sub, group = service.submit(schedule("leaver", list(range(1, 40)), 400), outbox, 1)
        await asyncio.wait_for(outbox.next_batch(), 30)  # it runs
        service.unsubscribe(sub)
        for _ in range(300):  # the blocks free on the step loop, the record is written after
            stats = service.stats()
            if stats.num_running == 0 and stats.num_free_gpu_blocks == stats.num_gpu_blocks and \
                    service.store.load("leaver").finish_reasons == ["abort"]:
                done.set()
                return
            await asyncio.sleep(0.02)

    asyncio.run(main())
    assert done.is_set(), "the request kept its blocks, or was not recorded as aborted, after its only subscriber left"
    record = service.store.load("leaver")
    assert record.finish_reasons == ["abort"] and len(record.outputs[0]) < 400


def test_engine_stats_pollers_share_one_snapshot(service):
    """Many pollers (gateways, dashboards) cost the step loop one snapshot per STATS_SNAPSHOT_S."""
    from pagedserve.scheduler.service import STATS_SNAPSHOT_S

    async def poll():
        taken = 0
        original = service.recorder.engine_stats

        def counting(*args):
            nonlocal taken
            taken += 1
            return original(*args)

        service.recorder.engine_stats = counting
        first = await service.engine_stats(64)
        again = await asyncio.gather(*(service.engine_stats(64) for _ in range(8)))
        assert all(s is first for s in again) and taken == 1
        await asyncio.sleep(STATS_SNAPSHOT_S + 0.05)
        assert await service.engine_stats(64) is not first and taken == 2

    asyncio.run(poll())


def test_steps_go_ahead_only_behind_decode_steps(service):
    """Async scheduling sends step N+1 before N's results only while N is a decode step: behind a
    step with prompt tokens (long) the loop waits, so a request arriving meanwhile joins the next
    step rather than the one after."""
    workers = service.workers

    async def main():
        outbox = Outbox(asyncio.get_running_loop())
        filters, tokens = {}, {}
        for tag in (1, 2):
            sub, group = service.submit(schedule(f"ahead{tag}", [tag] * 40, 16), outbox, tag)
            filters[tag] = DeltaFilter.for_request(group.group_id, group.n, [], sub.replayed, tag)
        await drain(outbox, filters, tokens)
        return tokens

    first = len(workers.events)
    assert asyncio.run(main()) == {tag: expected([tag] * 40, 16) for tag in (1, 2)}
    in_flight, prefill_in_flight, ahead = [], 0, 0
    for kind, step_id, has_prefill in workers.events[first:]:
        if kind == "send":
            if in_flight:
                ahead += 1
                prefill_in_flight += any(p for _, p in in_flight)
            in_flight.append((step_id, has_prefill))
        else:
            assert in_flight and in_flight[0][0] == step_id
            in_flight.pop(0)
    assert prefill_in_flight == 0, "a step went ahead of one with prompt tokens"
    assert ahead >= 10, f"only {ahead} steps went ahead of a decode step"
