"""The decode graph runner (pagedserve/worker/graph_runner.py) on the CPU: the same buckets, padding, static
buffers and re-capture as on a GPU, with the stand-in graph that replays by running the captured function
on the same static buffers. Greedy tokens with graphs equal those without and transformers' (float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.common.compilation import capture_sizes, graph_plan
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.worker.graph_runner import StandInGraph, bucket_for
from tiny_models import build_tiny_model, hf_greedy, make_engine


def test_capture_sizes_follow_vllm():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def test_bucket_is_the_smallest_that_holds_the_batch():
    sizes = capture_sizes(32)
    assert [bucket_for(b, sizes) for b in (1, 2, 3, 5, 8, 9, 17, 32)] == [1, 2, 4, 8, 8, 16, 24, 32]
    assert bucket_for(33, sizes) is None


# a dense model, a MoE one, and one with two KV groups (Gemma 2: local layers with a window of 8 tokens beside
# global ones, the scores capped): its graphs read each group's slots and tables
@pytest.fixture(scope="module", params=["llama", "qwen2_moe", "gemma2"])
def model(request, tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in (3, 17, 40, 8, 25)]
    # different lengths: as requests finish, decode batches of 5, 4, 3, 2, 1 (buckets 8, 4, 4, 2, 1)
    lengths = [6, 9, 12, 15, 18]
    expected = [hf_greedy(folder, [p], n)[0] for p, n in zip(prompts, lengths)]
    return folder, prompts, lengths, expected


def generate(engine, prompts, lengths):
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    return [samples[0].token_ids for samples in engine.generate(prompts, params)]


def graph_engine(folder, **overrides):
    engine = make_engine(folder, max_num_seqs=8, **overrides)
    engine.runner.enable_decode_graphs(8, StandInGraph)
    return engine


def test_greedy_tokens_with_graphs_equal_transformers(model):
    """...and a graph reads each step's inputs where the step's upload put them (no staging copy)."""
    folder, prompts, lengths, expected = model
    engine = graph_engine(folder)
    runner = engine.runner
    prepare, graphed = runner._prepare, []

    def recording(step):
        out = prepare(step)
        if runner._graph_size is not None:
            groups = out[2] if isinstance(out[2], list) else [out[2]]
            groups = list({id(m): m for m in groups}.values())  # each group's once, in layer order
            groups.sort(key=lambda m: m.slot_mapping.data_ptr())
            ptrs = [out[0], out[1], groups[0].slot_mapping, groups[0].decode_seq_lens, groups[0].decode_block_tables]
            for meta in groups[1:]:
                ptrs += [meta.slot_mapping, meta.decode_block_tables]
            graphed.append([t.data_ptr() for t in ptrs])
        return out

    runner._prepare = recording
    assert generate(engine, prompts, lengths) == expected
    graphs = runner.decode_graphs
    assert sorted(graphs.graphs) == [1, 2, 4, 8]  # every bucket the shrinking batch needed, captured once
    assert sum(g.replays for g in graphs.graphs.values()) > 0
    buffer = runner.input_batch._device.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == buffer for t in graphs.inputs)
    assert graphed and all(ptrs == [t.data_ptr() for t in graphs.inputs] for ptrs in graphed)


def test_padding_rows_write_only_row_zeros_slot(model):
    """With graphs the KV cache ends as it does eagerly: a padding row writing into any other slot would
    leave a value there that the eager engine's cache does not have."""
    folder, prompts, lengths, _ = model
    eager, graphed = make_engine(folder, max_num_seqs=8), graph_engine(folder)
    assert generate(eager, prompts[:3], lengths[:3]) == generate(graphed, prompts[:3], lengths[:3])
    assert torch.allclose(eager.runner.kv.device_cache, graphed.runner.kv.device_cache, atol=1e-5)


def test_reallocated_cache_recaptures(model):
    folder, prompts, lengths, expected = model
    engine = graph_engine(folder, enable_prefix_caching=False)  # a new, zeroed cache holds no cached prefix
    assert generate(engine, prompts[:2], lengths[:2]) == expected[:2]
    graphs = engine.runner.decode_graphs
    assert graphs.graphs
    engine.runner.allocate_kv_cache(engine.runner.kv.num_blocks)
    assert not graphs.graphs  # dropped with the cache they captured
    assert generate(engine, prompts, lengths) == expected
    assert graphs.graphs
    batch, before = engine.runner.input_batch, dict(graphs.graphs)
    batch.begin(batch.capacity + 1)  # the input buffer grows (as for a step larger than any before)
    assert generate(engine, prompts[:2], lengths[:2]) == expected[:2]
    assert graphs.inputs[0].untyped_storage().data_ptr() == batch._device.untyped_storage().data_ptr()
    assert graphs.graphs and all(g is not before.get(size) for size, g in graphs.graphs.items())  # captured anew


def test_steps_a_bucket_cannot_hold_run_eagerly(model):
    folder, prompts, lengths, expected = model
    engine = make_engine(folder, max_num_seqs=8)
    engine.runner.enable_decode_graphs(2, StandInGraph)  # buckets 1 and 2 only
    assert generate(engine, prompts, lengths) == expected
    assert sorted(engine.runner.decode_graphs.graphs) == [1, 2]


@pytest.mark.parametrize("config, buckets", [
    ('{"cudagraph_capture_sizes": [3, 1, 64]}', [1, 3, 8]),  # 64 is past --max-num-seqs: taken as 8
    ('{"max_cudagraph_capture_size": 2}', [1, 2]),  # the default sizes up to 2: larger batches run eagerly
])
def test_the_configured_capture_sizes_are_the_buckets(model, config, buckets):
    """vLLM's --compilation-config keys: batches of 5 and 4 pad to 8, 3 and 2 to 3, 1 is 1 (or 1, 2 and eager)."""
    folder, prompts, lengths, expected = model
    engine = make_engine(folder, max_num_seqs=8)
    engine.runner.enable_decode_graphs(8, StandInGraph, plan=graph_plan(config))
    assert generate(engine, prompts, lengths) == expected
    assert sorted(engine.runner.decode_graphs.graphs) == buckets


class FailingGraph(StandInGraph):
    def capture(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_falls_back_to_eager(model, caplog):
    folder, prompts, lengths, expected = model
    engine = make_engine(folder, max_num_seqs=8)
    engine.runner.enable_decode_graphs(8, FailingGraph)
    assert generate(engine, prompts, lengths) == expected
    assert engine.runner.decode_graphs is None
    assert "run eagerly from now on" in caplog.text


def test_a_backend_that_cannot_be_captured_keeps_steps_eager(model, monkeypatch):
    """The runner asks the attention backends (graph_support), not a rule of its own."""
    from pagedserve.worker.attention import GraphSupport
    folder, prompts, lengths, expected = model
    engine = make_engine(folder, max_num_seqs=8)
    backend = next(m.backend for m in engine.runner.model.modules() if hasattr(m, "backend")
                   and hasattr(m.backend, "graph_support"))
    monkeypatch.setattr(type(backend), "graph_support", GraphSupport.NEVER)
    engine.runner.enable_decode_graphs(8, StandInGraph)
    assert engine.runner.decode_graphs is None
    assert generate(engine, prompts[:2], lengths[:2]) == expected[:2]


def test_the_cpu_runs_eagerly_unless_asked():
    """use_decode_graphs (what the engine and the worker call after allocating the cache) is CUDA's only."""
    from pagedserve.worker.model_runner import ModelRunner
    runner = ModelRunner.__new__(ModelRunner)
    runner.device, runner.decode_graphs = torch.device("cpu"), None
    runner.use_decode_graphs(8, enforce_eager=False)
    assert runner.decode_graphs is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: CUDA graphs captured and replayed")
def test_cuda_graphs_give_transformers_tokens(model):
    """On a GPU: the engine's default (graphs on), real torch.cuda.CUDAGraph capture and replay."""
    from pagedserve.worker.graph_runner import CudaGraph

    folder, prompts, lengths, expected = model
    engine = make_engine(folder, device="cuda", max_num_seqs=8)
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.graph_factory().__class__ is CudaGraph
    assert generate(engine, prompts, lengths) == expected
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    eager = make_engine(folder, device="cuda", max_num_seqs=8, enforce_eager=True)
    assert eager.runner.decode_graphs is None
    assert generate(eager, prompts, lengths) == expected
