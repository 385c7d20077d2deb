"""Every request's block tables as rows of persistent arrays (issue 37 item 1: block tables updated in place
from each step's delta; the idea of vLLM v1's BlockTable, our own code).

A request the worker knows (request_states.RequestStates) owns one row (`RequestState.table_row`) of one
int64 array per KV group; the row holds the request's block ids in order and 0 after them. RequestStates
writes the row as the scheduler's delta changes the table (a new request, blocks appended, a block replaced,
a table replaced whole, a fork's copy of its parent), so a step's layout (input_batch.py) gathers all its
rows in one numpy op instead of copying each request's Python list (~0.5 us a row: ~0.1 ms of a 256-row
step, per group and per table).

`gather` is the one rule a layout reads a table by: columns first..first+width of each row. A column past
the blocks a step uses may hold a later block of the same request (allocated ahead) or 0: the kernels read
only the blocks a sequence's length covers. States without a row (bench quality's teacher-forced windows,
tests that lay out states of their own) are copied from their lists, the same columns.

Invariants: a row's columns [0, len(table)) equal the state's table, the rest 0; a dropped request's row is
zeroed and reused. Threads: the owner's (the model runner's torch thread).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockTables:
    """Rows of block ids, one array per KV group, grown (rows and columns to the next power of two) when a
    request or a table outgrows them."""

    def __init__(self, rows: int = 64, width: int = 32) -> None:
        self._rows, self._width = rows, width
        self._arrays: list[np.ndarray] = []  # one [rows, width] per KV group, made as groups appear
        self._free: list[int] = []
        self._next = 0  # rows [0, _next) have been handed out (some returned to _free)

    @property
    def width(self) -> int:
        return self._width

    def array(self, group: int) -> np.ndarray:
        self._groups(group + 1)
        return self._arrays[group]

    def reserve(self, width: int) -> None:
        """Columns up to `width` (a layout reads that many)."""
        self._grow(1, width)

    def _groups(self, count: int) -> None:
        while len(self._arrays) < count:
            self._arrays.append(np.zeros((self._rows, self._width), dtype=np.int64))

    def _grow(self, rows: int, width: int) -> None:
        if rows <= self._rows and width <= self._width:
            return
        new_rows = max(self._rows, 1 << (rows - 1).bit_length())
        new_width = max(self._width, 1 << (width - 1).bit_length())
        for g, old in enumerate(self._arrays):
            array = np.zeros((new_rows, new_width), dtype=np.int64)
            array[:self._rows, :self._width] = old
            self._arrays[g] = array
        self._rows, self._width = new_rows, new_width

    # ---- kept in step with the deltas (RequestStates) -----------------------------------------------
    def assign(self, state) -> None:
        """A row for a new request, holding its tables."""
        if self._free:
            row = self._free.pop()
        else:
            row, self._next = self._next, self._next + 1
            self._grow(self._next, 1)
        state.table_row = row
        self.write(state)

    def write(self, state) -> None:
        """The state's tables written whole (a new request, or the scheduler replaced them)."""
        tables = [state.block_ids, *state.group_block_ids]
        self._groups(len(tables))
        self._grow(1, max(map(len, tables)))
        row = state.table_row
        for array, table in zip(self._arrays, tables):
            array[row, :len(table)] = table
            array[row, len(table):] = 0

    def set(self, state, group: int, index: int, block_id: int) -> None:
        self._arrays[group][state.table_row, index] = block_id

    def extend(self, state, group: int, start: int, block_ids: Sequence[int]) -> None:
        """block_ids appended to the group's table, which held `start` blocks before them."""
        if block_ids:
            self._grow(1, start + len(block_ids))
            self._arrays[group][state.table_row, start:start + len(block_ids)] = block_ids

    def release(self, state) -> None:
        row = state.table_row
        if row >= 0:
            for array in self._arrays:
                array[row] = 0
            self._free.append(row)
            state.table_row = -1

    def clear(self) -> None:
        for array in self._arrays:
            array.fill(0)
        self._free.clear()
        self._next = 0


def gather(tables: BlockTables | None, out: np.ndarray, states: Sequence, group: int,
           first: np.ndarray | None = None) -> None:
    """Columns first..first + width of each state's table of `group` into out [len(states), width] (first: per
    state, None: 0), a column past the table's end 0: one op where every state has a row of `tables`, else
    each state's list copied (tables None, or a state without a row)."""
    width = out.shape[1]
    rows = np.fromiter((getattr(s, "table_row", -1) for s in states), dtype=np.int64, count=len(states))
    if tables is not None and len(rows) and rows.min() >= 0:
        if first is None:
            tables.reserve(width)
            np.take(tables.array(group)[:, :width], rows, axis=0, out=out)
        else:
            tables.reserve(int(first.max()) + width)
            out[:] = tables.array(group)[rows[:, None], first[:, None] + np.arange(width)]
        return
    out.fill(0)
    for i, state in enumerate(states):
        table = state.block_ids if group == 0 else state.group_block_ids[group - 1]
        begin = 0 if first is None else int(first[i])
        used = table[begin:begin + width]
        out[i, :len(used)] = used
