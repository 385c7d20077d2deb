"""A bad request fails alone (issue 13): ids that collide with a live request's samples are refused
before they reach the block manager, and an exception in one request's admission, scheduling,
result bookkeeping or publishing ends that request only, while the others finish with their exact
tokens.

The Scheduler is driven with the fake worker of scheduler_driver (which checks the worker's state
against the scheduler's after every step); the service with the fake worker group and the real
Redis. Faults are injected by wrapping one method of the real object so that it raises for one
request id only (the seam an unforeseen bug in that request's path would take).
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from fake_workers import expected, started_service
from scheduler_driver import Driver, assert_drained, make_request, reference

from pagedserve.common.grpc_util import StatusError
from pagedserve.scheduler.core.request import RequestIdInUse
from pagedserve.scheduler.core.scheduler import SchedulerConfig
from pagedserve.scheduler.subscriptions import DeltaFilter, Outbox
from pagedserve.v1 import common_pb2, scheduler_pb2


def raising_for(target: str, original, after: int = 1):
    """original, except that its after-th call for target (its first argument or its group_id)
    raises RuntimeError."""
    calls = [0]

    def wrapped(first, *args, **kwargs):
        if getattr(first, "group_id", first) == target:
            calls[0] += 1
            if calls[0] == after:
                raise RuntimeError(f"injected fault for {target}")
        return original(first, *args, **kwargs)
    return wrapped


# ---- the Scheduler alone ------------------------------------------------------------------------

def test_sample_id_collisions_are_refused_before_any_block_and_freed_ids_are_reusable():
    d = Driver(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=64))
    d.add(make_request("X#1", [1, 2, 3], 6), make_request("Y", [4, 5], 6, n=3), make_request("v", [9, 8, 7], 10))
    with pytest.raises(RequestIdInUse, match="'X' .*sample id 'X#1' is already in use"):
        d.sched.add_request(make_request("X", [7, 7], 6, n=2))
    with pytest.raises(RequestIdInUse, match="'Y#2' is already in use"):
        d.sched.add_request(make_request("Y#2", [1], 6))  # a sample Y has not forked yet
    with pytest.raises(RequestIdInUse, match="'v' is already in use"):
        d.sched.add_request(make_request("v", [1], 6))
    assert set(d.sched.requests) == {"X#1", "Y", "v"} and set(d.sched.block_manager.tables) == set()
    d.run()
    d.flush()
    ref = reference([("X#1", [1, 2, 3], 6, 1), ("Y", [4, 5], 6, 3), ("v", [9, 8, 7], 10, 1)])
    assert d.outputs == ref and set(d.reasons.values()) == {"length"}
    assert_drained(d.sched)
    assert not d.sched.sample_ids
    d.add(make_request("X", [7, 7], 6, n=2))  # X#1 is gone: the id is free again
    d.run()
    again = reference([("X", [7, 7], 6, 2)])
    assert (d.outputs["X"], d.outputs["X#1"]) == (again["X"], again["X#1"])


def test_a_fault_in_one_requests_scheduling_or_results_fails_its_group_alone():
    d = Driver(SchedulerConfig(num_gpu_blocks=96, block_size=4, max_num_batched_tokens=32))
    bm = d.sched.block_manager
    # Admission from waiting, a later decode step (both in schedule()), the fork and the prefix
    # cache bookkeeping of the results (update()).
    bm.allocate = raising_for("bad-admit", bm.allocate)
    bm.allocate = raising_for("bad-decode", bm.allocate, after=6)
    bm.fork = raising_for("bad-fork", bm.fork)
    bm.cache_full_blocks = raising_for("bad-result", bm.cache_full_blocks, after=4)
    good = [("a", [1, 2, 3, 4, 5], 12, 1), ("b", [6, 7], 9, 2), ("c", list(range(20, 41)), 7, 1)]
    bad = [("bad-admit", [3, 3], 8, 1), ("bad-decode", [4, 4, 4], 12, 1), ("bad-fork", [5, 5], 8, 3),
           ("bad-result", [6, 6, 6, 6, 6], 12, 1)]
    d.add(*[make_request(rid, prompt, mt, n, arrival=float(i)) for i, (rid, prompt, mt, n) in enumerate(good + bad)])
    failed = []
    d.run(on_step=lambda drv, out: failed.extend(drv.sched.take_failed()))
    d.flush()
    assert sorted(g for g, _ in failed) == sorted(rid for rid, *_ in bad)
    assert all(isinstance(exc, RuntimeError) for _, exc in failed)
    assert d.outputs == reference(good)  # the failed ones report nothing: their clients get the error
    assert_drained(d.sched)  # and every block came back
    assert not d.sched.sample_ids


# ---- the service --------------------------------------------------------------------------------

@pytest.fixture
def service():
    service = started_service(0.003, 256)
    yield service
    service.stop()


def schedule(request_id: str, prompt: list[int], max_tokens: int, n: int = 1, **extra) -> scheduler_pb2.ScheduleRequest:
    return scheduler_pb2.ScheduleRequest(
        request_id=request_id, prompt_token_ids=prompt,
        params=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n), **extra)


class Client:
    """Subscriptions on one outbox (as a tokenizer's stream), read until each ends or fails."""

    def __init__(self, service) -> None:
        self.service = service
        self.outbox = Outbox(asyncio.get_running_loop())
        self.filters: dict[int, DeltaFilter] = {}
        self.tokens: dict[tuple[int, int], list[int]] = {}
        self.reasons: dict[tuple[int, int], str] = {}
        self.errors: dict[int, StatusError] = {}

    def submit(self, tag: int, msg: scheduler_pb2.ScheduleRequest) -> None:
        sub, group = self.service.submit(msg, self.outbox, tag)
        self.filters[tag] = DeltaFilter.for_request(group.group_id, group.n, [], sub.replayed, tag)

    async def read(self) -> None:
        while not all(f.done or tag in self.errors for tag, f in self.filters.items()):
            for sub, item in await asyncio.wait_for(self.outbox.next_batch(), 30):
                if isinstance(item, StatusError):
                    self.errors[sub.tag] = item
                    continue
                for delta in self.filters[sub.tag].deltas(*item):
                    self.tokens.setdefault((sub.tag, delta.index), []).extend(delta.token_ids)
                    if delta.finish_reason:
                        self.reasons[(sub.tag, delta.index)] = delta.finish_reason


def wait_idle(service, timeout_s: float = 10.0) -> None:
    """Until the service forgot every request and the pool is whole (the writer thread forgets a
    request after the step loop freed it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = service.stats()
        if not service.live.groups and stats.num_running == stats.num_waiting == 0 and \
                stats.num_free_gpu_blocks == stats.num_gpu_blocks:
            return
        time.sleep(0.02)
    pytest.fail(f"not idle: groups {sorted(service.live.groups)}, {service.stats()}")


def test_the_sample_id_collision_attack_is_refused_and_the_others_finish(service):
    """Issue 13, finding 1: `X#1`, then `X` with n=2, made the fork of X's sample 1 raise in the
    block manager and the step fail every request (a bystander's stream ended with "abort")."""

    async def main():
        client = Client(service)
        client.submit(1, schedule("victim", [3, 1, 4, 1, 5], 30))
        client.submit(2, schedule("X#1", [2, 7, 1], 20))
        client.submit(3, schedule("Y", [6, 6], 20, n=2))
        refusals = []
        for msg in (schedule("X", [8, 8], 20, n=2), schedule("Y#1", [1, 2], 5),
                    schedule("victim", [9], 5)):  # a live id with another prompt: no attach
            with pytest.raises(StatusError) as refused:
                service.submit(msg, client.outbox, 9)
            refusals.append(refused.value)
        await client.read()
        return client, refusals

    client, refusals = asyncio.run(main())
    assert [r.code for r in refusals] == [grpc.StatusCode.ALREADY_EXISTS] * 3
    assert "'X#1'" in refusals[0].details and "'Y#1'" in refusals[1].details and "'victim'" in refusals[2].details
    assert not client.errors
    assert client.tokens[(1, 0)] == expected([3, 1, 4, 1, 5], 30) and client.reasons[(1, 0)] == "length"
    assert client.tokens[(2, 0)] == expected([2, 7, 1], 20)
    assert client.tokens[(3, 0)] == client.tokens[(3, 1)] == expected([6, 6], 20)
    wait_idle(service)
    # Finished and stored: the same request again replays it, another prompt under its id is refused.
    with pytest.raises(StatusError) as refused:
        asyncio.run(_submit_and_read(service, schedule("X#1", [1, 1], 20)))
    assert refused.value.code is grpc.StatusCode.ALREADY_EXISTS
    assert asyncio.run(_submit_and_read(service, schedule("X#1", [2, 7, 1], 20))) == expected([2, 7, 1], 20)


async def _submit_and_read(service, msg) -> list[int]:
    client = Client(service)
    client.submit(1, msg)
    await client.read()
    return client.tokens[(1, 0)]


def test_concurrent_duplicate_ids_one_is_accepted_the_other_refused(service):
    """Two submits of one new id at once, from two threads: exactly one is admitted; the other is
    refused with ALREADY_EXISTS (never both admitted, never the first one's stream orphaned)."""
    rounds = 8

    async def main():
        loop = asyncio.get_running_loop()
        client = Client(service)
        client.submit(1, schedule("bystander", [4, 2], 40))
        outcomes, prompts = [], {}
        for r in range(rounds):
            barrier = threading.Barrier(2)

            def submit(tag: int, prompt: list[int], rid=f"dup{r}", barrier=barrier):
                barrier.wait()
                try:
                    return service.submit(schedule(rid, prompt, 60), client.outbox, tag)
                except StatusError as exc:
                    return exc
            results = await asyncio.gather(loop.run_in_executor(None, submit, 10 + 2 * r, [1, r + 1]),
                                           loop.run_in_executor(None, submit, 11 + 2 * r, [2, r + 2]))
            for tag, result in zip((10 + 2 * r, 11 + 2 * r), results):
                if isinstance(result, StatusError):
                    outcomes.append(result.code)
                else:
                    sub, group = result
                    outcomes.append("accepted")
                    client.filters[tag] = DeltaFilter.for_request(group.group_id, 1, [], sub.replayed, tag)
                    prompts[tag] = group.prompt_token_ids
        await client.read()
        return client, outcomes, prompts

    client, outcomes, prompts = asyncio.run(main())
    assert outcomes.count("accepted") == rounds and outcomes.count(grpc.StatusCode.ALREADY_EXISTS) == rounds
    assert not client.errors
    assert client.tokens[(1, 0)] == expected([4, 2], 40)
    assert len(prompts) == rounds
    for tag, prompt in prompts.items():
        assert client.tokens[(tag, 0)] == expected(prompt, 60)
    wait_idle(service)


def test_a_retry_with_the_same_prompt_attaches(service):
    """The one case where a second schedule of a live id is welcome: the same request again (an
    idempotent retry, a resume) follows the running one."""
    async def main():
        client = Client(service)
        client.submit(1, schedule("retry", [5, 5, 5], 25))
        client.submit(2, schedule("retry", [5, 5, 5], 25))
        await client.read()
        return client
    client = asyncio.run(main())
    assert client.tokens[(1, 0)] == client.tokens[(2, 0)] == expected([5, 5, 5], 25)


def test_a_fault_in_one_requests_admission_step_or_publish_fails_it_alone(service, monkeypatch):
    sched = service.scheduler
    monkeypatch.setattr(sched, "add_request", raising_for("bad-admit", sched.add_request))
    bm = sched.block_manager  # results bookkeeping, after a few tokens
    monkeypatch.setattr(bm, "cache_full_blocks", raising_for("bad-step", bm.cache_full_blocks, after=5))
    monkeypatch.setattr(service.recorder, "finished", raising_for("bad-publish", service.recorder.finished))

    async def main():
        client = Client(service)
        client.submit(1, schedule("good", [1, 2, 3], 30))
        client.submit(2, schedule("bad-admit", [2, 2], 30))
        client.submit(3, schedule("bad-step", [3, 3, 3], 40))
        client.submit(4, schedule("bad-publish", [4, 4], 10))
        client.submit(5, schedule("good-n", [5, 5, 5, 5], 25, n=2))
        await client.read()
        return client

    client = asyncio.run(main())
    assert sorted(client.errors) == [2, 3, 4]
    for tag, rid in ((2, "bad-admit"), (3, "bad-step"), (4, "bad-publish")):
        error = client.errors[tag]
        assert error.code is grpc.StatusCode.INTERNAL and f"'{rid}'" in error.details
        assert "injected" not in error.details  # the exception goes to the log, not to the client
    assert client.tokens[(1, 0)] == expected([1, 2, 3], 30) and client.reasons[(1, 0)] == "length"
    assert client.tokens[(5, 0)] == client.tokens[(5, 1)] == expected([5, 5, 5, 5], 25)
    assert len(client.tokens.get((3, 0), [])) < 40
    wait_idle(service)
    store = service.store
    assert store.load("bad-admit") is None  # refused before anything was stored
    for tag, rid in ((3, "bad-step"), (4, "bad-publish")):
        record = store.load(rid)
        assert record.status == "finished" and record.finish_reasons == ["abort"], record
        assert (record.error, record.error_code) == (client.errors[tag].details, "INTERNAL")
        assert rid not in store.active_ids()  # a restarted scheduler does not run it again
        # An attach (a tokenizer's re-attach, a resume) is told the error, not finish_reason "abort".
        with pytest.raises(StatusError) as err:
            service.submit(schedule(rid, [], 0, attach=True), Outbox(asyncio.new_event_loop()), 9)
        assert err.value.code is grpc.StatusCode.INTERNAL and err.value.details == record.error
    assert service.step_loop.is_alive()  # and the engine goes on serving
    assert asyncio.run(_submit_and_read(service, schedule("after", [7, 7], 12))) == expected([7, 7], 12)


def test_an_abort_of_a_sample_that_does_not_exist_changes_nothing(service):
    """Abort(index) past n used to raise in the step loop's command (an IndexError), which ended
    the step-loop thread: every request then hung."""

    async def main():
        client = Client(service)
        client.submit(1, schedule("target", [8, 1], 30))
        assert not service.abort("target", 5) and not service.abort("target", -1)
        assert not service.abort("nobody", 0)
        await client.read()
        return client

    client = asyncio.run(main())
    assert client.tokens[(1, 0)] == expected([8, 1], 30) and not client.errors


def test_a_failed_step_ends_every_request_with_its_record(service, monkeypatch):
    """What RequestEndings.fail_all is for: a step that failed as a whole (the forward pass raised, not a rank
    that went away). Every request in flight ends with INTERNAL and its record finished, so that a
    restarted scheduler does not run them again; the engine serves on."""
    monkeypatch.setattr(service.workers, "receive", _failing_once(service.workers.receive, after_calls=3))

    async def main():
        client = Client(service)
        client.submit(1, schedule("one", [1, 1], 30))
        client.submit(2, schedule("two", [2, 2], 30, n=2))
        await client.read()
        return client

    client = asyncio.run(main())
    assert sorted(client.errors) == [1, 2]
    assert {e.code for e in client.errors.values()} == {grpc.StatusCode.INTERNAL}
    wait_idle(service)
    for rid in ("one", "two"):
        assert service.store.load(rid).status == "finished" and rid not in service.store.active_ids()
    assert asyncio.run(_submit_and_read(service, schedule("after", [7, 7], 12))) == expected([7, 7], 12)


def _failing_once(step, after_calls: int):
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        result = step(*args, **kwargs)  # taken off the stream: the next step's answer is next
        if calls[0] == after_calls:
            raise RuntimeError("injected forward-pass fault")
        return result
    return wrapped
