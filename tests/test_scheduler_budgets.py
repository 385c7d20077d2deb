"""The scheduler's step budgets (tokens, sequences, the long-prefill cap) and chunked prefill, and
its step statistics: why requests stayed waiting."""

from __future__ import annotations

import pytest

from pagedserve.scheduler.core.scheduler import SchedulerConfig
from scheduler_driver import (Driver, assert_drained, expected_outputs, make_request, make_requests, reference, run,
                              workload)


# ---- budgets and chunked prefill ----------------------------------------------------------------

def test_long_prompt_is_chunked_while_decodes_keep_their_token():
    d = Driver(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=8))
    d.add(make_request("dec", [1, 2, 3], max_tokens=30, arrival=0))
    d.step()  # prefill of dec
    d.add(make_request("long", list(range(100, 150)), max_tokens=2, arrival=1))
    chunks = []
    while "long" not in d.outputs:
        out = d.step()
        assert out.total_num_scheduled_tokens <= 8
        assert out.num_scheduled_tokens["dec"] == 1, "a running decode lost its token to a prefill"
        assert list(out.num_scheduled_tokens)[0] == "dec", "decodes are scheduled before prefill chunks"
        if "long" in out.num_scheduled_tokens:
            chunks.append(out.num_scheduled_tokens["long"])
    # 50 prompt tokens at 7 per step, then its second output token as a decode.
    assert chunks[:-1] == [7] * 7 + [1] and sum(chunks[:-1]) == 50 and chunks[-1] == 1
    assert d.outputs["long"] == expected_outputs(list(range(100, 150)), 2)[0]
    d.run()
    d.flush()
    assert d.outputs["dec"] == expected_outputs([1, 2, 3], 30)[0]
    assert_drained(d.sched)


def test_budget_and_max_num_seqs_every_step():
    cfg = SchedulerConfig(num_gpu_blocks=40, block_size=2, max_num_batched_tokens=10, max_num_seqs=3)
    work = workload(with_n=False)
    seen = []
    res = run(cfg, make_requests(work),
              on_step=lambda d, out: seen.append((out.total_num_scheduled_tokens, len(d.sched.running))))
    assert max(t for t, _ in seen) == 10 and max(n for _, n in seen) == 3
    assert res.outputs == reference(work)


def test_long_prefill_token_threshold_caps_each_prefill_per_step():
    cfg = SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=16,
                          long_prefill_token_threshold=5)
    d = Driver(cfg)
    d.add(make_request("dec", [1, 2], max_tokens=20, arrival=0))
    d.step()  # a 2-token prompt: under the cap
    d.add(make_request("x", list(range(100, 123)), max_tokens=2, arrival=1),
          make_request("y", list(range(200, 212)), max_tokens=2, arrival=2))
    out = d.step()
    # Both long prompts advance in the same step, each by at most the cap.
    assert out.num_scheduled_tokens == {"dec": 1, "x": 5, "y": 5}
    d.run()
    d.flush()
    for step in d.steps:
        assert all(n <= 5 for n in step.num_scheduled_tokens.values())
    assert d.outputs["x"] == expected_outputs(list(range(100, 123)), 2)[0]
    assert_drained(d.sched)


def test_long_prefill_token_threshold_is_ignored_without_chunked_prefill():
    cfg = SchedulerConfig(num_gpu_blocks=64, block_size=4, long_prefill_token_threshold=5,
                          enable_chunked_prefill=False)
    d = Driver(cfg)
    d.add(make_request("x", list(range(23)), max_tokens=2))
    assert d.step().num_scheduled_tokens == {"x": 23}


def test_negative_long_prefill_token_threshold_is_refused():
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(num_gpu_blocks=16, long_prefill_token_threshold=-1)


def test_without_chunked_prefill_a_prompt_runs_whole():
    cfg = SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=20,
                          enable_chunked_prefill=False)
    d = Driver(cfg)
    d.add(make_request("a", [1] * 3, max_tokens=10, arrival=0))
    d.step()
    d.add(make_request("b", list(range(20)), max_tokens=2, arrival=1))
    out = d.step()  # a decodes (1 token), 19 left: b (20 tokens) must wait rather than be chunked
    assert out.num_scheduled_tokens == {"a": 1}
    d.run()
    assert all(n in (1, 20) for s in d.steps for r, n in s.num_scheduled_tokens.items() if r == "b")


# ---- step statistics: why requests stayed waiting -----------------------------------------------

def test_waiting_reason_seq_budget():
    d = Driver(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=64))
    d.add(*(make_request(f"r{i}", [1 + i, 2, 3], max_tokens=4, arrival=i) for i in range(5)))
    d.step()
    stats = d.sched.last_step
    assert stats.num_seqs == 2 and stats.waiting == 3 and stats.waiting_reason == "seq_budget"
    assert stats.waiting_reasons() == {"no_blocks": 0, "seq_budget": 3, "token_budget": 0}
    assert stats.prefill_tokens == 6 and stats.decode_tokens == 0 and stats.scheduled_tokens == 6
    d.step()
    stats = d.sched.last_step
    assert stats.decode_tokens == 2 and stats.prefill_tokens == 0 and stats.waiting_reason == "seq_budget"
    d.run()
    assert d.sched.last_step.waiting == 0 and d.sched.last_step.waiting_reasons()["seq_budget"] == 0


def test_waiting_reason_token_budget():
    # Chunked: the first prompt takes the whole budget, the others wait for tokens.
    d = Driver(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=8))
    d.add(*(make_request(f"r{i}", list(range(10 * i, 10 * i + 12)), max_tokens=2, arrival=i) for i in range(3)))
    d.step()
    stats = d.sched.last_step
    assert stats.scheduled_tokens == 8 and stats.prefill_tokens == 8
    assert stats.waiting == 2 and stats.waiting_reasons() == {"no_blocks": 0, "seq_budget": 0, "token_budget": 2}
    # Unchunked: a prompt that does not fit in what is left of the budget waits for a later step.
    d = Driver(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=16,
                               enable_chunked_prefill=False))
    d.add(make_request("a", list(range(10)), max_tokens=2, arrival=0),
          make_request("b", list(range(20, 30)), max_tokens=2, arrival=1))
    d.step()
    stats = d.sched.last_step
    assert stats.scheduled_tokens == 10 and stats.waiting == 1 and stats.waiting_reason == "token_budget"


def test_waiting_reason_no_blocks_and_preemptions():
    # 6 blocks of 4 tokens: three 8-token prompts fill them, the fourth cannot get blocks.
    d = Driver(SchedulerConfig(num_gpu_blocks=6, block_size=4, max_num_batched_tokens=64))
    d.add(*(make_request(f"r{i}", list(range(10 * i, 10 * i + 8)), max_tokens=12, arrival=i) for i in range(4)))
    d.step()
    stats = d.sched.last_step
    assert stats.waiting >= 1 and stats.waiting_reason == "no_blocks"
    assert stats.waiting_reasons()["no_blocks"] == stats.waiting
    pool = d.sched.block_manager.pool
    seen_preemption = False
    while d.sched.has_unfinished():
        d.step()
        stats = d.sched.last_step
        seen_preemption |= stats.preemptions > 0
        assert sum(stats.waiting_reasons().values()) == stats.waiting == len(d.sched.waiting)
        # The O(1) count of cached free blocks agrees with the pool.
        assert pool.num_cached_free == sum(1 for b in pool.cached.values() if b.ref_count == 0)
        assert pool.block_states().count("c") == pool.num_cached_free
        assert pool.block_states().count("u") == pool.num_blocks - pool.num_free
    assert seen_preemption and d.sched.num_preemptions > 0
    d.flush()
    assert_drained(d.sched)
    assert "u" not in pool.block_states()
