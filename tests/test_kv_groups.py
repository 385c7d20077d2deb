"""KV groups (sliding-window layers free the blocks that leave their window), without torch: the
grouping of a model's layers, the block manager's per-group tables (bounded sliding tables, the
pool's free count, prefix-cache hits per group, fork and swap), the scheduler end to end against
the fake worker (which reads every group's KV back, a sliding group inside its window), the
capacity a long request needs, and the step delta on the wire."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pagedserve.common.messages import CachedRequestData, NewRequestData, SchedulerOutput
from pagedserve.common.model_config import ModelConfig
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.wire import step_from_proto, step_to_proto
from pagedserve.scheduler.core.block_manager import BlockManager, cdiv
from pagedserve.scheduler.core.kv_groups import blocks_for_sequence
from pagedserve.scheduler.core.scheduler import Scheduler, SchedulerConfig
from scheduler_driver import Driver, assert_drained, make_request, make_requests, reference, run, workload
from test_scheduler_outputs import check_random_scenario, scenarios

GEMMA3_270M = dict(architectures=["Gemma3ForCausalLM"], vocab_size=262144, hidden_size=640, intermediate_size=2048,
                   num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                   sliding_window=512, sliding_window_pattern=6)


def test_gemma3_270m_layers_group_by_attention_kind():
    groups = ModelConfig.from_hf_dict(GEMMA3_270M).kv_groups()
    # 3 global + 15 local layers: gcd 3, so one full group and five sliding groups of 3 layers.
    assert groups.layers == ((5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16))
    assert groups.windows == (0, 512, 512, 512, 512, 512) and groups.num_slots == 3 and groups.hybrid
    assert sorted(groups.slot_of()) == list(range(18))


@pytest.mark.parametrize("cfg", [
    dict(architectures=["LlamaForCausalLM"], num_hidden_layers=4),
    dict(GEMMA3_270M, sliding_window=None),  # no window: nothing to free
    dict(GEMMA3_270M, layer_types=["full_attention"] * 18),
], ids=["llama", "gemma3-no-window", "gemma3-all-global"])
def test_models_without_sliding_layers_have_one_group(cfg):
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    groups = ModelConfig.from_hf_dict({**base, **cfg}).kv_groups()
    n = cfg["num_hidden_layers"]
    assert groups.layers == (tuple(range(n)),) and groups.windows == (0,) and not groups.hybrid


# ---- the block manager ----------------------------------------------------------------------------

def held(bm: BlockManager, seq_id: str) -> list[int]:
    """Real blocks per group."""
    return [sum(b is not bm.null_block for b in tables[seq_id]) for tables in bm.group_tables]


@pytest.mark.parametrize("window, bs", [(8, 4), (9, 4), (5, 2), (16, 16)])
def test_a_long_sequence_holds_a_window_of_blocks_per_sliding_group(window, bs):
    bm = BlockManager(200, bs, windows=(0, window, window))
    assert bm.null_block.block_id == 0 and bm.num_total_blocks == 199 == bm.num_free_blocks
    tokens = list(range(400))
    done, chunk = 0, 10
    while done < 300:  # the prompt in chunks, then decodes
        n = chunk if done < 200 else 1
        assert bm.allocate("s", done, n) is not None
        full, *sliding = held(bm, "s")
        assert full == cdiv(done + n, bs) == len(bm.tables["s"])
        # the blocks from the one holding done - W + 1 to the end of this step's tokens
        assert all(h == (done + n - 1) // bs - max(0, done - window + 1) // bs + 1 for h in sliding)
        assert all(h <= cdiv(window - 1 + n, bs) + 1 for h in sliding)
        assert bm.num_free_blocks == 199 - full - sum(sliding)
        bm.cache_full_blocks("s", tokens, done + n)
        done += n
    assert all(h <= cdiv(window, bs) + 1 for h in held(bm, "s")[1:])
    bm.free("s")
    assert bm.num_free_blocks == 199 and all(b.ref_count == 0 for b in bm.pool.blocks[1:])


def test_one_group_is_exactly_the_plain_manager():
    bm = BlockManager(16, 4)
    assert bm.null_block is None and bm.num_total_blocks == 16 and bm.group_tables == [bm.tables]
    assert bm.allocate("a", 0, 9).new_block_ids == [[0, 1, 2]] and bm.group_block_ids("a") == []


def run_prefill(bm: BlockManager, seq_id: str, tokens: list[int], chunk: int = 8) -> None:
    hits = bm.find_cached_prefix(seq_id, tokens)
    done = len(hits) * bm.block_size
    first = True
    while done < len(tokens):
        n = min(chunk, len(tokens) - done)
        assert bm.allocate(seq_id, done, n, hits if first else ()) is not None
        first = False
        done += n
        bm.cache_full_blocks(seq_id, tokens, done)


def test_prefix_hit_keeps_only_the_window_in_sliding_groups():
    bm = BlockManager(64, 4, windows=(0, 8))
    prompt = list(range(100, 140))  # 10 blocks
    run_prefill(bm, "a", prompt)
    a_full, a_sliding = list(bm.tables["a"]), list(bm.group_tables[1]["a"])
    assert a_sliding[:6] == [bm.null_block] * 6 and a_sliding[6] is not bm.null_block  # dropped as it went
    bm.free("a")
    hits = bm.find_cached_prefix("b", prompt[:36] + [1, 2, 3])
    assert hits == a_full[:9]
    alloc = bm.allocate("b", 36, 3, hits)
    # the first token to compute (position 36) sees 29..36: blocks 7 and 8 from the cache
    table = bm.group_tables[1]["b"]
    assert table[:7] == [bm.null_block] * 7 and table[7].block_hash is not None and table[8].block_hash is not None
    assert alloc.new_block_ids[1][:7] == [0] * 7 and len(alloc.new_block_ids[1]) == 10
    assert all(b.ref_count == 1 for b in table[7:])
    # The dropped sliding blocks of a were freed with their hashes: the pool holds b's blocks only.
    assert bm.num_free_blocks == 63 - 10 - 3


def test_a_sliding_group_shortens_the_hit_when_its_window_blocks_are_gone():
    bm = BlockManager(40, 4, windows=(0, 8))
    prompt = list(range(100, 140))
    run_prefill(bm, "a", prompt)  # a stays: its full blocks and its last sliding blocks are live
    # A second sequence takes every free block: the dropped, cached sliding blocks are evicted.
    assert bm.allocate("x", 0, 4 * (bm.num_free_blocks // 2)) is not None
    assert len(bm.find_cached_prefix("b", prompt + [7])) == 10  # hit at 40: blocks 8, 9 are a's live ones
    # A hit at 24 needs sliding blocks 4 and 5, evicted: no block 0..5 window survives, no hit.
    assert bm.find_cached_prefix("c", prompt[:24] + [7]) == []


def test_fork_and_copy_on_write_per_group():
    bm = BlockManager(32, 4, windows=(0, 4))
    run_prefill(bm, "p", list(range(22)))  # 6 blocks, position 21 in block 5
    bm.fork("p", "c")
    assert held(bm, "c") == held(bm, "p") == [6, 3]
    alloc = bm.allocate("c", 22, 1)
    assert [(g, i) for g, i, _, _ in alloc.replaced] == [(0, 5), (1, 5)]
    for tables in bm.group_tables:
        assert tables["c"][5] is not tables["p"][5] and tables["p"][5].ref_count == 1
    bm.free("p")
    bm.free("c")
    assert bm.num_free_blocks == bm.num_total_blocks


def test_swap_keeps_null_entries_null():
    bm = BlockManager(32, 4, num_cpu_blocks=16, windows=(0, 4))
    run_prefill(bm, "a", list(range(30)))
    before = held(bm, "a")
    assert bm.can_swap_out("a")
    out = bm.swap_out("a")
    assert len(out) == sum(before) and bm.cpu_pool.num_free == 16 - sum(before)
    assert bm.num_free_blocks == bm.num_total_blocks
    assert bm.can_swap_in("a", 1)
    back = bm.swap_in("a")
    assert len(back) == sum(before) and held(bm, "a") == before
    assert bm.group_tables[1]["a"][0] is bm.null_block


# ---- the scheduler against the fake worker --------------------------------------------------------

TINY = 30  # the longest sequence (36 tokens, 9 blocks of 4) in all three groups, unchunked

CONFIGS = [
    pytest.param("huge", dict(num_gpu_blocks=1000)),
    pytest.param("huge-no-chunking", dict(num_gpu_blocks=1000, enable_chunked_prefill=False)),
    pytest.param("huge-small-budget", dict(num_gpu_blocks=1000, max_num_batched_tokens=7)),
    pytest.param("huge-prefill-cap", dict(num_gpu_blocks=1000, long_prefill_token_threshold=5)),
    pytest.param("tiny-recompute", dict(num_gpu_blocks=TINY)),
    pytest.param("tiny-recompute-no-prefix-cache", dict(num_gpu_blocks=TINY, enable_prefix_caching=False)),
    pytest.param("tiny-recompute-small-budget", dict(num_gpu_blocks=TINY, max_num_batched_tokens=7)),
    pytest.param("tiny-swap", dict(num_gpu_blocks=TINY, preemption_mode="swap", num_cpu_blocks=200)),
    pytest.param("tiny-swap-prefill-cap", dict(num_gpu_blocks=TINY, preemption_mode="swap", num_cpu_blocks=200,
                                               long_prefill_token_threshold=3)),
    pytest.param("tiny-swap-small-host", dict(num_gpu_blocks=TINY, preemption_mode="swap", num_cpu_blocks=8)),
]


@pytest.mark.parametrize("windows", [(0, 6, 6), (0, 5, 0, 5)], ids=["full+2x6", "2full+2x5"])
@pytest.mark.parametrize("name, overrides", CONFIGS)
def test_outputs_and_kv_with_sliding_groups(name, overrides, windows):
    work = workload()
    cfg = SchedulerConfig(block_size=4, max_model_len=256, kv_group_windows=windows, **overrides)
    if name.startswith("tiny") and len(windows) == 4:
        cfg.num_gpu_blocks = 40
    dropped = []

    def note_drops(drv, out):  # a sliding group holding fewer blocks than the full one
        bm = drv.sched.block_manager
        dropped.extend(r.request_id for r in drv.sched.running
                       if held(bm, r.request_id)[-1] < len(bm.tables[r.request_id]))

    res = run(cfg, make_requests(work), on_step=note_drops)
    assert dropped, "no sliding group ever dropped a block"
    assert res.outputs == reference(work)
    assert res.worker.kv_errors == []
    assert_drained(res.sched)
    assert (res.num_preemptions > 0) == name.startswith("tiny")
    if name.startswith("huge"):
        assert any(s.blocks_to_copy for s in res.steps), "the n>1 requests never copied a block on write"
    if "swap" in name and "small-host" not in name:
        assert any(s.blocks_to_swap_out for s in res.steps) and any(s.blocks_to_swap_in for s in res.steps)


@st.composite
def grouped_scenarios(draw):
    """test_scheduler_outputs' random workloads and configs, over KV groups (windows down to 1)."""
    work, cfg, aborts = draw(scenarios())
    windows = draw(st.sampled_from([(0, 1), (0, 3), (0, 5, 5), (0, 2, 0, 7)]))
    return work, dict(cfg, kv_group_windows=windows, num_gpu_blocks=cfg["num_gpu_blocks"] * len(windows) + 1), aborts


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grouped_scenarios())
def test_random_workloads_with_sliding_groups(scenario):
    check_random_scenario(scenario)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grouped_scenarios())
def test_random_workloads_with_sliding_groups_and_async_scheduling(scenario):
    check_random_scenario(scenario, ahead=True)


def test_a_long_request_needs_far_fewer_blocks():
    # Gemma 3's shape: one full group, five sliding ones. 220 tokens of blocks of 4 in chunks of 8.
    windows, bs = (0, 8, 8, 8, 8, 8), 4
    need = blocks_for_sequence(windows, bs, 221, 8)
    assert need == 56 + 5 * (cdiv(7 + 8, 4) + 1) < 6 * 56
    cfg = SchedulerConfig(num_gpu_blocks=need + 1, block_size=bs, max_model_len=512, max_num_batched_tokens=8,
                          kv_group_windows=windows)
    d = Driver(cfg)
    prompt = [(i * 7) % 97 for i in range(200)]
    d.add(make_request("long", prompt, max_tokens=20))
    peak = []
    d.run(on_step=lambda drv, out: peak.append(drv.sched.block_manager.num_total_blocks
                                               - drv.sched.block_manager.num_free_blocks))
    assert d.outputs == reference([("long", prompt, 20, 1)])
    assert d.worker.kv_errors == [] and d.sched.num_preemptions == 0 and max(peak) <= need
    # Full attention in every layer: the same memory is need / 6 blocks of six layers, too few.
    with pytest.raises(ValueError, match="KV blocks"):
        Scheduler(SchedulerConfig(num_gpu_blocks=(need + 1) // 6, block_size=bs, max_model_len=512,
                                  max_num_batched_tokens=8)).check_prompt(len(prompt))


# ---- the wire ---------------------------------------------------------------------------------------

def test_group_tables_cross_the_wire():
    params = SamplingParams(max_tokens=3)
    step = SchedulerOutput(
        7, [NewRequestData("a", [1, 2, 3], 3, params, [4, 5], 0, group_block_ids=[[0, 6], [0, 7]])],
        [CachedRequestData("b", [8], (1, 9), group_new_block_ids=[[10], [11]], group_replaced=[(2, 1, 12)]),
         CachedRequestData("c", [13], block_ids=[14, 13], group_new_block_ids=[[15], [16]],
                           group_block_ids=[[0, 15], [0, 16]]),
         CachedRequestData("d", [17])],
        {"a": 3, "b": 1, "c": 1, "d": 1})
    back = step_from_proto(step_to_proto(step))
    assert back.new_requests[0].group_block_ids == [[0, 6], [0, 7]]
    assert back.cached_requests[0] == step.cached_requests[0]
    assert back.cached_requests[1] == step.cached_requests[1]
    assert back.cached_requests[2] == CachedRequestData("d", [17])


# ---- what it saves: Gemma 3 270M ---------------------------------------------------------------------

def gemma3_270m_kv_bytes(num_tokens: int, chunk: int = 128, bs: int = 16, elem: int = 4) -> tuple[int, int]:
    """(bytes held once the request has num_tokens, the peak while its prompt prefilled) for one
    request of num_tokens - 16 prompt tokens prefilled in chunks of `chunk` (the CPU default:
    long_prefill_token_threshold 128), then decoded, counted from the block manager's tables."""
    cfg = ModelConfig.from_hf_dict(GEMMA3_270M)
    groups, layout = cfg.kv_groups(), cfg.kv_layout()
    block_bytes = groups.num_slots * bs * layout.num_planes * layout.num_heads * layout.head_dim * elem
    bm = BlockManager(100_000, bs, enable_prefix_caching=False, windows=groups.windows)
    done, peak, prompt = 0, 0, num_tokens - 16
    while done < num_tokens:
        step = min(chunk, prompt - done) if done < prompt else 1
        assert bm.allocate("r", done, step) is not None
        peak = max(peak, bm.num_held_blocks("r"))
        done += step
    return bm.num_held_blocks("r") * block_bytes, peak * block_bytes


def test_gemma3_270m_kv_bytes_per_token():
    # Full attention: 18 layers x (K, V) x 256 x float32 = 36,864 bytes per token.
    full = 18 * 2 * 256 * 4
    measured = {n: gemma3_270m_kv_bytes(n) for n in (1024, 4096, 32768)}
    # docs/sliding_window.md's table: the 3 global layers keep every token (6,144 B/token), the 15
    # local ones 32 blocks of 16 each once the window is full (33 while it straddles 33 blocks).
    assert measured == {1024: (22_020_096, 25_362_432), 4096: (40_894_464, 44_236_800),
                        32768: (217_055_232, 220_397_568)}
    assert [round(n * full / held, 2) for n, (held, _) in measured.items()] == [1.71, 3.69, 5.57]
