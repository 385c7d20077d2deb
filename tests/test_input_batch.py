"""Persistent step inputs (pagedserve/worker/input_batch.py, issue 37 item 1): every integer input of a
step (token ids, positions, slot mapping, decode tables and lengths, prefill blocks) is a view of the one
persistent buffer, the same buffer step after step once warm; preparing a step runs no torch op but views
(a dispatch mode sees every op); mixed prefill/decode steps still give transformers' greedy tokens; the
buffer grows to a power of two when a step outgrows it. The decode mask the torch backend builds from the
lengths (attention.decode_mask) equals the one written out key by key, windowed or not."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.worker.attention import AttentionMetadata, decode_mask
from pagedserve.worker.input_batch import InputBatch
from tiny_models import build_tiny_model, hf_greedy, make_engine

VIEW_OPS = {"view", "slice", "alias", "as_strided", "select", "detach", "_reshape_alias", "unsqueeze"}


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def step_tensors(input_ids, positions, meta) -> list[torch.Tensor]:
    metas = meta if isinstance(meta, list) else [meta]
    out = [input_ids, positions]
    for m in metas:
        out += [m.slot_mapping] + [t for t in (m.decode_block_tables, m.decode_seq_lens) if t is not None]
        out += [p.block_ids for p in m.prefills]
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def test_steps_read_views_of_one_persistent_buffer(llama):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, n).tolist() for n in (5, 37, 20, 9)]
    lengths = [12, 7, 10, 14]
    expected = [hf_greedy(llama, [p], n)[0] for p, n in zip(prompts, lengths)]
    # 16 tokens a step: prompts go in chunks beside running decodes (mixed steps)
    engine = make_engine(llama, max_num_seqs=4, max_num_batched_tokens=16, enable_chunked_prefill=True)
    runner = engine.runner
    batch = runner.input_batch
    prepare, seen = runner._prepare, []

    def recording(step):
        with Ops() as ops:
            out = prepare(step)
        seen.append((out, ops.names, batch.allocations))
        return out

    runner._prepare = recording
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    assert [s[0].token_ids for s in engine.generate(prompts, params)] == expected
    buffer = batch._device.untyped_storage().data_ptr()
    kinds = set()
    for (input_ids, positions, meta, _, counts), names, allocations in seen:
        kinds.add((min(counts) == 1, max(counts) > 1))
        assert all(t.untyped_storage().data_ptr() == buffer for t in step_tensors(input_ids, positions, meta))
        assert set(names) <= VIEW_OPS, set(names) - VIEW_OPS
        assert allocations == 1
    assert kinds >= {(True, False), (True, True), (False, True)}  # pure decode, mixed and pure prefill steps


def test_the_buffer_grows_to_a_power_of_two_and_stays():
    batch = InputBatch(torch.device("cpu"), capacity=8)
    batch.begin(5)
    start, values = batch.take(5)
    values[:] = np.arange(5)
    assert start == 0 and batch.allocations == 1
    batch.begin(20)
    assert batch.capacity == 32 and batch.allocations == 2
    first = batch._host
    for n in (20, 3, 32):
        batch.begin(n)
        at, values = batch.take(n)
        values[:] = np.arange(n)
        batch.upload()
        assert batch.view(at, n).tolist() == list(range(n))
    assert batch._host is first and batch.allocations == 2
    with pytest.raises(RuntimeError, match="overran"):
        batch.take(1)


def reference_mask(lens, width, bs, window, windowed):
    """The mask written out key by key (the runner's former host-side rule)."""
    mask = torch.zeros(len(lens), 1, 1, width * bs)
    for row, length in enumerate(lens):
        first = max(0, length - window) // bs if windowed else 0
        for j in range(width * bs):
            key = first * bs + j
            if key >= length or (window and key < length - window):
                mask[row, 0, 0, j] = float("-inf")
    return mask


@pytest.mark.parametrize("window,windowed", [(0, False), (5, False), (5, True), (16, True)])
def test_decode_mask_from_the_lengths(window, windowed):
    bs, lens = 4, [1, 4, 5, 11, 23]
    width = max(-(-n // bs) for n in lens)
    meta = AttentionMetadata(torch.zeros(len(lens), dtype=torch.long), len(lens),
                             torch.zeros(len(lens), width, dtype=torch.long), torch.tensor(lens), None, [],
                             decode_windowed=windowed)
    assert torch.equal(decode_mask(meta, bs, window), reference_mask(lens, width, bs, window, windowed))


def _states(block_size: int, lengths: list[tuple[int, int]], seed: int = 0):
    """(state, scheduled tokens) pairs for layout_step: a state has computed `context` tokens of a prompt
    of context + new, and scattered blocks covering them."""
    from types import SimpleNamespace
    rng = np.random.default_rng(seed)
    out = []
    for context, new in lengths:
        blocks = rng.permutation(200)[:-(-(context + new) // block_size)].tolist()
        out.append((SimpleNamespace(num_computed_tokens=context, token_ids=list(range(context + new)),
                                    spec_token_ids=[], block_ids=blocks, group_block_ids=[]), new))
    return out


@pytest.mark.parametrize("decodes,prefills", [([9, 22], [(3, 6), (0, 5), (17, 2)]), ([], [(0, 7)]),
                                              ([5], [(40, 3)])])
def test_kernel_metadata_of_mixed_steps_is_vectorized(decodes, prefills):
    """The Triton backends' tables of a mixed step (attention.kernel_metadata) from the layout's packed
    prefills equal those built chunk by chunk (the PrefillSeq list, as metadata built by hand is), with
    a number of torch ops that does not grow with the chunks, and no host read."""
    from pagedserve.common.model_config import KVGroups
    from pagedserve.worker.attention import kernel_metadata, packed_prefills
    from pagedserve.worker.input_batch import layout_step
    from test_sampler_host_reads import HostReads

    bs = 4
    decode_states = _states(bs, [(n, 1) for n in decodes], 1)
    prefill_states = _states(bs, prefills, 2)
    num_tokens = len(decodes) + sum(n for _, n in prefills)
    batch = InputBatch(torch.device("cpu"))
    _, _, (meta,) = layout_step(batch, decode_states, prefill_states, num_tokens,
                                KVGroups(((0,),), (0,)), bs)
    buffer = batch._device.untyped_storage().data_ptr()
    assert meta.prefill_chunks.untyped_storage().data_ptr() == buffer
    assert meta.prefill_tables.untyped_storage().data_ptr() == buffer
    by_hand = dataclasses.replace(meta, prefill_chunks=None, prefill_tables=None)
    for got, want in zip(packed_prefills(meta, bs, batch.device), packed_prefills(by_hand, bs, batch.device)):
        assert torch.equal(got, want)
    with Ops() as ops, HostReads() as reads:
        got = kernel_metadata(meta, bs, batch.device)
    assert reads.reads == []
    want = kernel_metadata(by_hand, bs, batch.device)
    assert all(torch.equal(g, w) and g.dtype == w.dtype == torch.int32 for g, w in zip(got, want))
    assert got[1].tolist() == [n + 1 for n in decodes] + [c + n for c, n in prefills]
    # one chunk more, the same ops
    more = _states(bs, prefills + [(2, 2)], 2)
    _, _, (meta_more,) = layout_step(batch, decode_states, more, num_tokens + 2, KVGroups(((0,),), (0,)), bs)
    with Ops() as ops_more:
        kernel_metadata(meta_more, bs, batch.device)
    assert ops_more.names == ops.names


def test_a_graph_step_pads_with_row_zero_at_fixed_places():
    """layout_graph_decode: the step's rows, then rows repeating row 0 up to the bucket, at graph_region's
    views; a table wider than the graphs' leaves the step to layout_step."""
    from pagedserve.worker.input_batch import graph_region, layout_graph_decode

    bs, rows, width = 4, 8, 6
    decodes = _states(bs, [(9, 1), (2, 1), (17, 1)], 3)
    batch = InputBatch(torch.device("cpu"), capacity=16)
    input_ids, positions, meta = layout_graph_decode(batch, decodes, 4, rows, width, bs)
    region = graph_region(batch, rows, width)
    assert [t.data_ptr() for t in (input_ids, positions, meta.slot_mapping, meta.decode_seq_lens,
                                   meta.decode_block_tables)] == [t.data_ptr() for t in region]
    assert positions.tolist() == [9, 2, 17, 9] and meta.decode_seq_lens.tolist() == [10, 3, 18, 10]
    assert input_ids.tolist() == [9, 2, 17, 9] and meta.num_decodes == 4
    for row, (s, _) in enumerate(decodes + decodes[:1]):
        used = s.block_ids
        assert meta.decode_block_tables[row].tolist() == used + [0] * (width - len(used))
        pos = s.num_computed_tokens
        assert meta.slot_mapping[row] == used[pos // bs] * bs + pos % bs
    assert layout_graph_decode(batch, _states(bs, [(24, 1)]), 1, rows, width, bs) is None
