"""Mixed-step graphs (pagedserve/worker/graph_runner.py's MixedGraphRunner, issue 37): steps with prefill chunks,
decodes beside them or not, replayed from graphs captured per token size, laid out packed and padded
(input_batch.layout_graph_mixed). On the CPU the Triton attention backend (what CUDA runs, and the one that says
GraphSupport.MIXED) runs under the Triton interpreter, and the stand-in graph replays by running the captured
function on the same static buffers: the same buckets, padding, static buffers and re-capture as on a GPU.
Greedy tokens with mixed graphs equal transformers' (float32) and the eager engine's, and the KV cache ends as
it does eagerly (a padding token writes nothing)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from triton_device import triton_device, triton_engine

DEVICE = triton_device()  # before anything imports triton.language

from pagedserve.common.sampling_params import SamplingParams  # noqa: E402
from pagedserve.common.compilation import graph_plan, mixed_capture_sizes  # noqa: E402
from pagedserve.worker.graph_runner import StandInGraph, bucket_for  # noqa: E402
from pagedserve.worker.input_batch import InputBatch, padding_runs  # noqa: E402
from tiny_models import build_tiny_model, hf_greedy, make_engine  # noqa: E402

BUDGET = 48  # tokens a step: prompts go in chunks beside running decodes


def test_mixed_capture_sizes():
    assert mixed_capture_sizes(16) == [16]
    assert mixed_capture_sizes(40) == [16, 32, 40]
    sizes = mixed_capture_sizes(2048)
    assert sizes[:3] == [16, 32, 48] and sizes[15:18] == [256, 320, 384] and sizes[-3:] == [1792, 1920, 2048]
    assert len(sizes) == 16 + 12 + 8
    assert all(b - a <= max(16, a // 4) for a, b in zip(sizes, sizes[1:]))  # padding stays a small share
    assert [bucket_for(t, sizes) for t in (1, 16, 17, 257, 1025, 2048)] == [16, 16, 32, 320, 1152, 2048]
    with pytest.raises(ValueError, match="max_tokens"):
        mixed_capture_sizes(0)


def test_padding_runs():
    assert padding_runs(0, 3, 64) == []
    assert padding_runs(10, 1, 64) == [10]
    assert padding_runs(130, 3, 64) == [64, 64, 2]
    assert padding_runs(130, 2, 64) is None  # no room: the step runs eagerly
    assert padding_runs(5, 0, 64) is None


def _states(block_size: int, lengths: list[tuple[int, int]], seed: int):
    rng = np.random.default_rng(seed)
    out = []
    for context, new in lengths:
        blocks = rng.permutation(200)[:-(-(context + new) // block_size)].tolist()
        out.append((SimpleNamespace(num_computed_tokens=context, token_ids=list(range(100, 100 + context + new)),
                                    spec_token_ids=[], block_ids=blocks, group_block_ids=[]), new))
    return out


def test_a_mixed_step_is_laid_out_packed_at_fixed_places():
    """layout_graph_mixed: the step's tokens, slots, lengths, query starts and tables equal the eager layout's
    (as the Triton kernels read them: attention.kernel_metadata), then padding tokens that write nothing
    (slot -1) in sequences of their own, then sequences with no query; every tensor a view of mixed_region."""
    from pagedserve.common.model_config import KVGroups
    from pagedserve.worker.attention import kernel_metadata
    from pagedserve.worker.input_batch import layout_graph_mixed, layout_step, mixed_region

    bs, tokens, seqs, width = 4, 64, 6, 8
    decodes = _states(bs, [(9, 1), (22, 1)], 1)
    prefills = _states(bs, [(3, 6), (0, 5)], 2)
    num_tokens = 2 + 6 + 5
    batch = InputBatch(torch.device("cpu"))
    ids, positions, meta = layout_graph_mixed(batch, decodes, prefills, num_tokens, 16, tokens, seqs, width, bs)
    region = mixed_region(batch, tokens, seqs, width)
    assert [t.data_ptr() for t in (ids, positions, meta.slot_mapping)] == [t.data_ptr() for t in region[:3]]
    packed = meta.packed
    assert [t.data_ptr() for t in (packed.seq_lens, packed.query_start_loc, packed.block_tables)] == \
        [t.data_ptr() for t in region[3:]]
    assert meta.num_decodes == 0 and meta.prefills == [] and ids.shape == positions.shape == (16,)

    eager_ids, eager_pos, (eager,) = layout_step(InputBatch(torch.device("cpu")), decodes, prefills, num_tokens,
                                                 KVGroups(((0,),), (0,)), bs)
    assert torch.equal(ids[:num_tokens], eager_ids) and torch.equal(positions[:num_tokens], eager_pos)
    assert torch.equal(meta.slot_mapping[:num_tokens], eager.slot_mapping)
    assert meta.slot_mapping[num_tokens:].tolist() == [-1] * 3 and ids[num_tokens:].tolist() == [0] * 3
    tables, lens, starts = kernel_metadata(meta, bs, batch.device)
    want_tables, want_lens, want_starts = kernel_metadata(eager, bs, batch.device)
    assert lens.tolist() == want_lens.tolist() + [3, 0]  # the padding sequence, then a row with no query
    assert starts.tolist() == want_starts.tolist() + [16, 16]
    for row in range(4):
        used = -(-int(want_lens[row]) // bs)
        assert torch.equal(tables[row, :used], want_tables[row, :used])
    assert tables[4].tolist() == [0] * width  # the padding sequence reads block 0 (and writes nothing)

    # a table wider than the region's, too many sequences, or more tokens than the region: no graph layout
    assert layout_graph_mixed(batch, decodes, _states(bs, [(40, 3)], 3), 5, 16, tokens, seqs, width, bs) is None
    assert layout_graph_mixed(batch, decodes * 3, [], 6, 16, tokens, seqs, width, bs) is None
    assert layout_graph_mixed(batch, decodes, prefills, num_tokens, 80, tokens, seqs, width, bs) is None


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in (70, 9, 33, 5)]
    lengths = [5, 12, 7, 9]
    expected = [hf_greedy(folder, [p], n)[0] for p, n in zip(prompts, lengths)]
    return folder, prompts, lengths, expected


def generate(engine, prompts, lengths):
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    return [samples[0].token_ids for samples in engine.generate(prompts, params)]


def test_greedy_tokens_with_mixed_graphs_equal_transformers_and_eager(model):
    """Mixed steps (a 70-token prompt in chunks beside running decodes) replay the graph of their token size,
    whose inputs are views of the input batch's buffer; the KV cache ends as the eager engine's."""
    folder, prompts, lengths, expected = model
    engine = triton_engine(folder, DEVICE, BUDGET)
    runner = engine.runner
    prepare, mixed_steps = runner._prepare, []

    def recording(step):
        out = prepare(step)
        if runner._mixed_size is not None:
            mixed_steps.append((runner._mixed_size, len(out[3]), step.total_num_scheduled_tokens))
        return out

    runner._prepare = recording
    assert generate(engine, prompts, lengths) == expected
    graphs = runner.mixed_graphs
    assert mixed_steps and any(n > 1 for _, n, _ in mixed_steps)  # sequences beside one another
    assert all(size == bucket_for(t, graphs.sizes) for size, _, t in mixed_steps)
    assert sorted(graphs.graphs) == sorted({size for size, _, _ in mixed_steps})
    assert sum(g.replays for g in graphs.graphs.values()) == len(mixed_steps) - len(graphs.graphs)
    buffer = runner.input_batch._device.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == buffer for t in graphs.captured.inputs)

    eager = triton_engine(folder, DEVICE, BUDGET, graphs=False)
    assert generate(eager, prompts, lengths) == expected
    assert torch.allclose(eager.runner.kv.device_cache, runner.kv.device_cache, atol=1e-5)  # (GPU: other M tiles)


def test_graphs_captured_ahead_replay_every_step(model):
    """capture_graphs (what CUDA does once the cache is allocated) captures every size over idle steps that
    write nothing but block 0's slot 0 (decode graphs), the largest step first (the mixed graphs' largest
    size, then down: the smaller graphs reuse its memory in the one pool); the steps after only replay."""
    folder, prompts, lengths, expected = model
    engine = triton_engine(folder, DEVICE, BUDGET, graphs=False, enable_prefix_caching=False)
    runner = engine.runner
    runner.input_batch = InputBatch(runner.device, capacity=64)  # grows for each region: once, before capturing
    order = []

    class Recording(StandInGraph):
        def capture(self, fn):
            out = super().capture(fn)
            order.append(out.shape[0])
            return out
    runner.enable_decode_graphs(4, Recording, BUDGET)
    assert runner.input_batch.capacity < runner.decode_graphs.region_size < runner.mixed_graphs.region_size
    runner.capture_graphs()
    assert runner.input_batch.allocations == 2
    mixed, decode = runner.mixed_graphs, runner.decode_graphs
    assert sorted(mixed.graphs) == mixed.sizes == [16, 32, 48] and sorted(decode.graphs) == decode.sizes
    assert order == [48, 32, 16, *sorted(decode.sizes, reverse=True)]
    captured = {size: graph for size, graph in mixed.graphs.items()}
    assert generate(engine, prompts, lengths) == expected
    assert mixed.graphs == captured and sum(g.replays for g in captured.values()) > 0


def test_steps_past_the_largest_size_run_eagerly(model):
    folder, prompts, lengths, expected = model
    engine = triton_engine(folder, DEVICE, BUDGET, graphs=False)
    engine.runner.enable_decode_graphs(4, StandInGraph, 16)  # sizes [16]: larger mixed steps run eagerly
    assert generate(engine, prompts, lengths) == expected
    assert sorted(engine.runner.mixed_graphs.graphs) == [16]


def test_the_configured_capture_sizes_are_the_mixed_steps_token_sizes(model):
    """vLLM's cudagraph_capture_sizes are token counts for these steps: a step pads to the next of them, one
    past the token budget is the budget, a step past every size runs eagerly."""
    folder, prompts, lengths, expected = model
    engine = triton_engine(folder, DEVICE, BUDGET, graphs=False)
    engine.runner.enable_decode_graphs(4, StandInGraph, BUDGET,
                                       graph_plan('{"cudagraph_capture_sizes": [1, 2, 4, 24, 4096]}'))
    assert generate(engine, prompts, lengths) == expected
    mixed = engine.runner.mixed_graphs
    assert mixed.sizes == [1, 2, 4, 24, BUDGET] and mixed.graphs and set(mixed.graphs) <= set(mixed.sizes)
    assert sorted(engine.runner.decode_graphs.graphs) <= [1, 2, 4]


def test_reallocated_cache_recaptures_mixed_graphs(model):
    folder, prompts, lengths, expected = model
    engine = triton_engine(folder, DEVICE, BUDGET, enable_prefix_caching=False)
    assert generate(engine, prompts[:2], lengths[:2]) == expected[:2]
    graphs = engine.runner.mixed_graphs
    assert graphs.graphs
    engine.runner.allocate_kv_cache(engine.runner.kv.num_blocks)
    assert not graphs.graphs
    assert generate(engine, prompts[:2], lengths[:2]) == expected[:2]
    assert graphs.graphs


class FailingGraph(StandInGraph):
    def capture(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_mixed_capture_runs_the_packed_step_eagerly(model, caplog):
    folder, prompts, lengths, expected = model
    engine = triton_engine(folder, DEVICE, BUDGET, graphs=False)
    engine.runner.enable_decode_graphs(4, FailingGraph, BUDGET)
    assert generate(engine, prompts, lengths) == expected
    assert engine.runner.mixed_graphs is None and engine.runner.decode_graphs is None
    assert "mixed steps run eagerly from now on" in caplog.text


def test_who_gets_mixed_graphs(model, monkeypatch):
    """Only where every attention backend says MIXED (the CPU's torch backend says PURE_DECODE) and the model
    reads no layout on the host; without a token budget, decode graphs alone."""
    folder = model[0]
    cpu = make_engine(folder, device="cpu", max_num_seqs=4)
    cpu.runner.enable_decode_graphs(4, StandInGraph, BUDGET)
    assert cpu.runner.decode_graphs is not None and cpu.runner.mixed_graphs is None
    engine = triton_engine(folder, DEVICE, BUDGET, graphs=False)
    engine.runner.enable_decode_graphs(4, StandInGraph)
    assert engine.runner.mixed_graphs is None
    monkeypatch.setattr(type(engine.runner.model), "reads_layout_on_host", True)
    engine.runner.enable_decode_graphs(4, StandInGraph, BUDGET)
    assert engine.runner.decode_graphs is not None and engine.runner.mixed_graphs is None


def test_the_padding_writes_no_slot(model):
    """A packed step's padding tokens (slot -1) leave the cache as it was: the Triton KV write skips them."""
    from pagedserve.kernels.triton.fused_ops import write_kv_cache
    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(5, 2, 8, generator=gen).to(DEVICE) for _ in range(2))
    k_cache, v_cache = (torch.zeros(4, 4, 2, 8, device=DEVICE) for _ in range(2))
    write_kv_cache(key, value, k_cache, v_cache, torch.tensor([5, 6, -1, -1, 0], device=DEVICE))
    flat = k_cache.view(-1, 2, 8)
    assert torch.equal(flat[5], key[0]) and torch.equal(flat[0], key[4])
    assert int((flat.abs().sum((1, 2)) > 0).sum()) == 3


def test_prefill_attention_over_a_packed_step_equals_the_eager_one(model):
    """The Triton backend on a packed, padded step (rows with no query, a padding sequence) gives the eager
    layout's attention for the step's own tokens."""
    from pagedserve.common.model_config import KVGroups
    from pagedserve.worker.attention import TritonAttentionBackend
    from pagedserve.worker.input_batch import layout_graph_mixed, layout_step

    bs, heads, kv_heads, dim = 4, 4, 2, 16
    decodes = _states(bs, [(9, 1), (22, 1)], 1)
    prefills = _states(bs, [(3, 6), (0, 5)], 2)
    num_tokens = 13
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(32, h, dim, generator=gen).to(DEVICE) for h in (heads, kv_heads, kv_heads))
    caches = [tuple(torch.randn(200, bs, kv_heads, dim, generator=torch.Generator().manual_seed(4)).to(DEVICE)
                    for _ in range(2)) for _ in range(2)]
    _, _, (eager,) = layout_step(InputBatch(torch.device(DEVICE)), decodes, prefills, num_tokens,
                                 KVGroups(((0,),), (0,)), bs)
    want = TritonAttentionBackend().forward(q[:num_tokens], k[:num_tokens], v[:num_tokens], *caches[0], eager, 0.25)
    _, _, packed = layout_graph_mixed(InputBatch(torch.device(DEVICE)), decodes, prefills, num_tokens, 32, 32, 6,
                                      12, bs)
    got = TritonAttentionBackend().forward(q, k, v, *caches[1], packed, 0.25)
    assert torch.allclose(got[:num_tokens], want, atol=1e-5)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert torch.isfinite(got).all()  # the padding tokens' rows too
    assert dataclasses.is_dataclass(packed.packed)


def test_held_rows_feed_a_mixed_graphs_step(model):
    """Async scheduling: a mixed step begun while the one before is in flight takes its decode rows' tokens
    from that step's sampled ids on the device, written into the graph's packed inputs (decodes first)."""
    folder, prompts, lengths, expected = model
    engine = triton_engine(folder, DEVICE, BUDGET, async_scheduling=True)
    assert engine.overlaps
    runner = engine.runner
    prepare, held_mixed = runner._prepare, []

    def recording(step):
        out = prepare(step)
        if runner._mixed_size is not None:
            held_mixed.append(any(s.held_at >= 0 for s in out[3]))
        return out

    runner._prepare = recording
    assert generate(engine, prompts, lengths) == expected
    assert any(held_mixed) and runner.held_rows > 0


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU: CUDA graphs captured and replayed")
def test_cuda_mixed_graphs_give_transformers_tokens(model):
    """On a GPU: the engine's default (every graph captured at start-up, real torch.cuda.CUDAGraph), then with
    decode graphs alone (--compilation-config FULL_DECODE_ONLY): the same tokens."""
    from pagedserve.worker.graph_runner import CudaGraph

    folder, prompts, lengths, expected = model
    engine = make_engine(folder, device="cuda", max_num_seqs=4, max_num_batched_tokens=BUDGET)
    mixed = engine.runner.mixed_graphs
    assert mixed is not None and mixed.captured.graph_factory().__class__ is CudaGraph
    assert sorted(mixed.graphs) == mixed.sizes  # captured at start-up
    assert generate(engine, prompts, lengths) == expected
    decode_only = make_engine(folder, device="cuda", max_num_seqs=4, max_num_batched_tokens=BUDGET,
                              compilation_config='{"cudagraph_mode": "FULL_DECODE_ONLY"}')
    assert decode_only.runner.mixed_graphs is None and decode_only.runner.decode_graphs is not None
    assert generate(decode_only, prompts, lengths) == expected


@pytest.mark.parametrize("overrides", [
    {"kv_cache_memory": 10 * 4096, "preemption_mode": "recompute"},  # preempted and recomputed in chunks
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                            "prompt_lookup_max": 2}},  # verification rows run as chunks of k + 1
], ids=["preemption", "ngram"])
def test_mixed_graphs_keep_greedy_tokens_through(model, overrides):
    """Preemption (recomputed prompts and outputs as chunks) and speculative decoding (verification rows
    beside the decodes) with mixed-step graphs: transformers' greedy tokens."""
    folder, prompts, lengths, expected = model
    engine = triton_engine(folder, DEVICE, BUDGET, **overrides)
    assert generate(engine, prompts, lengths) == expected
    assert sum(g.replays for g in engine.runner.mixed_graphs.graphs.values()) > 0
    if "preemption_mode" in overrides:
        assert engine.stats()["num_preemptions"] > 0


def test_mixed_graphs_give_the_eager_engines_samples_and_prompt_logprobs(model):
    """Seeded n = 2 samples, prompt logprobs and a prefix-cache hit (a chunk with cached context): the eager
    engine's results, float32."""
    folder, prompts, lengths, _ = model
    shared = prompts[0][:40]
    batch = [shared + prompts[1], shared + prompts[3], prompts[2]]
    params = [SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)]

    def run(engine):
        engine.generate([shared + [7]], SamplingParams(temperature=0.0, max_tokens=1))  # caches the prefix
        out = engine.generate(batch, params)
        return ([[s.token_ids for s in samples] for samples in out],
                [[(t.token_id, round(t.logprob, 4)) for t in out[1][0].prompt_logprobs]])

    graphed = triton_engine(folder, DEVICE, BUDGET)
    assert run(graphed) == run(triton_engine(folder, DEVICE, BUDGET, graphs=False))
    assert graphed.stats()["prefix_cache_hits"] > 0
    assert sum(g.replays for g in graphed.runner.mixed_graphs.graphs.values()) > 0


class FailsFromSixteenRows(StandInGraph):
    """A capture that fails for graphs of 16 rows or more: the mixed-step sizes here, no decode size."""

    def capture(self, fn):
        if fn().shape[0] >= 16:
            raise RuntimeError("out of memory while capturing")
        return super().capture(fn)


def test_a_failed_capture_at_start_up_drops_only_its_runner(model, caplog):
    """capture_graphs (what CUDA runs once the cache is allocated): the mixed-step captures fail, the decode
    graphs stay; mixed steps then run eagerly and the tokens are transformers'."""
    folder, prompts, lengths, expected = model
    engine = triton_engine(folder, DEVICE, BUDGET, graphs=False)
    runner = engine.runner
    runner.enable_decode_graphs(4, FailsFromSixteenRows, BUDGET)
    runner.capture_graphs()
    assert runner.mixed_graphs is None and sorted(runner.decode_graphs.graphs) == runner.decode_graphs.sizes
    assert "mixed-step graph of size 48 failed" in caplog.text  # the largest, captured first
    assert generate(engine, prompts, lengths) == expected
