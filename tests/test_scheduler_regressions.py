"""Scheduler bugs found and fixed, kept as tests (two BUG_* texts say what went wrong): max_num_seqs
with samples not yet forked, a partially computed block in the prefix cache, a copy-on-write block
swapped out before it was written, and requests that could hang the scheduler."""

from __future__ import annotations

import pytest

from pagedserve.scheduler.core.scheduler import SchedulerConfig
from scheduler_driver import Driver, expected_outputs, make_request


BUG_PARTIAL_BLOCK_CACHED = (
    "BUG: a prefill chunk that ends inside a block gets that block entered in the prefix cache "
    "(BlockManager.cache_full_blocks uses the hashes find_cached_prefix pre-computed for the whole "
    "prompt); once the request is aborted or preempted, a later request with the same prompt reuses "
    "the half-written block and skips computing the rest of it")

BUG_SEQS_PENDING_FORKS = (
    "BUG: max_num_seqs is exceeded: Scheduler._num_seqs_after() counts the samples still to fork of "
    "the request being admitted, but not those of n>1 requests already running that have not "
    "forked yet, so several n>1 requests are admitted together and fork past the limit")


# ---- known bugs ---------------------------------------------------------------------------------


def test_max_num_seqs_counts_samples_not_yet_forked():
    d = Driver(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_seqs=3))
    d.add(make_request("p", [1, 2, 3, 4], n=3, arrival=0), make_request("q", [5, 6, 7, 8], arrival=1))
    d.step()  # both admitted: p counts 3, q 1 -> 4 sequences after p forks
    assert len(d.sched.running) <= 3



def test_prefix_cache_never_serves_a_partially_computed_block():
    prompt = list(range(12))
    d = Driver(SchedulerConfig(num_gpu_blocks=16, block_size=4, max_num_batched_tokens=6))
    d.add(make_request("a", prompt))
    d.step()  # positions 0..5: block 1 holds only 4 and 5
    d.sched.abort("a")
    d.add(make_request("b", prompt, max_tokens=3))
    out = d.step()
    assert out.new_requests[0].num_computed_tokens <= 4
    d.run()
    assert d.worker.kv_errors == []


def test_swap_preemption_keeps_a_copy_on_write_made_earlier_in_the_step():
    cfg = SchedulerConfig(num_gpu_blocks=9, block_size=4, max_num_batched_tokens=12, preemption_mode="swap",
                          num_cpu_blocks=32, policy="priority")
    d = Driver(cfg)
    prompt = list(range(1, 15))  # 14 tokens: the last block holds 2
    d.add(make_request("p", prompt, max_tokens=4, n=3, priority=1, arrival=0))
    d.step()  # 12 of 14 prompt tokens
    d.add(make_request("A", list(range(100, 130)), max_tokens=4, priority=0, arrival=1))
    d.step()  # p finishes its prompt and forks; A starts a prefill chunk
    d.step()  # p and p#1 copy the shared block, then A's chunk preempts p#2 and p#1
    # p#1's fresh copy-on-write block is still empty: it must be recomputed, not swapped.
    assert "p#1" not in {r.request_id for r in d.sched.swapped}
    assert d.sched.num_preemptions >= 2
    d.run()
    expected = expected_outputs(prompt, 4, 3)
    assert d.outputs["p#1"] == expected[1]
    assert d.worker.kv_errors == []


def _finishes_or_is_refused(cfg: SchedulerConfig, requests, max_steps=300):
    d = Driver(cfg)
    try:
        d.add(*requests)
    except ValueError:
        return  # refused up front: fine
    for _ in range(max_steps):
        if not d.sched.has_unfinished():
            return
        d.step()
    stuck = [(r.request_id, r.status.value, r.num_tokens) for r in d.sched.waiting + d.sched.running]
    pytest.fail(f"still unfinished after {max_steps} steps: {stuck}")


def test_request_outgrowing_the_whole_pool_does_not_hang():
    cfg = SchedulerConfig(num_gpu_blocks=4, block_size=4)
    _finishes_or_is_refused(cfg, [make_request("x", list(range(10)), max_tokens=20, arrival=0),
                                  make_request("y", [1], max_tokens=1, arrival=1)])


def test_recompute_without_chunked_prefill_does_not_hang():
    cfg = SchedulerConfig(num_gpu_blocks=6, block_size=4, max_num_batched_tokens=9,
                          enable_chunked_prefill=False, enable_prefix_caching=False)
    _finishes_or_is_refused(cfg, [make_request("a", list(range(8)), max_tokens=10, arrival=0),
                                  make_request("b", list(range(20, 28)), max_tokens=10, arrival=1)])


def test_prompt_filling_the_whole_pool_does_not_hang():
    cfg = SchedulerConfig(num_gpu_blocks=100, block_size=4)
    _finishes_or_is_refused(cfg, [make_request("w", list(range(399)), max_tokens=1)])
