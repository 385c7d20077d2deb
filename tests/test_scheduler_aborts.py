"""Aborts: an unknown or finished id, a waiting, running, swapped or forked request, and one aborted
while its step runs; the blocks are freed at once and the worker is told."""

from __future__ import annotations

from pagedserve.scheduler.core.request import RequestStatus
from pagedserve.scheduler.core.scheduler import SchedulerConfig
from scheduler_driver import Driver, assert_drained, expected_outputs, make_request


# ---- abort --------------------------------------------------------------------------------------

def test_abort_unknown_and_twice():
    d = Driver(SchedulerConfig(num_gpu_blocks=16, block_size=4))
    assert d.sched.abort("nope") is False
    d.add(make_request("a", [1, 2, 3]))
    assert d.sched.abort("a") is True
    assert d.sched.abort("a") is False
    assert not d.sched.has_unfinished()
    d.flush()
    assert_drained(d.sched)


def test_abort_waiting_request():
    d = Driver(SchedulerConfig(num_gpu_blocks=16, block_size=4, max_num_seqs=1))
    d.add(make_request("a", [1, 2, 3], max_tokens=5, arrival=0),
          make_request("b", [1, 2, 3, 4, 5], arrival=1))
    d.step()
    b = d.sched.requests["b"]
    assert b.status is RequestStatus.WAITING
    assert d.sched.abort("b")
    assert b.status is RequestStatus.FINISHED_ABORTED and b not in d.sched.waiting
    assert "b" not in d.sched.block_manager.tables and "b" not in d.sched.block_manager.block_hashes
    out = d.step()
    assert "b" not in out.finished_req_ids  # the worker never saw it (the fake worker checks this too)
    d.run()
    d.flush()
    assert d.outputs == {"a": expected_outputs([1, 2, 3], 5)[0]}
    assert_drained(d.sched)


def test_abort_running_request_frees_blocks_now_and_tells_the_worker():
    d = Driver(SchedulerConfig(num_gpu_blocks=16, block_size=4))
    d.add(make_request("a", list(range(10)), max_tokens=50, arrival=0),
          make_request("b", [5, 6], max_tokens=4, arrival=1))
    d.step()
    d.step()
    bm = d.sched.block_manager
    held = len(bm.tables["a"])
    free = bm.num_free_blocks
    assert d.sched.abort("a")
    assert "a" not in bm.tables and bm.num_free_blocks == free + held
    assert d.sched.requests.get("a") is None and "a" not in d.sched.groups
    out = d.step()
    assert out.finished_req_ids == ["a"] and "a" not in out.num_scheduled_tokens
    assert "a" not in d.worker.requests
    d.run()
    d.flush()
    assert set(d.outputs) == {"b"}
    assert_drained(d.sched)


def test_abort_while_the_step_runs():
    d = Driver(SchedulerConfig(num_gpu_blocks=16, block_size=4))
    d.add(make_request("a", list(range(6)), max_tokens=50))
    d.step()
    out = d.sched.schedule()
    result = d.worker.execute(out)
    assert "a" in result.sampled
    assert d.sched.abort("a")
    assert d.sched.update(out, result) == []  # the late result is ignored
    assert not d.sched.has_unfinished()
    d.flush()
    assert_drained(d.sched)


def test_abort_swapped_request():
    cfg = SchedulerConfig(num_gpu_blocks=8, block_size=4, preemption_mode="swap", num_cpu_blocks=16)
    d = Driver(cfg)
    d.add(make_request("a", list(range(10)), max_tokens=18, arrival=0),
          make_request("b", list(range(20, 30)), max_tokens=18, arrival=1))
    for _ in range(40):
        d.step()
        if d.sched.swapped:
            break
    assert [r.request_id for r in d.sched.swapped] == ["b"]
    bm = d.sched.block_manager
    assert "b" in bm.cpu_tables and bm.cpu_pool.num_free < 16
    assert d.sched.abort("b")
    assert "b" not in bm.cpu_tables and bm.cpu_pool.num_free == 16 and not d.sched.swapped
    out = d.step()
    assert "b" in out.finished_req_ids and "b" not in d.worker.requests
    d.run()
    d.flush()
    assert d.outputs == {"a": expected_outputs(list(range(10)), 18)[0]}
    assert_drained(d.sched)


def test_abort_a_forked_group_aborts_every_sample():
    d = Driver(SchedulerConfig(num_gpu_blocks=32, block_size=4))
    d.add(make_request("p", list(range(6)), max_tokens=10, n=3))
    d.step()
    assert {r.request_id for r in d.sched.running} == {"p", "p#1", "p#2"}
    assert d.sched.abort("p")
    assert not d.sched.has_unfinished() and not d.sched.groups
    out = d.step()
    assert sorted(out.finished_req_ids) == ["p", "p#1", "p#2"]
    d.flush()
    assert_drained(d.sched)
