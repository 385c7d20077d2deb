"""Block tables as persistent rows (pagedserve/worker/block_table.py, issue 37 item 1): every state the worker
keeps owns a row equal to its tables after each delta (new requests, appended and replaced blocks, tables
replaced whole after a preemption, forks, dropped requests), through a real engine with KV groups, swaps and
forks; a step laid out from the rows is the step laid out from the lists, byte for byte (eager with a sliding
group, decode graphs, mixed-step graphs); rows are zeroed when dropped and reused."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagedserve.common.model_config import KVGroups
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.worker.block_table import BlockTables, gather
from pagedserve.worker.input_batch import InputBatch, layout_graph_decode, layout_graph_mixed, layout_step
from tiny_models import build_tiny_model, make_engine


def rows_equal_lists(states) -> None:
    tables = states.tables
    for state in states.values():
        for group, table in enumerate([state.block_ids, *state.group_block_ids]):
            row = tables.array(group)[state.table_row]
            assert row[:len(table)].tolist() == table, (state.req_id, group)
            assert not row[len(table):].any(), (state.req_id, group)
    assert len({s.table_row for s in states.values()}) == len(states)  # a row per state


def checked(engine) -> list[int]:
    """Check the rows after every change the runner makes to its states; returns the states' counts seen."""
    states, seen = engine.runner.requests, []
    apply, commit = states.apply, states.commit

    def apply_then_check(*args, **kwargs):
        apply(*args, **kwargs)
        rows_equal_lists(states)
        seen.append(len(states))

    def commit_then_check(*args, **kwargs):
        commit(*args, **kwargs)
        rows_equal_lists(states)
    states.apply, states.commit = apply_then_check, commit_then_check
    return seen


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_rows_follow_every_delta_with_kv_groups(tmp_path, mode):
    """Gemma 3 (a full and a sliding group: windows drop blocks, tables replaced whole after preemption),
    chunked prefill in a small pool, n = 2 forks."""
    gemma = build_tiny_model(tmp_path / "gemma", "gemma3")
    block_bytes = 4 * 2 * 16 * 2 * 32 * 4 // 2  # a block of one group's two layers, float32
    engine = make_engine(gemma, kv_cache_memory=20 * block_bytes, preemption_mode=mode, swap_space=64 * block_bytes,
                         max_num_batched_tokens=24)
    seen = checked(engine)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (3, 9, 17, 28, 44, 60)]
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * 5 + [
        SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=12, ignore_eos=True)]
    outputs = engine.generate(prompts, params)
    assert engine.stats()["num_preemptions"] > 0 and max(seen) > 1
    assert [len(samples) for samples in outputs] == [1] * 5 + [2]
    # the dropped requests' rows are zeroed (the last finished one is dropped by the next step's delta)
    states = engine.runner.requests
    live = {s.table_row for s in states.values()}
    for group in (0, 1):
        array = states.tables.array(group)
        assert not array[[r for r in range(array.shape[0]) if r not in live]].any()


def test_rows_are_zeroed_when_dropped_and_reused():
    tables = BlockTables(rows=2, width=2)
    a = SimpleNamespace(block_ids=[5, 6, 7], group_block_ids=[[1]], table_row=-1)
    b = SimpleNamespace(block_ids=[9], group_block_ids=[[]], table_row=-1)
    tables.assign(a)
    tables.assign(b)
    assert (a.table_row, b.table_row) == (0, 1) and tables.width == 4  # columns grew to a power of two
    tables.extend(b, 0, 1, [10, 11, 12, 13])  # past the width: grows again, rows kept
    assert tables.width == 8 and tables.array(0)[:2].tolist() == [[5, 6, 7, 0] + [0] * 4, [9, 10, 11, 12, 13, 0, 0, 0]]
    tables.set(a, 1, 0, 4)
    assert tables.array(1)[0, :2].tolist() == [4, 0]
    tables.release(a)
    assert a.table_row == -1 and not tables.array(0)[0].any() and not tables.array(1)[0].any()
    c = SimpleNamespace(block_ids=[3], group_block_ids=[[2]], table_row=-1)
    tables.assign(c)
    assert c.table_row == 0  # the dropped row, reused
    d = SimpleNamespace(block_ids=[1], group_block_ids=[[1]], table_row=-1)
    tables.assign(d)
    assert d.table_row == 2 and tables.array(0).shape[0] == 4  # rows grew too
    b.block_ids = [8]
    tables.write(b)  # a table replaced whole by a shorter one: the old tail is gone
    assert tables.array(0)[1].tolist() == [8] + [0] * 7


def test_gather_reads_rows_as_the_lists_read():
    rng = np.random.default_rng(0)
    tables, with_rows, without = BlockTables(rows=4, width=4), [], []
    for n in (1, 5, 13, 9):
        blocks = rng.permutation(100)[:n].tolist()
        with_rows.append(SimpleNamespace(block_ids=blocks, group_block_ids=[blocks[::-1]], table_row=-1))
        without.append(SimpleNamespace(block_ids=blocks, group_block_ids=[blocks[::-1]]))
        tables.assign(with_rows[-1])
    first = np.array([0, 2, 7, 1])
    for group in (0, 1):
        for start, width in ((None, 6), (None, 20), (first, 6), (first, 12)):
            out_rows, out_lists = np.full((4, width), -7), np.full((4, width), -7)
            gather(tables, out_rows, with_rows, group, start)
            gather(None, out_lists, without, group, start)
            assert np.array_equal(out_rows, out_lists), (group, start, width)
    mixed = with_rows[:2] + without[2:]  # a state without a row: every row from the lists
    out_mixed, out_rows = np.zeros((4, 8), dtype=np.int64), np.zeros((4, 8), dtype=np.int64)
    gather(tables, out_mixed, mixed, 0)
    gather(tables, out_rows, with_rows, 0)
    assert np.array_equal(out_mixed, out_rows)


def _states(block_size: int, lengths: list[tuple[int, int]], tables: BlockTables | None, seed: int = 0):
    """(state, scheduled tokens) pairs, each state's table 1-3 blocks longer than its tokens need (blocks
    allocated ahead), with a row of `tables` when given."""
    rng = np.random.default_rng(seed)
    out = []
    for i, (context, new) in enumerate(lengths):
        blocks = rng.permutation(300)[:-(-(context + new) // block_size) + 1 + i % 3].tolist()
        state = SimpleNamespace(num_computed_tokens=context, token_ids=list(range(context + new)), spec_token_ids=[],
                                block_ids=blocks, group_block_ids=[blocks[::-1]], table_row=-1)
        if tables is not None:
            tables.assign(state)
        out.append((state, new))
    return out


def _host(batch: InputBatch) -> np.ndarray:
    return batch._host_np[:batch._used].copy()


@pytest.mark.parametrize("window", [0, 8])
def test_a_step_laid_out_from_the_rows_is_the_step_laid_out_from_the_lists(window):
    bs, groups = 4, KVGroups(((0,), (1,)), (0, window))
    lengths = [(9, 1), (22, 1), (3, 1), (3, 6), (0, 5), (17, 2)]
    layouts = []
    for tables in (BlockTables(rows=2, width=2), None):
        states = _states(bs, lengths, tables)
        decodes, prefills = states[:3], states[3:]
        eager = InputBatch(torch.device("cpu"))
        layout_step(eager, decodes, prefills, 3 + 13, groups, bs, tables=tables)
        graph = InputBatch(torch.device("cpu"))
        assert layout_graph_decode(graph, decodes, 4, 8, 16, bs, tables) is not None
        mixed = InputBatch(torch.device("cpu"))
        assert layout_graph_mixed(mixed, decodes, prefills, 16, 32, 32, 9, 16, bs, tables) is not None
        layouts.append([_host(b) for b in (eager, graph, mixed)])
    for from_rows, from_lists in zip(*layouts):
        assert np.array_equal(from_rows, from_lists)
