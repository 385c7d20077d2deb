"""Repetition, presence and frequency penalties on a step's logits rows: one rule, two forms.

repetition_penalty divides a positive logit (multiplies a negative one) of every token the row's prompt or
outputs hold, as transformers' RepetitionPenaltyLogitsProcessor; then presence_penalty is subtracted once
from each token its outputs hold and frequency_penalty once per occurrence, as OpenAI's. A row's histories
come from its rows of the model runner's PenaltyCounts table (penalty_counts.py) or from its token lists.
On a device the arithmetic runs over the whole [rows, vocabulary] (no host read); on the CPU the same float32
operations in the same order run on each row's seen tokens alone (the same values, bit for bit).

Threads: the worker's torch thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.worker.device_rows import put_rows, row_index, take_rows, to_device
from pagedserve.worker.penalty_counts import PenaltyCounts


class RowSampling(Protocol):
    """What a sampler row (sampler.RowSampling) gives the penalties."""
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    counts_row: int
    extra_output_ids: Sequence[int]


def _counts(lists: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(lists), vocab] occurrence counts."""
    width = max(map(len, lists), default=0)
    # Padding points at an extra column that is dropped, so ragged lists need no mask.
    ids = to_device([[*ids, *[vocab] * (width - len(ids))] for ids in lists],
                    torch.long, device).reshape(len(lists), width)
    counts = torch.zeros(len(lists), vocab + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, device=device))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, rows: list[RowSampling], counts: PenaltyCounts | None = None,
                    sparse: bool | None = None) -> None:
    """Applies repetition, presence and frequency penalties in place, only on the rows that ask. counts: the
    rows' histories are their rows there (RowSampling.counts_row), else their token lists. sparse (None: on
    the CPU): the arithmetic on each row's seen tokens alone (_apply_penalties_sparse), else over the whole
    vocabulary on the device (no host read); the same values either way."""
    idx = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    if not idx:
        return
    dev, vocab = logits.device, logits.shape[1]
    sel = [rows[i].params for i in idx]
    index = row_index(idx, logits.shape[0], dev)
    x = take_rows(logits, index)
    if dev.type == "cpu" if sparse is None else sparse:
        _apply_penalties_sparse(x, [rows[i] for i in idx], counts)
        if index is not None:
            put_rows(logits, index, x)
        return
    repetition = any(p.repetition_penalty != 1.0 for p in sel)
    if counts is not None:
        out, seen = counts.histories([rows[i].counts_row for i in idx], [rows[i].extra_output_ids for i in idx],
                                     repetition)
    else:
        out = _counts([rows[i].output_token_ids for i in idx], vocab, dev)
        seen = _counts([rows[i].prompt_token_ids for i in idx], vocab, dev).add_(out) > 0 if repetition else None
    if repetition:
        rep = to_device([p.repetition_penalty for p in sel], torch.float32, dev)[:, None]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    pres = to_device([p.presence_penalty for p in sel], torch.float32, dev)[:, None]
    freq = to_device([p.frequency_penalty for p in sel], torch.float32, dev)[:, None]
    put_rows(logits, index, x - pres * (out > 0) - freq * out)


def _cpu_ops():
    from pagedserve.kernels import cpu_ops
    return cpu_ops.load()


def _apply_penalties_sparse(x: torch.Tensor, rows: list[RowSampling], counts: PenaltyCounts | None,
                            compiled: bool = True) -> None:
    """apply_penalties' arithmetic on the CPU, in place on x [len(rows), V] (float32), over each row's seen
    tokens only: its outputs' counts and its prompt's tokens (from its table rows, one pass over the vocabulary
    each, or from its lists), the same float32 operations in the same order as the dense form, so the same
    values. 256 rows x 49,152 tokens: ~15 passes over the whole table (a few hundred ms on 2 cores) become a
    few gathers a row. Rows read from the table (and without a verifying row's extra tokens) take one
    compiled pass each instead (compiled: where the CPU kernels are built; the same values)."""
    ops = _cpu_ops() if compiled and counts is not None and x.dtype == torch.float32 and x.is_contiguous() else None
    if ops is not None:  # the table's rows, one compiled pass a row (logits_ops.cpp penalize_rows)
        table = [j for j, r in enumerate(rows) if not r.extra_output_ids]
        if table:
            picked = [rows[j] for j in table]
            ops.penalize_rows(x, torch.tensor(table, dtype=torch.long), counts.output, counts.prompt,
                              torch.tensor([r.counts_row for r in picked], dtype=torch.long),
                              torch.tensor([r.params.repetition_penalty for r in picked], dtype=torch.float32),
                              torch.tensor([r.params.presence_penalty for r in picked], dtype=torch.float32),
                              torch.tensor([r.params.frequency_penalty for r in picked], dtype=torch.float32))
            if len(table) == len(rows):
                return
            done = set(table)
            rest = [j for j in range(len(rows)) if j not in done]
            sub = x[rest]
            _apply_penalties_sparse(sub, [rows[j] for j in rest], counts, compiled=False)
            x[rest] = sub
            return
    xn, vocab = x.numpy(), x.shape[1]
    for row, r in zip(xn, rows):
        p = r.params
        out_ids, out_counts = _seen_outputs(r, counts, vocab)
        if p.repetition_penalty != 1.0:
            if counts is not None:
                prompt = np.flatnonzero(counts.prompt[r.counts_row].numpy())
            else:
                prompt = np.asarray(r.prompt_token_ids, dtype=np.int64)
                prompt = prompt[prompt < vocab]
            seen = np.union1d(prompt, out_ids)
            values, rep = row[seen], np.float32(p.repetition_penalty)
            row[seen] = np.where(values > 0, values / rep, values * rep)
        if len(out_ids) and (p.presence_penalty or p.frequency_penalty):
            presence, frequency = np.float32(p.presence_penalty), np.float32(p.frequency_penalty)
            row[out_ids] = (row[out_ids] - presence) - frequency * out_counts


def _seen_outputs(r: RowSampling, counts: PenaltyCounts | None, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """A row's distinct output tokens and their counts (float32): its table row's (plus its extra tokens), or
    its list's."""
    if counts is None:
        ids = np.asarray(r.output_token_ids, dtype=np.int64)
        ids, n = np.unique(ids[ids < vocab], return_counts=True)
        return ids, n.astype(np.float32)
    table = counts.output[r.counts_row].numpy()
    if r.extra_output_ids:
        table = table.copy()
        extra = np.asarray(r.extra_output_ids, dtype=np.int64)
        np.add.at(table, extra[extra < vocab], 1.0)
    ids = np.flatnonzero(table)
    return ids, table[ids]
