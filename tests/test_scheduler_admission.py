"""What the scheduler admits, and in which order: prompts and configs it refuses, and the priority
and first-come-first-served policies (who is admitted first, who is preempted first)."""

from __future__ import annotations

import pytest

from pagedserve.scheduler.core.scheduler import Scheduler, SchedulerConfig
from scheduler_driver import Driver, assert_drained, expected_outputs, make_request


# ---- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt_len, kwargs, match", [
    (0, {}, "empty"),
    (64, {}, r"max_model_len\) is 64"),
    (100, {}, r"max_model_len\) is 64"),
    (40, dict(num_gpu_blocks=8), "whole KV pool has 8"),
    (40, dict(enable_chunked_prefill=False, max_num_batched_tokens=32), r"max_num_batched_tokens \(32\)"),
])
def test_bad_prompts_are_refused(prompt_len, kwargs, match):
    cfg = SchedulerConfig(**{"num_gpu_blocks": 64, "block_size": 4, "max_model_len": 64, **kwargs})
    sched = Scheduler(cfg)
    with pytest.raises(ValueError, match=match):
        sched.add_request(make_request("x", list(range(prompt_len))))
    assert not sched.has_unfinished() and not sched.requests and not sched.groups


def test_prompt_that_just_fits_is_accepted():
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=8, block_size=4, max_model_len=64))
    sched.add_request(make_request("x", list(range(31))))  # 31 + 1 tokens = 8 blocks
    with pytest.raises(ValueError, match="whole KV pool has 8"):
        sched.add_request(make_request("z", list(range(32))))
    big = Scheduler(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_model_len=64))
    big.add_request(make_request("y", list(range(63))))  # max_model_len - 1


def test_n_above_max_num_seqs_and_duplicate_ids_are_refused():
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_seqs=4))
    with pytest.raises(ValueError, match=r"n=5 is more than max_num_seqs \(4\)"):
        sched.add_request(make_request("x", [1, 2], n=5))
    assert not sched.requests and not sched.groups
    sched.add_request(make_request("x", [1, 2], n=4))
    with pytest.raises(ValueError, match="'x' is already in use"):
        sched.add_request(make_request("x", [3]))
    assert len(sched.waiting) == 1


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        SchedulerConfig(num_gpu_blocks=8, preemption_mode="swap")
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(num_gpu_blocks=8, preemption_mode="drop")
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(num_gpu_blocks=8, policy="lifo")
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(num_gpu_blocks=8, max_num_seqs=0)


# ---- priority policy ----------------------------------------------------------------------------

def test_priority_policy_admits_lower_value_first():
    d = Driver(SchedulerConfig(num_gpu_blocks=32, block_size=4, max_num_seqs=1, policy="priority"))
    d.add(make_request("low", [1, 2, 3], max_tokens=3, priority=5, arrival=0),
          make_request("high", [4, 5, 6], max_tokens=3, priority=0, arrival=1))
    out = d.step()
    assert list(out.num_scheduled_tokens) == ["high"]
    d.run()
    first_low = next(i for i, s in enumerate(d.steps) if "low" in s.num_scheduled_tokens)
    last_high = max(i for i, s in enumerate(d.steps) if "high" in s.num_scheduled_tokens)
    assert first_low > last_high


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_priority_policy_preempts_the_highest_value_first(mode):
    cfg = SchedulerConfig(num_gpu_blocks=4, block_size=4, policy="priority", preemption_mode=mode,
                          num_cpu_blocks=8 if mode == "swap" else 0)
    d = Driver(cfg)
    d.add(make_request("p0", [1, 2, 3, 4], max_tokens=6, priority=0, arrival=0),
          make_request("p5", [5, 6, 7, 8], max_tokens=6, priority=5, arrival=1),
          make_request("p1", [9, 8, 7, 6], max_tokens=6, priority=1, arrival=2))
    order = []

    def on_step(drv, out):
        for req in (drv.sched.waiting + drv.sched.swapped):
            if req.num_preemptions and req.request_id not in order:
                order.append(req.request_id)

    d.run(on_step=on_step)
    d.flush()
    assert order[0] == "p5"
    assert "p0" not in order
    assert d.outputs["p0"] == expected_outputs([1, 2, 3, 4], 6)[0]
    assert d.worker.kv_errors == []
    assert_drained(d.sched)


def test_fcfs_policy_ignores_priority():
    d = Driver(SchedulerConfig(num_gpu_blocks=32, block_size=4, max_num_seqs=1, policy="fcfs"))
    d.add(make_request("early", [1, 2, 3], max_tokens=3, priority=5, arrival=0),
          make_request("late", [4, 5, 6], max_tokens=3, priority=0, arrival=1))
    assert list(d.step().num_scheduled_tokens) == ["early"]
