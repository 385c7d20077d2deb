"""Blocks shared between requests: prefix-cache hits (of a finished request, of a running one) and
the samples of n > 1, forked over the prompt's blocks with copy-on-write of the partial block."""

from __future__ import annotations

import pytest

from pagedserve.scheduler.core.scheduler import SchedulerConfig
from scheduler_driver import Driver, assert_drained, expected_outputs, make_request


# ---- prefix caching -----------------------------------------------------------------------------

@pytest.mark.parametrize("caching", [True, False])
def test_same_prompt_twice_hits_the_prefix_cache(caching):
    prompt = list(range(40, 80))  # 40 tokens = 10 full blocks of 4
    d = Driver(SchedulerConfig(num_gpu_blocks=32, block_size=4, enable_prefix_caching=caching))
    d.add(make_request("first", prompt, max_tokens=5, arrival=0))
    d.run()
    assert d.sched.block_manager.prefix_hits == 0
    d.add(make_request("second", prompt, max_tokens=5, arrival=1))
    req = d.sched.requests["second"]
    out = d.step()
    new = out.new_requests[0]
    if caching:
        # All blocks but the last, which holds the token whose logits are needed.
        assert req.num_cached_tokens == new.num_computed_tokens == 36
        assert out.num_scheduled_tokens["second"] == 4
        assert d.sched.block_manager.prefix_hits == 36 and d.sched.block_manager.prefix_queries == 80
    else:
        assert req.num_cached_tokens == new.num_computed_tokens == 0
        assert d.sched.block_manager.prefix_hits == 0
    d.run()
    d.flush()
    assert d.outputs["second"] == d.outputs["first"] == expected_outputs(prompt, 5)[0]
    assert d.worker.kv_errors == []
    assert_drained(d.sched)


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_a_request_that_ends_in_its_prefill_step_leaves_its_blocks_cached(max_tokens):
    """max_tokens 1 (lm-eval's loglikelihood requests) finishes in the prefill step, a prompt-only
    request (max_tokens 0) as soon as its prompt is computed: the full blocks that step wrote must
    still enter the prefix cache (they were freed uncached, so the same prompt hit 0 tokens)."""
    prompt = list(range(100, 179))  # 79 tokens: 19 full blocks of 4 and a partial one
    d = Driver(SchedulerConfig(num_gpu_blocks=64, block_size=4))
    d.add(make_request("first", prompt, max_tokens=max_tokens, arrival=0))
    d.run()
    assert d.sched.block_manager.prefix_hits == 0
    d.add(make_request("second", prompt, max_tokens=1, arrival=1))
    second = d.sched.requests["second"]
    d.step()
    assert second.num_cached_tokens == 76 and d.sched.block_manager.prefix_hits == 76
    d.run()
    d.flush()
    assert d.outputs["second"] == expected_outputs(prompt, 1)[0] and d.worker.kv_errors == []
    assert_drained(d.sched)


def test_prefix_shared_by_running_requests():
    prompt = list(range(16))
    d = Driver(SchedulerConfig(num_gpu_blocks=32, block_size=4))
    d.add(make_request("a", prompt + [1, 2], max_tokens=20, arrival=0))
    d.step()
    d.step()
    d.add(make_request("b", prompt + [3], max_tokens=3, arrival=1))
    out = d.step()
    assert out.new_requests[0].num_computed_tokens == 16
    bm = d.sched.block_manager
    assert bm.block_ids("a")[:4] == bm.block_ids("b")[:4]
    assert all(bm.pool.blocks[i].ref_count == 2 for i in bm.block_ids("b")[:4])
    d.run()
    d.flush()
    assert d.outputs["b"] == expected_outputs(prompt + [3], 3)[0] and d.worker.kv_errors == []


# ---- n > 1 ---------------------------------------------------------------------------------------

def test_n3_forks_sharing_the_prompt_and_copies_the_partial_block():
    prompt = list(range(10))  # blocks of 4: full, full, partial (2 tokens)
    d = Driver(SchedulerConfig(num_gpu_blocks=32, block_size=4))
    d.add(make_request("p", prompt, max_tokens=6, n=3))
    out = d.step()
    assert out.new_requests[0].child_req_ids == ["p#1", "p#2"]
    bm = d.sched.block_manager
    tables = [bm.block_ids(r) for r in ("p", "p#1", "p#2")]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 3
    assert [bm.pool.blocks[i].ref_count for i in tables[0]] == [3, 3, 3]
    partial = tables[0][2]
    out = d.step()
    assert out.num_scheduled_tokens == {"p": 1, "p#1": 1, "p#2": 1}
    # The first two writers copy the shared partial block; the last one then holds it alone.
    assert len(out.blocks_to_copy) == 2 and all(src == partial for src, _ in out.blocks_to_copy)
    assert bm.block_ids("p#2")[2] == partial
    dsts = {bm.block_ids("p")[2], bm.block_ids("p#1")[2]}
    assert {dst for _, dst in out.blocks_to_copy} == dsts and partial not in dsts
    replaced = {e.req_id: e.replaced_block for e in out.cached_requests}
    assert replaced["p"] == (2, bm.block_ids("p")[2]) and replaced["p#2"] is None
    assert [bm.pool.blocks[i].ref_count for i in tables[0][:2]] == [3, 3]
    d.run()
    d.flush()
    expected = expected_outputs(prompt, 6, 3)
    assert [d.outputs[r] for r in ("p", "p#1", "p#2")] == [expected[0], expected[1], expected[2]]
    assert len({tuple(o) for o in expected.values()}) == 3
    assert d.worker.kv_errors == []
    assert_drained(d.sched)


def test_n2_prompt_ending_on_a_block_boundary_needs_no_copy():
    prompt = list(range(8))
    d = Driver(SchedulerConfig(num_gpu_blocks=32, block_size=4))
    d.add(make_request("p", prompt, max_tokens=4, n=2))
    d.run()
    d.flush()
    assert not any(s.blocks_to_copy for s in d.steps)
    assert d.outputs == {"p": expected_outputs(prompt, 4, 2)[0], "p#1": expected_outputs(prompt, 4, 2)[1]}


def test_n_samples_that_finish_at_once():
    d = Driver(SchedulerConfig(num_gpu_blocks=32, block_size=4))
    d.add(make_request("p", [1, 2, 3], max_tokens=1, n=4))
    d.run()
    d.flush()
    expected = expected_outputs([1, 2, 3], 1, 4)
    assert d.outputs == {("p" if i == 0 else f"p#{i}"): o for i, o in expected.items()}
    assert_drained(d.sched)
