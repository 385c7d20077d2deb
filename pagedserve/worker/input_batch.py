"""Persistent step inputs (issue 37 item 1; the idea of vLLM v1's InputBatch and SGLang's ForwardBatch
buffers, our own code).

A step's integer inputs (token ids, positions, each KV group's slot mapping, the decode rows' block tables and
sequence lengths, the prefill chunks' (query start, query length, context length) and their block tables,
as wide as the widest chunk's: attention.AttentionMetadata.prefill_chunks / prefill_tables) are written by
the host, packed one after the other, into one preallocated int64 buffer (pinned on CUDA) and reach the device
in ONE non-blocking copy of the used prefix into one preallocated device buffer. Every tensor the model reads
is a view of that device buffer; on the CPU the host buffer is the device buffer (no copy at all). No tensor
of a per-step shape is allocated: the two buffers grow (to the next power of two) only when a step needs more
room than any step before it, so after warm-up they are the same buffers step after step (`allocations` counts
them).

`layout_step` builds the step's layout from the request states the model runner keeps: decodes first, then
prefill chunks in order, as AttentionMetadata requires. The block tables are gathered from the rows the
request states keep in step with the deltas (block_table.py: one numpy op a table, not a copy a request).
`layout_graph_decode` writes a pure-decode step a decode graph runs at fixed places instead
(`graph_region`), padded to the graph's bucket, and
`layout_graph_mixed` any other step a mixed-step graph runs (`mixed_region`): the graphs read them there
(graph_runner.py). Attention masks are the backends' business (attention.py), not the layout's.

Invariants:
- the views handed out for a step stay valid until the next `begin` (the step's forward and sampling);
- positions hold token indices when the slots are computed from them; an M-RoPE model's rotary shifts
  (batch.rope_shift, worker/mrope.py) are added after that, before the upload;
- `begin` waits until the previous step's copy has left the pinned buffer (a CUDA event) before the host
  writes it again (a step whose sampled ids were read back has passed it already: no wait).

Threads: the model runner's torch thread only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.worker.attention import AttentionMetadata, PackedSeqs, PrefillSeq
from pagedserve.worker.block_table import BlockTables, gather


class InputBatch:
    """The packed host buffer, its device twin, and a cursor for the step being written."""

    def __init__(self, device: torch.device, capacity: int = 1 << 12) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self.allocations = 0  # times the buffers were (re)allocated: constant after warm-up
        # an M-RoPE model's (mrope.PositionShift): each layout adds its rows' rotary shifts to the positions
        # after computing the slots from them, before the upload; None (text models): nothing is called
        self.rope_shift = None
        self._used = 0
        self._event = None  # CUDA: made on the first upload, on this batch's device
        self._copied = False  # whether _event marks a copy the host must wait for
        self._allocate(capacity)

    @property
    def capacity(self) -> int:
        return self._host.shape[0]

    def _allocate(self, capacity: int) -> None:
        self._host = torch.zeros(capacity, dtype=torch.long, pin_memory=self._cuda)
        self._host_np = self._host.numpy()
        self._device = torch.zeros(capacity, dtype=torch.long, device=self.device) if self._cuda else self._host
        self.allocations += 1

    def begin(self, capacity: int) -> None:
        """Start writing a step of at most `capacity` values (the previous step's views become invalid)."""
        if self._copied:
            self._event.synchronize()
            self._copied = False
        if capacity > self.capacity:
            self._allocate(1 << (capacity - 1).bit_length())
        self._used = 0

    def take(self, n: int) -> tuple[int, np.ndarray]:
        """n values of the step: (their offset, the host view to write them into)."""
        start = self._used
        self._used += n
        if self._used > self.capacity:
            raise RuntimeError(f"step inputs overran their reserved {self.capacity} values")
        return start, self._host_np[start:self._used]

    def upload(self) -> None:
        """The step's values to the device: one non-blocking copy on CUDA, nothing on the CPU."""
        if self._cuda and self._used:
            self._device[:self._used].copy_(self._host[:self._used], non_blocking=True)
            if self._event is None:
                with torch.cuda.device(self.device):
                    self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(self.device))
            self._copied = True

    def view(self, start: int, *shape: int) -> torch.Tensor:
        """The device view of values written at `start` (after `upload`)."""
        return self._device[start:start + math.prod(shape)].view(shape)


@dataclass(slots=True)
class _GroupLayout:
    slots: int  # offset of the slot mapping [T]
    tables: int  # offset of the decode tables [num_decodes, width]
    width: int
    windowed: bool
    prefill_tables: int  # offset of the prefills' tables [P, prefill_width] (columns past a chunk's: unread)
    prefills: list[tuple[int, int, int, int]]  # (query_start, query_len, context_len, blocks in use)


def layout_step(batch: InputBatch, decodes: list, prefills: list, num_tokens: int, groups, block_size: int,
                given_positions: np.ndarray | None = None, tables: BlockTables | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata]]:
    """(input_ids, positions, one AttentionMetadata per KV group) of a step whose decodes and prefills are
    lists of (RequestState, scheduled tokens), written into `batch` and uploaded in one copy. tables: the
    states' block-table rows (RequestStates.tables; block_table.gather), None: their lists.
    given_positions (bench quality's teacher-forced windows, states without token ids): the positions as
    they are, and input_ids left unwritten (the caller brings its own).

    A sliding group's decode rows hold only the blocks from the one with the window's first key on
    (decode_windowed): the gather costs the window, not the sequence."""
    bs = block_size
    num_decodes = len(decodes)
    if given_positions is not None:
        decode_pos = given_positions[:num_decodes]
    else:
        decode_pos = np.fromiter((s.num_computed_tokens for s, _ in decodes), dtype=np.int64, count=num_decodes)
    firsts: dict[int, tuple[np.ndarray, int]] = {}  # window -> (first block per row, width)
    for window in set(groups.windows) if num_decodes else ():
        first = np.maximum(0, decode_pos - window + 1) // bs if window else np.zeros_like(decode_pos)
        firsts[window] = first, int((decode_pos // bs - first).max()) + 1
    num_groups = len(groups.layers)
    num_prefills = len(prefills)
    prefill_width = max((-(-(s.num_computed_tokens + n) // bs) for s, n in prefills), default=0)
    batch.begin(num_tokens * (2 + num_groups) + num_decodes + 3 * num_prefills
                + num_groups * num_prefills * prefill_width
                + sum(num_decodes * firsts[w][1] for w in groups.windows if num_decodes))
    ids_at, input_ids = batch.take(num_tokens)
    pos_at, positions = batch.take(num_tokens)
    lens_at, lens = batch.take(num_decodes)
    lens[:] = decode_pos + 1
    chunks_at, chunks = batch.take(3 * num_prefills)  # (query_start, query_len, context_len) per prefill
    if given_positions is not None:
        positions[:] = given_positions
    else:
        _write_tokens(decodes, prefills, input_ids, positions)
    layouts = [_group_layout(batch, decodes, prefills, positions, g, groups.windows[g], firsts, bs, prefill_width,
                             tables) for g in range(num_groups)]
    if num_prefills:
        chunks.reshape(num_prefills, 3)[:] = [(q, n, c) for q, n, c, _ in layouts[0].prefills]
    if batch.rope_shift is not None and given_positions is None:
        batch.rope_shift(positions, [*decodes, *prefills])
    batch.upload()
    decode_lens = batch.view(lens_at, num_decodes) if num_decodes else None
    prefill_chunks = batch.view(chunks_at, num_prefills, 3) if num_prefills else None
    metas = []
    for lay in layouts:
        tables = batch.view(lay.prefill_tables, num_prefills, prefill_width) if num_prefills else None
        metas.append(AttentionMetadata(
            batch.view(lay.slots, num_tokens), num_decodes,
            batch.view(lay.tables, num_decodes, lay.width) if num_decodes else None, decode_lens, None,
            [PrefillSeq(q, n, c, tables[row, :used]) for row, (q, n, c, used) in enumerate(lay.prefills)],
            decode_windowed=lay.windowed, prefill_chunks=prefill_chunks, prefill_tables=tables))
    return batch.view(ids_at, num_tokens), batch.view(pos_at, num_tokens), metas


def _write_tokens(decodes, prefills, input_ids: np.ndarray, positions: np.ndarray) -> None:
    """The decodes' next tokens and positions, then each prefill chunk's run (a speculating request's run
    goes on into its draft tokens: its verification rows)."""
    num_decodes = len(decodes)
    if num_decodes:
        input_ids[:num_decodes] = [s.token_ids[s.num_computed_tokens] for s, _ in decodes]
        positions[:num_decodes] = [s.num_computed_tokens for s, _ in decodes]
    start = num_decodes
    for state, n in prefills:
        c = state.num_computed_tokens
        tokens = [*state.token_ids, *state.spec_token_ids] if state.spec_token_ids else state.token_ids
        input_ids[start:start + n] = tokens[c:c + n]
        positions[start:start + n] = np.arange(c, c + n)
        start += n


def _group_layout(batch: InputBatch, decodes, prefills, positions: np.ndarray, group: int, window: int,
                  firsts: dict, bs: int, prefill_width: int, tables: BlockTables | None) -> _GroupLayout:
    """One KV group's slot mapping, decode tables and prefill tables (a row of prefill_width per chunk),
    written into the batch. A table's columns past the blocks its sequence covers are not read (they may
    hold the request's later blocks, or 0: block_table.gather)."""
    slots_at, slots = batch.take(len(positions))
    num_decodes = len(decodes)
    tables_at, width = 0, 0
    if num_decodes:
        first, width = firsts[window]
        tables_at, flat = batch.take(num_decodes * width)
        decode_tables = flat.reshape(num_decodes, width)
        gather(tables, decode_tables, [s for s, _ in decodes], group, first if window else None)
        pos = positions[:num_decodes]
        slots[:num_decodes] = decode_tables[np.arange(num_decodes), pos // bs - first] * bs + pos % bs
    seqs, start = [], num_decodes
    prefill_at, flat = batch.take(len(prefills) * prefill_width)
    prefill_tables = flat.reshape(len(prefills), prefill_width)
    if prefills:
        gather(tables, prefill_tables, [s for s, _ in prefills], group)
    for row, (state, n) in enumerate(prefills):
        c = state.num_computed_tokens
        pos = positions[start:start + n]
        slots[start:start + n] = prefill_tables[row, pos // bs] * bs + pos % bs
        seqs.append((start, n, c, -(-(c + n) // bs)))
        start += n
    return _GroupLayout(slots_at, tables_at, width, bool(window), prefill_at, seqs)


def graph_region_size(rows: int, width: int, groups: int = 1) -> int:
    """Values of the input buffer a decode graph region takes (graph_region)."""
    return (3 + groups) * rows + rows * groups * width


def graph_region(batch: InputBatch, rows: int, width: int, groups: int = 1) -> tuple[torch.Tensor, ...]:
    """The decode graphs' inputs, views at fixed offsets of the batch's device buffer: (input_ids [rows],
    positions [rows], slot_mapping [rows], seq_lens [rows], block_tables [rows, width]) of the first KV group,
    then (slot_mapping, block_tables) of each other group. The groups' tables interleave by row ([rows, groups,
    width]): a bucket of `size` rows reads the region's first size rows of every group, so a step uploads only
    those. layout_graph_decode writes a step there; a graph captured on these views reads each step's inputs
    where the one upload put them. Valid until the batch reallocates (batch.allocations changes); the batch
    must hold the region (a step laid out by layout_graph_decode made it)."""
    if batch.capacity < graph_region_size(rows, width, groups):
        raise ValueError(f"the input batch holds {batch.capacity} values, the graph region needs more")
    tables = batch.view((3 + groups) * rows, rows, groups, width)
    slots = [batch.view(2 * rows, rows)] + [batch.view((3 + g) * rows, rows) for g in range(1, groups)]
    views = [batch.view(0, rows), batch.view(rows, rows), slots[0], batch.view(3 * rows, rows), tables[:, 0]]
    for g in range(1, groups):
        views += [slots[g], tables[:, g]]
    return tuple(views)


def layout_graph_decode(batch: InputBatch, decodes: list, size: int, rows: int, width: int, block_size: int,
                        tables: BlockTables | None = None, groups: int = 1
                        ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata | list[AttentionMetadata]] | None:
    """A pure-decode step laid out in graph_region's places, padded to `size` rows (a decode graph's bucket):
    rows past the batch repeat row 0 exactly (its token, position, slots, length and tables, so a padding row
    writes only row 0's slots), tables zero past the longest row's blocks. Returns (input_ids, positions,
    metadata) of `size` rows: one AttentionMetadata, or with several KV groups a list of each group's, every
    group's rows whole from block 0 (a sliding group's too: its backend starts at the window itself, and the
    released entries before it are never read); or None when a table needs more than `width` blocks (the
    step is laid out by layout_step instead). Uploads (3 + groups) * rows + size * groups * width values.
    tables: as layout_step's (columns past a sequence's blocks are not read).
    No decodes (a graph captured ahead of any step): every row reads and writes slot 0 of block 0, length 1."""
    bs, batch_size = block_size, len(decodes)
    pos = np.fromiter((s.num_computed_tokens for s, _ in decodes), dtype=np.int64, count=batch_size)
    if batch_size and int(pos.max()) // bs >= width:
        return None
    batch.begin(graph_region_size(rows, width, groups))
    columns = [batch.take(rows) for _ in range(3 + groups)]  # ids, positions, slots 0, lens, slots 1..
    ids, positions, _, lens = (c[1][:size] for c in columns[:4])
    slots = [columns[2]] + columns[4:]
    tables_at, flat = batch.take(size * groups * width)
    step_tables = flat.reshape(size, groups, width)
    ids[:batch_size] = [s.token_ids[s.num_computed_tokens] for s, _ in decodes]
    positions[:batch_size] = pos
    if batch.rope_shift is not None:
        batch.rope_shift(positions[:batch_size], decodes)
    lens[:batch_size] = pos + 1
    if not batch_size:
        for column in (ids, positions):
            column.fill(0)
        lens.fill(1)
    for column in (ids, positions, lens):
        column[batch_size:] = column[0]
    metas = []
    device_tables = batch.view(tables_at, size, groups, width)
    for g, (slots_at, group_slots) in enumerate(slots):
        _decode_rows(decodes, pos, step_tables[:, g], group_slots[:size], g, bs, tables)
        metas.append(AttentionMetadata(batch.view(slots_at, size), size, device_tables[:, g],
                                       batch.view(3 * rows, size), None, []))
    batch.upload()
    return batch.view(0, size), batch.view(rows, size), metas[0] if groups == 1 else metas


def _decode_rows(decodes: list, pos: np.ndarray, step_tables: np.ndarray, slots: np.ndarray, group: int, bs: int,
                 tables: BlockTables | None) -> None:
    """One KV group's tables and slots of a graph's decode step (layout_graph_decode), padding rows included."""
    batch_size = len(decodes)
    if batch_size:  # the columns the longest row reads; zeros after them
        need = int(pos.max()) // bs + 1
        gather(tables, step_tables[:batch_size, :need], [s for s, _ in decodes], group)
        step_tables[:batch_size, need:] = 0
        slots[:batch_size] = step_tables[np.arange(batch_size), pos // bs] * bs + pos % bs
    else:
        step_tables.fill(0)
        slots.fill(0)
    slots[batch_size:] = slots[0]
    step_tables[batch_size:] = step_tables[0]


def mixed_region_size(tokens: int, seqs: int, width: int, groups: int = 1) -> int:
    return (2 + groups) * tokens + 2 * seqs + 1 + seqs * groups * width


def mixed_region(batch: InputBatch, tokens: int, seqs: int, width: int, groups: int = 1) -> tuple[torch.Tensor, ...]:
    """The mixed-step graphs' inputs, views at fixed offsets of the batch's device buffer: (input_ids [tokens],
    positions [tokens], slot_mapping [tokens], seq_lens [seqs], query_start_loc [seqs + 1], block_tables
    [seqs, width]) of the first KV group, then (slot_mapping, block_tables) of each other group (the tables
    interleaved by row, [seqs, groups, width], as graph_region's); layout_graph_mixed writes a step there.
    Valid until the batch reallocates."""
    if batch.capacity < mixed_region_size(tokens, seqs, width, groups):
        raise ValueError(f"the input batch holds {batch.capacity} values, the mixed graph region needs more")
    t, s = tokens, seqs
    tables = batch.view((2 + groups) * t + 2 * s + 1, s, groups, width)
    views = [batch.view(0, t), batch.view(t, t), batch.view(2 * t, t), batch.view(3 * t, s),
             batch.view(3 * t + s, s + 1), tables[:, 0]]
    for g in range(1, groups):
        views += [batch.view((2 + g) * t + 2 * s + 1, t), tables[:, g]]
    return tuple(views)


def padding_runs(pad: int, spare: int, span: int) -> list[int] | None:
    """The padding tokens' sequences: runs of at most `span` tokens (what a table row addresses), one per spare
    sequence row; None when `spare` rows cannot hold them."""
    runs = [span] * (pad // span) + ([pad % span] if pad % span else [])
    return runs if len(runs) <= spare else None


def layout_graph_mixed(batch: InputBatch, decodes: list, prefills: list, num_tokens: int, size: int, tokens: int,
                       seqs: int, width: int, block_size: int, tables: BlockTables | None = None, groups: int = 1
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata | list[AttentionMetadata]] | None:
    """A step (decodes first, then prefill chunks, as layout_step orders them) laid out packed in mixed_region's
    places (`tokens` by `seqs` rows of `width` blocks), padded to `size` tokens: the padding tokens (id 0,
    position 0, slot -1: their K/V are not written) form sequences of their own after the step's (context 0,
    tables all block 0, at most width * block_size tokens each); the rows after those have no query and length
    0. Returns (input_ids, positions, metadata) of `size` tokens whose metadata is packed
    (attention.PackedSeqs): one AttentionMetadata, or with several KV groups a list of each group's (its slots
    and tables, every row whole from block 0, as layout_graph_decode's); or None when the rows, a table's width
    or the padding do not fit (the step is laid out by layout_step instead). Uploads the region up to the last
    table row used. No decodes and no prefills (a graph captured ahead of any step): every token is padding.
    tables: as layout_step's (columns past a sequence's blocks are not read)."""
    bs, scheduled = block_size, [*decodes, *prefills]
    num_real, pad = len(scheduled), size - num_tokens
    counts = np.fromiter((n for _, n in scheduled), dtype=np.int64, count=num_real)
    ends = np.fromiter((s.num_computed_tokens + n for s, n in scheduled), dtype=np.int64, count=num_real)
    runs = padding_runs(pad, seqs - num_real, width * bs)
    if runs is None or (num_real and int(ends.max()) > width * bs) or size > tokens:
        return None
    used_rows = num_real + len(runs)
    batch.begin(mixed_region_size(tokens, seqs, width, groups))
    ids_at, ids = batch.take(tokens)
    pos_at, positions = batch.take(tokens)
    slots = [batch.take(tokens)]
    lens_at, lens = batch.take(seqs)
    qsl_at, qsl = batch.take(seqs + 1)
    slots += [batch.take(tokens) for _ in range(1, groups)]
    tables_at, flat = batch.take(used_rows * groups * width)
    step_tables = flat.reshape(used_rows, groups, width)
    need = -(-int(ends.max()) // bs) if num_real else 0  # the columns the longest sequence reads
    step_tables[num_real:] = 0
    _write_tokens(decodes, prefills, ids, positions)
    ids[num_tokens:size] = 0
    positions[num_tokens:size] = 0
    rows_of_tokens = np.repeat(np.arange(num_real), counts)
    pos = positions[:num_tokens]
    for g, (_, group_slots) in enumerate(slots):
        if num_real:
            gather(tables, step_tables[:num_real, g, :need], [s for s, _ in scheduled], g)
        step_tables[:num_real, g, need:] = 0
        group_slots[:num_tokens] = step_tables[rows_of_tokens, g, pos // bs] * bs + pos % bs
        group_slots[num_tokens:size] = -1
    if batch.rope_shift is not None:
        batch.rope_shift(pos, scheduled)
    lens[:num_real] = ends
    lens[num_real:used_rows] = runs
    lens[used_rows:] = 0
    qsl[0] = 0
    np.cumsum(np.concatenate([counts, np.asarray(runs, dtype=np.int64)]), out=qsl[1:used_rows + 1])
    qsl[used_rows + 1:] = size
    batch.upload()
    device_tables = batch.view(tables_at, seqs, groups, width)
    metas = [AttentionMetadata(batch.view(slots_at, size), 0, None, None, None, [], packed=PackedSeqs(
        batch.view(qsl_at, seqs + 1), batch.view(lens_at, seqs), device_tables[:, g]))
        for g, (slots_at, _) in enumerate(slots)]
    return batch.view(ids_at, size), batch.view(pos_at, size), metas[0] if groups == 1 else metas
