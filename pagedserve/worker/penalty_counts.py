"""The token histories that penalties read, kept on the device between steps (issue 37: no per-step work that
grows with a request's length).

repetition_penalty reads which tokens a request's prompt and outputs hold; presence and frequency penalties
count its outputs. Built from the token lists every step, a batch of 256 rows with 1,000 outputs each cost
~19 ms of host time a step (a padded list of lists made a tensor, on a 2-core Xeon), then a zeroed
[rows, vocabulary] scatter, for prompts and outputs both. Here each request state that samples with
penalties owns a row of two tables, `output` (float32 counts of its output tokens) and `prompt` (its
prompt's tokens, bool), and a step adds only the tokens its state gained since the last: a row that
samples exactly its next token adds it on the device as it is sampled (`add_sampled`: so a step begun
before those tokens reach the host reads them, and penalised rows keep async scheduling's overlap), the
others (a verified row's accepted proposals, a fork) from their lists at the next sync. The host's work is
per new token, the device's a gather of the rows.

Rows follow the states by identity: a state seen for the first time (new, forked, or recomputed after a
preemption: a new object) gets a fresh row filled from its lists once; a row whose state does not sample
with penalties in a step is freed (it is rebuilt if that state samples again). Invariant after `sync`: for
each given state, output[row] counts token_ids[num_prompt_tokens:] (a held place: the token the step in
flight samples there, added by that step's add_sampled) and prompt[row] marks token_ids[:num_prompt_tokens].

Threads: the model runner's torch thread only.
"""

from __future__ import annotations

from itertools import chain, repeat

import numpy as np
import torch

from pagedserve.worker.device_rows import to_device
from pagedserve.worker.request_states import RequestState


class PenaltyCounts:
    """Per-state rows of output-token counts and prompt-token marks, on the sampler's device."""

    def __init__(self, vocab: int, device: torch.device, rows: int = 8) -> None:
        self.vocab = vocab
        self.device = device
        self.output = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        self.prompt = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
        self.owners: list[RequestState | None] = [None] * rows
        self.counted = [0] * rows  # output tokens of its owner already in a row
        self.row_of: dict[int, int] = {}  # id(state) -> its row

    def sync(self, states: list[RequestState]) -> list[int]:
        """Each state's row (in order), written up to its token ids; rows of states not given are freed."""
        live = {id(s) for s in states}
        for key in [k for k in self.row_of if k not in live]:
            self.owners[self.row_of.pop(key)] = None
        fresh, rows = [], []
        for state in states:
            row = self.row_of.get(id(state))
            if row is None:
                row = self._take_row(state)
                fresh.append(row)
            rows.append(row)
        if fresh:
            index = to_device(fresh, torch.long, self.device)
            self.output.index_fill_(0, index, 0.0)
            self.prompt.index_fill_(0, index, False)
            self._mark(self.prompt, [(r, self.owners[r].token_ids[:self.owners[r].num_prompt_tokens]) for r in fresh])
        new_tokens = []
        for state, row in zip(states, rows):
            end = len(state.token_ids) if state.held_at < 0 else state.held_at
            start = state.num_prompt_tokens + self.counted[row]
            if end > start:
                new_tokens.append((row, state.token_ids[start:end]))
                self.counted[row] = end - state.num_prompt_tokens
        self._mark(self.output, new_tokens)
        return rows

    def add_sampled(self, rows: list[int], sampled: torch.Tensor, sampler_rows: list[int]) -> None:
        """Each row's state samples exactly its next token at sampler row sampler_rows[i] of `sampled` (the
        step's ids, on the device): counted now, on the device, so that a step begun before this one's
        tokens reach the host (async scheduling: its place held) reads them; the next sync skips them."""
        if not rows:
            return
        ids = sampled.index_select(0, to_device(sampler_rows, torch.long, self.device)).to(torch.long)
        flat = to_device(rows, torch.long, self.device) * self.vocab + ids.clamp_(0, self.vocab - 1)
        self.output.view(-1).index_put_((flat,), torch.ones((), device=self.device).expand(len(rows)),
                                        accumulate=True)
        for row in rows:
            self.counted[row] += 1

    def histories(self, rows: list[int], extra: list[list[int]],
                  with_prompt: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampler rows' output counts [R, V] (their state's row plus its extra tokens: a verifying row's
        proposals before it), and with_prompt: the tokens their prompt or outputs hold [R, V] bool."""
        index = to_device(rows, torch.long, self.device)
        out = self.output.index_select(0, index)
        self._mark(out, list(enumerate(extra)))
        if not with_prompt:
            return out, None
        return out, self.prompt.index_select(0, index) | (out > 0)

    def _take_row(self, state: RequestState) -> int:
        try:
            row = self.owners.index(None)
        except ValueError:  # every row taken: twice as many
            row = len(self.owners)
            self.output = torch.cat([self.output, torch.zeros_like(self.output)])
            self.prompt = torch.cat([self.prompt, torch.zeros_like(self.prompt)])
            self.owners += [None] * row
            self.counted += [0] * row
        self.owners[row] = state
        self.counted[row] = 0
        self.row_of[id(state)] = row
        return row

    def _mark(self, table: torch.Tensor, pairs: list[tuple[int, list[int]]]) -> None:
        """Adds one at (row, token) for every token of each (row, tokens), in place: counts in a float table,
        True in a bool one. Tokens past the vocabulary are left out."""
        pairs = [(r, t) for r, t in pairs if t]
        if not pairs:
            return
        sizes = [len(t) for _, t in pairs]
        tokens = np.fromiter(chain.from_iterable(t for _, t in pairs), np.int64, sum(sizes))
        rows = np.fromiter(chain.from_iterable(repeat(r, n) for (r, _), n in zip(pairs, sizes)), np.int64, len(tokens))
        inside = tokens < self.vocab
        if not inside.all():
            tokens, rows = tokens[inside], rows[inside]
        flat = to_device(rows * self.vocab + tokens, torch.long, self.device)
        view = table.view(-1)
        if table.dtype == torch.bool:
            view.index_fill_(0, flat, True)
        else:
            view.index_put_((flat,), torch.ones((), dtype=table.dtype, device=self.device).expand(flat.shape[0]),
                            accumulate=True)
