"""The draft model of speculative decoding (`--speculative-config {"method": "draft_model",
"model": ..., "num_speculative_tokens": k}`), on the worker beside the target.

The flow: the worker drafts at the start of the step that verifies. The scheduler decides, as it
does for n-gram, which decode rows speculate and with how many tokens (the step's token budget,
blocks for the lookahead slots, max_tokens, each request's backoff) and sends that many
placeholder ids per row (scheduler/core/speculation.py). Before the target runs the step, `run`
makes the draft's proposals and puts them in place of the placeholders; the target then verifies
them in the same step (spec_verify.py) and only the kept tokens go back. Why not vLLM v1's order
(propose after sampling, for the next step, returned with the step's output): here the scheduler
has already budgeted and allocated the lookahead when the proposals are made, so no proposal is
made for a row the next step leaves out (preempted, finished, out of budget, an ahead step of
async scheduling), nothing but kept tokens crosses the wire, and the scheduler's n-gram paths
(rollback, counters, stop rules, backoff) serve both methods unchanged. The cost: a step's
draft passes run before its verification, not overlapped with anything.

The draft's KV cache has its own shape (the draft's layers and heads) and the target's number of
blocks and block size, and is addressed by the same block tables and slots (the target's first
KV group: full attention, the draft has one group): the scheduler's one block manager manages
both, and the worker runs every block operation (swap out/in, copy-on-write) on both. Its memory
is part of the KV budget (size_kv_cache counts a block's bytes in both caches).

Invariant: after every step, wherever the target's cache holds a position's K/V, the draft's
holds the draft's K/V of the same token; so a prefix-cache hit, a swapped-in or recomputed
request finds its draft K/V too. `run` keeps it by running exactly the positions the target runs:
  pass 1: every row of the step as the target runs it (prompt chunks, plain decodes), except that
          a speculating row runs only its first position c (its last known token); the draft's
          argmax there is proposal d1;
  pass j+1 (j = 1..k): each row with k >= j runs d_j at position c + j, and its argmax is d_{j+1}
          while j < k (the last pass only writes d_k's K/V).
So the draft writes positions c .. c + k, those the target verifies, and the rejected ones are
taken back with the target's (num_computed_tokens) and written over by the next step.

Exactness: the proposals are the draft's greedy tokens, a one-hot draft distribution, which the
verifier handles as it handles n-gram's (spec_verify.py): greedy output is the target's argmax
sequence, sampled output keeps the target's distribution, whatever the draft proposes.

Tensor parallelism: only rank 0 holds a draft, unsharded (built and run in a group of one rank);
the other ranks take its proposals from one broadcast (ModelRunner._draft) and hold no draft
cache, so rank 0's KV budget is the smallest and the scheduler's (the least of the ranks') fits it.

Threads: the worker's torch thread only.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.worker.input_batch import layout_step
from pagedserve.worker.kv_cache import bytes_per_block
from pagedserve.worker.process_group import using_group
from pagedserve.worker.request_states import RequestState


class DraftModel:
    """The draft: its own ModelRunner (built unsharded by ModelRunner.enable_draft), of which it
    uses the model, the KV cache and the input batch, never the request states (it reads the
    target's)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.num_passes = 0  # forward passes run, for the logs and tests

    def block_bytes(self, block_size: int) -> int:
        """One block's bytes in the draft's cache."""
        r = self.runner
        return bytes_per_block(r.config, block_size, r.dtype, 1)

    def allocate(self, num_blocks: int, num_host_blocks: int) -> None:
        self.runner.kv = None  # the old pool goes before the new one is made
        self.runner.allocate_kv_cache(num_blocks, num_host_blocks)

    def block_ops(self, step) -> None:
        """The step's swaps and copies, as on the target's cache (same block ids)."""
        self.runner.kv_block_ops(step)

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[RequestState, int]]) -> None:
        """Run the step's positions through the draft (module docstring) and fill in each
        speculating row's spec_token_ids. scheduled: (state, tokens) of every row of the step."""
        with using_group(self.runner.tp):
            spec = [s for s, _ in scheduled if s.spec_token_ids]
            decodes = [(s, 1) for s, n in scheduled if n == 1 or s.spec_token_ids]
            prefills = [(s, n) for s, n in scheduled if n > 1 and not s.spec_token_ids]
            hidden = self._forward(decodes, prefills)
            if not spec:
                return
            rows = [i for i, (s, _) in enumerate(decodes) if s.spec_token_ids]
            drafted = [[token] for token in self._greedy(hidden, rows)]
            ks = [len(s.spec_token_ids) for s in spec]
            for j in range(1, max(ks) + 1):
                live = [i for i, k in enumerate(ks) if k >= j]
                positions = np.array([spec[i].num_computed_tokens + j for i in live], dtype=np.int64)
                ids = [drafted[i][j - 1] for i in live]
                hidden = self._forward([(spec[i], 1) for i in live], [], positions, ids)
                wanted = [row for row, i in enumerate(live) if ks[i] > j]
                for row, token in zip(wanted, self._greedy(hidden, wanted)):
                    drafted[live[row]].append(token)
            for state, tokens in zip(spec, drafted):
                state.spec_token_ids = tokens

    def _forward(self, decodes, prefills, positions: np.ndarray | None = None, ids: list[int] | None = None):
        """The draft's hidden states of a batch laid out as the target's (decodes, then prefill
        chunks); positions and ids: given decode rows' (the passes after the first)."""
        r = self.runner
        num_tokens = len(decodes) + sum(n for _, n in prefills)
        input_ids, pos, metas = layout_step(r.input_batch, decodes, prefills, num_tokens, r.kv.groups,
                                            r.block_size, positions)
        if ids is not None:
            input_ids = torch.tensor(ids, dtype=torch.long, device=r.device)
        self.num_passes += 1
        return r.model(input_ids, pos, r.kv.model_caches(), metas[0])

    def _greedy(self, hidden: torch.Tensor, rows: list[int]) -> list[int]:
        """The draft's argmax token at these rows of hidden."""
        if not rows:
            return []
        r = self.runner
        logits = r.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)])
        return logits.argmax(dim=-1).tolist()
