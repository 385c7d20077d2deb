"""Async scheduling in the engine (worker/step_overlap.py): step N+1 begins before step N's tokens are
taken, its rows fed N's sampled ids on the device. On the CPU the engine turns it on only when asked
(async_scheduling=True), and then runs the very code a GPU runs: tokens equal transformers' and the
synchronous engine's, whatever batching, chunking, preemption, graphs, aborts or row kinds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.worker.graph_runner import StandInGraph
from tiny_models import hf_greedy, make_engine

MAX_NEW = 16


def prompts(num: int, seed: int = 0, low: int = 3, high: int = 60) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, int(n)).tolist() for n in rng.integers(low, high, num)]


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def tokens(engine, batch, params) -> list[list[list[int]]]:
    return [[s.token_ids for s in samples] for samples in engine.generate(batch, params)]


@pytest.fixture(scope="module")
def case(tiny_llama):
    batch = prompts(8, seed=1)
    lengths = [4, 9, 16, 6, 12, 16, 3, 10]
    expected = [hf_greedy(tiny_llama, [p], n)[0] for p, n in zip(batch, lengths)]
    return tiny_llama, batch, lengths, expected


def overlapped(folder, **overrides):
    engine = make_engine(folder, async_scheduling=True, **overrides)
    assert engine.overlaps
    return engine


def test_the_cpu_overlaps_only_when_asked(tiny_llama):
    """By default only where the device runs behind the host (CUDA): the CPU computes a step as it is
    launched, so overlapping would only deliver each token a step later."""
    engine = make_engine(tiny_llama)
    assert engine.overlaps == (engine.device.type == "cuda")
    assert not make_engine(tiny_llama, async_scheduling=False).overlaps


@pytest.mark.parametrize("overrides", [
    {},
    {"max_num_batched_tokens": 16},  # chunked prefill beside held decode rows
    {"kv_cache_memory": 12 * 8192, "preemption_mode": "recompute"},
    {"kv_cache_memory": 12 * 8192, "preemption_mode": "swap", "swap_space": 64 * 8192},
], ids=["plain", "chunked", "recompute", "swap"])
def test_greedy_tokens_equal_transformers(case, overrides):
    folder, batch, lengths, expected = case
    engine = overlapped(folder, **overrides)
    got = tokens(engine, batch, [greedy(n) for n in lengths])
    assert [g[0] for g in got] == expected
    assert engine.runner.held_rows > sum(lengths) // 2  # most decode rows were fed on the device
    if "kv_cache_memory" in overrides:
        assert engine.stats()["num_preemptions"] > 0
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks


def test_decode_graphs_feed_their_padding_rows(case):
    """A pure-decode step of 3 rows runs the 4-row graph: its padding row repeats row 0 and writes row 0's
    slot, so it must compute row 0's fed token (the placeholder there would overwrite row 0's keys)."""
    folder, batch, lengths, expected = case
    engine = overlapped(folder, max_num_seqs=8)
    engine.runner.enable_decode_graphs(8, StandInGraph)
    got = tokens(engine, batch[:3], [greedy(n) for n in lengths[:3]])
    assert [g[0] for g in got] == expected[:3]
    graphs = engine.runner.decode_graphs
    assert 4 in graphs.graphs and sum(g.replays for g in graphs.graphs.values()) > 0
    assert engine.runner.held_rows > 0


def test_every_row_kind_gives_the_synchronous_tokens(tiny_llama):
    """Rows that need their tokens on the host (forks) make the runner finish the step in flight first;
    seeded, logprob, min_tokens, stop, eos and penalty rows are fed on the device (a penalty row's histories
    count its sampled id there: penalty_counts.py). Every output equals the synchronous engine's (seeded draws
    depend only on seed, sample and position)."""
    batch = prompts(7, seed=2)
    params = [
        SamplingParams(temperature=0.9, seed=11, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=12, n=3, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, presence_penalty=0.5,
                       frequency_penalty=0.3, repetition_penalty=1.2),
        SamplingParams(temperature=0.8, top_k=20, seed=13, max_tokens=10, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6, stop_token_ids=[7, 9, 11, 13, 15]),
        SamplingParams(temperature=1.0, seed=14, max_tokens=15, stop_token_ids=list(range(3, 40))),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
    ]
    sync = make_engine(tiny_llama).generate(batch, params)
    engine = overlapped(tiny_llama)
    got = engine.generate(batch, params)
    assert [[(s.token_ids, s.finish_reason) for s in g] for g in got] == \
        [[(s.token_ids, s.finish_reason) for s in g] for g in sync]
    for mine, theirs in zip(got[3][0].logprobs, sync[3][0].logprobs):
        assert mine.token_id == theirs.token_id and mine.logprob == pytest.approx(theirs.logprob, abs=1e-5)
    assert any(s.finish_reason == "stop" for g in sync for s in g)
    assert engine.runner.held_rows > 0
    # a batch of penalty rows alone overlaps its steps: their rows are held, their histories read on the device
    penalties = [params[2]] * 3
    alone = overlapped(tiny_llama)
    assert alone.generate(batch[:3], penalties) == make_engine(tiny_llama).generate(batch[:3], penalties)
    assert alone.runner.held_rows > 20


def test_a_request_aborted_while_its_step_is_in_flight(case):
    folder, batch, lengths, expected = case
    engine = overlapped(folder)
    for i, prompt in enumerate(batch[:4]):
        engine.add_request(f"r{i}", prompt, greedy(16))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += [t.token_id for t in o.new_tokens]
        steps += 1
        if steps == 4:
            assert engine._in_flight is not None  # the next step is on its way
            assert engine.abort("r1")
    for i in (0, 2, 3):
        assert out[f"r{i}"] == hf_greedy(folder, [batch[i]], 16)[0]
    assert out["r1"] == hf_greedy(folder, [batch[1]], 16)[0][:len(out["r1"])] and len(out["r1"]) < 16
    # the dropped request's state goes with the next step: nothing is left once it ran
    engine.add_request("after", batch[4], greedy(3))
    while engine.has_unfinished():
        engine.step()
    assert set(engine.runner.requests) <= {"after"}
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks


def test_a_held_row_reads_the_step_in_flights_ids_on_the_device(tiny_llama):
    """The held place's host value never reaches the model: the layout writes the placeholder, the feed
    overwrites it from the sampled ids before the forward (eager: a replayed graph calls no forward)."""
    engine = overlapped(tiny_llama, enforce_eager=True)
    runner = engine.runner
    seen: list[list[int]] = []
    forward = runner.model.forward

    def recording(input_ids, *args, **kwargs):
        seen.append(input_ids.tolist())
        return forward(input_ids, *args, **kwargs)

    runner.model.forward = recording
    prompt = prompts(1, seed=3)[0]
    got = engine.generate([prompt], greedy(8))[0][0].token_ids
    decode_inputs = [ids for ids in seen if len(ids) == 1]
    assert [ids[0] for ids in decode_inputs] == got[:-1]  # each decode step's input: the token before it
    assert runner.held_rows == len(got) - 1


def test_the_sync_path_still_samples_in_one_copy(tiny_llama):
    """execute() is begin + finish: a step with nothing in flight holds no place."""
    engine = make_engine(tiny_llama)
    engine.generate(prompts(3, seed=4), greedy(5))
    assert engine.runner.held_rows == 0
    assert not engine.runner._unfinished
    assert isinstance(engine.runner.sampler, object) and torch.is_inference_mode_enabled() is False


class _OpsOutsideGraphs(TorchDispatchMode):
    """The aten ops a step runs outside its decode graph's replay (what the host launches one by one on
    a GPU), views and other metadata-only ops left out."""
    METADATA = ("slice", "view", "alias", "reshape", "detach", "resolve_conj", "resolve_neg", "lift_fresh",
                "empty", "unsqueeze", "squeeze", "select", "expand", "as_strided", "t.default")

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.in_graph = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if not self.in_graph and not any(m in name for m in self.METADATA):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_a_graphed_decode_steps_own_ops_do_not_grow_with_the_batch(tiny_llama, monkeypatch, overlap):
    """Outside the graph a pure-decode step runs the same few ops at batch 3 as at batch 6: no per-row
    work reaches the device one row at a time (the one upload, the fed ids, the logits, the sampling)."""
    mode = _OpsOutsideGraphs()
    replay = StandInGraph.replay

    def counted_replay(graph):
        mode.in_graph += 1
        try:
            replay(graph)
        finally:
            mode.in_graph -= 1

    monkeypatch.setattr(StandInGraph, "replay", counted_replay)
    counts = []
    for batch in (3, 6):  # (buckets 4 and 8: both padded)
        engine = make_engine(tiny_llama, max_num_seqs=8, async_scheduling=overlap)
        engine.runner.enable_decode_graphs(8, StandInGraph)
        for i, prompt in enumerate(prompts(batch, seed=5, low=10, high=30)):
            engine.add_request(f"r{i}", prompt, greedy(20))
        for _ in range(4):
            engine.step()
        mode.ops = []
        with mode:
            engine.step()
        counts.append(list(mode.ops))
    assert counts[0] == counts[1]
    assert len(counts[0]) <= 6, counts[0]
