"""Gemma 3 on a tiny random model built here: greedy tokens equal transformers' Gemma3ForCausalLM
(plain, chunked prefill, preemption by recompute and by swap, two tensor-parallel ranks), with a
window of 8 tokens so every prompt but the shortest outlives it and local layers really drop keys.
The local layers' KV group frees the blocks that leave the window all along (KV groups: a long
prompt fits a pool that full attention could not hold; a prefix-cache hit serves a second request).
The sliding-window backend equals dense windowed attention on its own."""

from __future__ import annotations

import pytest
import torch

from pagedserve.common.sampling_params import SamplingParams
from tiny_models import build_tiny_model, hf_greedy, make_engine

MAX_NEW = 16
LENGTHS = [3, 9, 17, 28, 44, 60]
# layers * (K, V) * block size 16 * KV heads * head dim * float32: a block of full attention in
# every layer. With KV groups a block holds 2 layers (the 2 global ones, or the 2 local ones).
BLOCK_BYTES = 4 * 2 * 16 * 2 * 32 * 4
GROUP_BLOCK_BYTES = BLOCK_BYTES // 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def make_prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in LENGTHS]


PROMPTS = make_prompts()


def run(engine, prompts=PROMPTS):
    return [samples[0].token_ids for samples in engine.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp("gemma3"), "gemma3")
    return folder, hf_greedy(folder, PROMPTS, MAX_NEW)


def test_batch_matches_transformers(gemma):
    folder, expected = gemma
    engine = make_engine(folder)
    assert run(engine) == expected
    local = [layer.self_attn.backend for layer in engine.runner.model.layers]
    assert [b.window for b in local] == [8, 0, 8, 0]


def test_local_layers_form_a_sliding_group(gemma):
    from pagedserve.worker.kv_cache import bytes_per_block
    folder, _ = gemma
    engine = make_engine(folder)
    assert engine.runner.config.kv_groups().layers == ((1, 3), (0, 2))
    assert engine.scheduler.block_manager.windows == (0, 8)
    assert bytes_per_block(engine.runner.config, 16, torch.float32) == GROUP_BLOCK_BYTES
    assert engine.runner.kv.device_cache.shape[0] == 2  # layer slots, not layers


def test_a_long_prompt_fits_only_because_the_window_is_freed(gemma):
    folder, _ = gemma
    prompt = make_prompts(seed=3)[-1] * 5  # 300 tokens
    expected = hf_greedy(folder, [prompt], MAX_NEW)
    # 20 blocks of 16 in the global group, at most 4 in the local one (chunks of 32: 7 + 32
    # tokens), and the null block: 25 fit in 28. Full attention would need 20 of BLOCK_BYTES.
    memory = 28 * GROUP_BLOCK_BYTES
    assert memory < 20 * BLOCK_BYTES
    engine = make_engine(folder, kv_cache_memory=memory, max_num_batched_tokens=32)
    seen, tokens = [], []
    engine.add_request("long", prompt, GREEDY)
    bm = engine.scheduler.block_manager
    while engine.has_unfinished():
        for out in engine.step():
            tokens += [t.token_id for t in out.new_tokens]
        if "long" in bm.tables:  # (global blocks, local blocks) held after the step
            seen.append((len(bm.tables["long"]), bm.num_held_blocks("long") - len(bm.tables["long"])))
    assert [tokens] == expected
    assert max(full for full, _ in seen) == 20 and max(local for _, local in seen) <= 4
    assert seen[-1][1] <= 2  # decoding: the window's 8 tokens straddle at most 2 blocks of 16
    assert engine.stats()["num_preemptions"] == 0
    assert bm.num_free_blocks == bm.num_total_blocks


def test_prefix_cache_hits_on_a_sliding_model(gemma):
    folder, expected = gemma
    engine = make_engine(folder, max_num_batched_tokens=16)
    long = PROMPTS[-1]  # 60 tokens
    other = long[:50] + [7, 7, 7]
    assert run(engine, [long]) == [expected[-1]]
    hits = engine.stats()["prefix_cache_hits"]
    # 48 tokens hit: the global group's 3 blocks, and the local group's block 2 alone (blocks 0
    # and 1 lie wholly before the first computed token's window).
    assert run(engine, [other]) == hf_greedy(folder, [other], MAX_NEW)
    assert engine.stats()["prefix_cache_hits"] - hits == 48
    assert run(engine, [long]) == [expected[-1]]


def test_scheduler_and_worker_over_the_wire(gemma):
    # The services' path: the worker reports its KV groups, the scheduler's per-group deltas
    # cross as protobuf, and the worker's runner applies them.
    from pagedserve.common import wire
    from pagedserve.scheduler.core.request import Request
    from pagedserve.scheduler.core.scheduler import Scheduler, SchedulerConfig
    from pagedserve.v1 import worker_pb2
    from pagedserve.worker.server import WorkerService
    folder, expected = gemma
    worker = WorkerService(str(folder), device="cpu", dtype="float32", quantization="none")
    worker.load()
    sizes = worker.profile(worker_pb2.ProfileRequest(block_size=16, kv_cache_memory=str(24 * GROUP_BLOCK_BYTES),
                                                     max_num_batched_tokens=16))
    assert list(sizes.kv_group_windows) == [0, 8] and sizes.bytes_per_block == GROUP_BLOCK_BYTES
    worker.init_cache(worker_pb2.InitCacheRequest(num_gpu_blocks=sizes.num_gpu_blocks, block_size=16,
                                                  session_id="s"))
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=sizes.num_gpu_blocks, block_size=16, max_num_batched_tokens=16,
                                      max_model_len=512, kv_group_windows=tuple(sizes.kv_group_windows)))
    for i, prompt in enumerate(PROMPTS):
        sched.add_request(Request(f"r{i}", list(prompt), len(prompt), GREEDY, arrival_time=float(i)))
    outputs = {}
    while sched.has_unfinished():
        out = sched.schedule()
        result = wire.result_from_proto(worker.step(wire.step_to_proto(out, "s")))
        outputs.update({u.request.request_id: u.request.output_token_ids for u in sched.update(out, result)
                        if u.finished})
    assert [outputs[f"r{i}"] for i in range(len(PROMPTS))] == expected
    assert sched.num_preemptions > 0  # 24 blocks for six requests: preempted on the way


def test_window_changes_the_tokens(gemma, tmp_path):
    # The reference is not blind to the window: the same weights with a window wider than every
    # sequence give other tokens, so the match above depends on the window being applied.
    folder, expected = gemma
    wide = build_tiny_model(tmp_path, "gemma3", sliding_window=512)
    assert run(make_engine(wide)) != expected


def test_chunked_prefill_matches(gemma):
    folder, expected = gemma
    engine = make_engine(folder, max_num_batched_tokens=16)
    assert run(engine) == expected


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_matches(gemma, mode):
    folder, expected = gemma
    engine = make_engine(folder, kv_cache_memory=10 * BLOCK_BYTES, preemption_mode=mode,
                         swap_space=32 * BLOCK_BYTES, max_num_batched_tokens=24)
    assert run(engine) == expected
    assert engine.stats()["num_preemptions"] > 0
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks


def test_two_ranks_match(gemma):
    folder, expected = gemma
    with make_engine(folder, tensor_parallel_size=2, max_num_batched_tokens=16) as engine:
        assert run(engine) == expected


def dense_windowed(q, k, v, window, scale):
    """Causal attention with a window over one sequence, no cache: [T, H, D]."""
    n = q.shape[0]
    pos = torch.arange(n)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("windowed", [False, True], ids=["whole_table", "window_rows"])
@pytest.mark.parametrize("chunks", [[37], [5, 11, 1, 1, 19], [13, 1, 1, 1, 1, 1, 1, 1, 1]],
                         ids=["one_prefill", "chunks_then_decodes", "decodes"])
def test_sliding_window_backend_equals_dense(chunks, windowed):
    from pagedserve.worker.attention import AttentionMetadata, PrefillSeq
    from pagedserve.worker.torch_attention import SlidingWindowAttention

    torch.manual_seed(0)
    window, bs, n, heads, kv_heads, dim = 6, 4, sum(chunks), 4, 2, 8
    q, k, v = torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
    k_cache, v_cache = torch.zeros(16, bs, kv_heads, dim), torch.zeros(16, bs, kv_heads, dim)
    table = torch.randperm(16)[:-(-n // bs)]  # scattered blocks
    backend, out, done = SlidingWindowAttention(window), torch.empty(n, heads, dim), 0
    for size in chunks:
        rows = slice(done, done + size)
        slots = table[torch.arange(done, done + size) // bs] * bs + torch.arange(done, done + size) % bs
        if size == 1 and windowed:  # the runner's layout for a sliding KV group: rows from the window on
            first = max(0, done - window + 1) // bs
            keys = first * bs + torch.arange((done // bs + 1 - first) * bs)
            mask = torch.zeros(1, 1, 1, len(keys)).masked_fill((keys > done) | (keys <= done - window), float("-inf"))
            meta = AttentionMetadata(slots, 1, table[None, first:done // bs + 1], torch.tensor([done + 1]), mask, [],
                                     decode_windowed=True)
        elif size == 1:
            span = (done // bs + 1) * bs
            mask = torch.zeros(1, 1, 1, span).masked_fill(torch.arange(span) > done, float("-inf"))
            meta = AttentionMetadata(slots, 1, table[None, :done // bs + 1], torch.tensor([done + 1]), mask, [])
        else:
            meta = AttentionMetadata(slots, 0, None, None, None, [PrefillSeq(0, size, done, table)])
        out[rows] = backend.forward(q[rows], k[rows], v[rows], k_cache, v_cache, meta, 0.3)
        done += size
    torch.testing.assert_close(out, dense_windowed(q, k, v, window, 0.3))
