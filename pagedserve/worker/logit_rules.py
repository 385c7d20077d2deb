"""The rules that change a batch's logits before the draw, each in place and each paying nothing
for the rows without it: logit_bias, vLLM's allowed_token_ids and bad words, min_tokens (eos and stop
ids held back), and the grammar masks of structured outputs (applied last by the sampler, so that
a bias cannot revive a token the grammar forbids). The sampler (sampler.py) calls them in its order.

Threads: the worker's torch thread only (AllowedIds' cache included).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import chain, repeat
from typing import Protocol

import numpy as np
import torch

from pagedserve.common import bad_words
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.worker.device_rows import to_device
from pagedserve.worker.structured_output import TokenMasks, forbidden_tokens, forbidden_tokens_torch

_NEG_INF = float("-inf")


class Row(Protocol):
    """What a sampler row (sampler.RowSampling) gives these rules."""
    params: SamplingParams
    output_token_ids: Sequence[int]
    eos_token_ids: tuple[int, ...]


def min_tokens_pending(r: Row) -> bool:
    return len(r.output_token_ids) < r.params.min_tokens


def block_min_tokens(logits: torch.Tensor, rows: list[Row]) -> None:
    """Sets eos (unless ignore_eos) and stop ids to -inf, in place, for rows still under min_tokens."""
    vocab = logits.shape[1]
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, r in enumerate(rows):
        if min_tokens_pending(r):
            ids = set(r.params.stop_token_ids)
            if not r.params.ignore_eos:
                ids.update(r.eos_token_ids)
            ids = [t for t in ids if t < vocab]
            row_idx += [i] * len(ids)
            tok_idx += ids
    if row_idx:
        dev = logits.device
        logits[to_device(row_idx, torch.long, dev), to_device(tok_idx, torch.long, dev)] = _NEG_INF


def apply_logit_bias(logits: torch.Tensor, rows: list[Row]) -> None:
    """Adds each row's logit_bias in place: one accumulate index_put for all rows that have one.
    Each row's entries become tensors whole (no Python step per entry: a step costs per row)."""
    biased = [(i, r.params.logit_bias) for i, r in enumerate(rows) if r.params.logit_bias]
    if not biased:
        return
    # Built by C-level iteration (chain, repeat); no masked indexing (slow on a busy CPU): an id
    # past the vocabulary (a padded one) adds 0 to token 0 instead.
    tokens = torch.tensor(list(chain.from_iterable(bias for _, bias in biased)), dtype=torch.long)
    values = torch.tensor(list(chain.from_iterable(bias.values() for _, bias in biased)), dtype=logits.dtype)
    row_idx = torch.tensor(list(chain.from_iterable(repeat(i, len(bias)) for i, bias in biased)), dtype=torch.long)
    if max(map(max, (bias for _, bias in biased))) >= logits.shape[1]:  # C-level, no tensor read
        inside = tokens < logits.shape[1]
        values = torch.where(inside, values, torch.zeros((), dtype=values.dtype))
        tokens = torch.where(inside, tokens, torch.zeros((), dtype=tokens.dtype))
    dev = logits.device
    if dev.type == "cuda":
        row_idx, tokens, values = (t.pin_memory().to(dev, non_blocking=True) for t in (row_idx, tokens, values))
    logits.index_put_((row_idx, tokens), values, accumulate=True)


class AllowedIds:
    """The index tensors of the rows' allowed_token_ids, made once per request (a list may hold a
    vocabulary's worth of ids: building it every step would slow every row of the batch), kept for
    the most recent MAX requests. Keyed by the list object, which a request keeps for its life."""

    MAX = 256

    def __init__(self) -> None:
        self._cache: OrderedDict[int, tuple[list[int], torch.Tensor]] = OrderedDict()

    def get(self, ids: list[int], vocab: int, device: torch.device) -> torch.Tensor:
        hit = self._cache.get(id(ids))
        if hit is not None and hit[0] is ids and hit[1].device == device:
            self._cache.move_to_end(id(ids))
            return hit[1]
        tensor = to_device([t for t in ids if t < vocab], torch.long, device)
        self._cache[id(ids)] = (ids, tensor)
        while len(self._cache) > self.MAX:
            self._cache.popitem(last=False)
        return tensor


def mask_tokens(logits: torch.Tensor, rows: list[Row], allowed: AllowedIds | None = None) -> None:
    """vLLM's allowed_token_ids (every other token to -inf) and bad words (the tokens their sequences
    forbid after the row's output, common/bad_words.py), in place. A loop over the rows that have
    either (rare); each row's work is one gather and one scatter."""
    vocab, dev = logits.shape[1], logits.device
    allowed = allowed or AllowedIds()
    for i, r in enumerate(rows):
        p = r.params
        if p.allowed_token_ids is not None:
            ids = allowed.get(p.allowed_token_ids, vocab, dev)
            kept = logits[i, ids]
            logits[i].fill_(_NEG_INF)
            logits[i, ids] = kept
        if p.bad_words_token_ids:
            banned = [t for t in bad_words.forbidden(p.bad_words_token_ids, r.output_token_ids) if t < vocab]
            if banned:
                logits[i, to_device(banned, torch.long, dev)] = _NEG_INF


def apply_token_masks(x: torch.Tensor, raw: torch.Tensor, masks: TokenMasks) -> None:
    """Sets to -inf, in place, every token a row's grammar forbids. A row left with nothing (the
    grammar only allows eos while min_tokens blocks it) takes the grammar's choice over the
    model's raw logits: the grammar is complete, so the sequence ends.

    On the CPU this runs in numpy, on x's own memory: these few memory-bound passes gain nothing
    from torch's intra-op threads, and on a busy machine those threads cost ten times the work."""
    if x.device.type == "cpu":
        _apply_token_masks_numpy(x, raw, masks)
    else:
        _apply_token_masks_torch(x, raw, masks)


def _apply_token_masks_numpy(x: torch.Tensor, raw: torch.Tensor, masks: TokenMasks) -> None:
    xn, rows = x.numpy(), masks.rows.numpy()
    forbidden = forbidden_tokens(masks.bitmask, x.shape[1]).numpy()
    sub = xn[rows]
    np.putmask(sub, forbidden, _NEG_INF)
    dead = sub.max(-1) == _NEG_INF
    if dead.any():
        revived = raw.numpy()[rows[dead]]
        np.putmask(revived, forbidden[dead], _NEG_INF)
        sub[dead] = revived
    xn[rows] = sub


def _apply_token_masks_torch(x: torch.Tensor, raw: torch.Tensor, masks: TokenMasks) -> None:
    rows = masks.rows.to(x.device)
    forbidden = forbidden_tokens_torch(masks.bitmask.to(x.device), x.shape[1])
    sub = x.index_select(0, rows).masked_fill_(forbidden, _NEG_INF)
    dead = sub.amax(-1) == _NEG_INF  # no host read: a dead row takes its raw row, the others keep theirs
    revived = raw.index_select(0, rows).masked_fill_(forbidden, _NEG_INF)
    x.index_copy_(0, rows, torch.where(dead[:, None], revived, sub))
