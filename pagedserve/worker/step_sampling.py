"""A step's sampling in the model runner (ModelRunner._begin hands it the logits of the states that sample):
the sampler rows (one per logits row; k + 1 for a state verifying k proposals, each position as a plain step
would sample it: spec_verify.py; n for a state forking its n samples here), their settings, the grammars'
masks, the device-side sampling (sampler.py) with its one copy to the host started, and on result the tokens
each state takes from its rows (a verified row's accepted ones), its grammar advanced. With tensor
parallelism rank 0 samples and every rank takes the ids of its broadcast (StepSampling.share).

Threads: the model runner's torch thread only."""

from __future__ import annotations

import dataclasses

import torch

from pagedserve.common.messages import SampledToken
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.worker import spec_verify
from pagedserve.worker.process_group import broadcast_from_rank0, tp_group
from pagedserve.worker.penalty_counts import PenaltyCounts
from pagedserve.worker.request_states import RequestState
from pagedserve.worker.sampler import PendingSample, RowSampling, Sampler, SamplerOutput, plain_argmax, to_device
from pagedserve.worker.seeded_draws import stream_key
from pagedserve.worker.structured_output import GrammarMatchers, TokenMasks


def sample_key(params: SamplingParams, sample_index: int, num_output_tokens: int) -> int | None:
    """A seeded row's stream key, from (seed, sample, position) only: a seeded request draws the same
    tokens whatever shares its batch, and after a preemption or a worker restart too (seeded_draws.py)."""
    if params.seed is None or params.greedy:
        return None
    return stream_key(params.seed, sample_index, num_output_tokens)


@dataclasses.dataclass(slots=True)
class PendingTokens:
    """A step's sampling under way (Sampler.sample's PendingSample): result() waits for its one copy to the
    host and turns the rows into each state's tokens."""
    sampling: StepSampling
    states: list[RequestState]
    starts: list[int]
    sizes: list[int]
    constrained: list[int]
    pending: PendingSample

    def result(self) -> dict[str, list[SampledToken]]:
        return self.sampling.tokens(self.states, self.starts, self.sizes, self.constrained, self.pending.result())


class StepSampling:
    """The sampling half of the model runner: its sampler, the grammars' matchers, the eos ids, its device."""

    def __init__(self, sampler: Sampler, grammars: GrammarMatchers | None, eos_token_ids: tuple[int, ...],
                 device: torch.device) -> None:
        self.sampler = sampler
        self.grammars = grammars  # None: no request of this runner's asks for structured output (tests)
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.penalty_counts: PenaltyCounts | None = None  # made when a request first samples with penalties

    def sample(self, logits: torch.Tensor, states: list[RequestState]) -> PendingTokens:
        """The states' tokens sampled on the device, their copy to the host started (PendingTokens.result()
        waits for it). logits: one row per state, or k + 1 for a state with k proposals. Sampler rows: one
        per logits row, repeated n times for a state that forks its n samples here."""
        starts, sizes = sampler_rows(states)
        counted = self.penalty_rows(states, logits.shape[1])
        if all(map(plain_greedy, states)):  # the usual greedy batch: argmax, no per-row sampling settings built
            params = [state.params for state, size in zip(states, sizes) for _ in range(size)]
            return PendingTokens(self, states, starts, sizes, [], self.sampler.greedy(logits, params))
        rows, repeats = [], []  # repeats: per logits row
        eos = self.eos_token_ids
        for state, size in zip(states, sizes):
            params = state.params
            # Penalties read their state's row of the counts table; min_tokens reads how many outputs there are,
            # bad words how they end.
            row = counted.get(id(state), -1) if counted else -1
            outputs = state.token_ids[state.num_prompt_tokens:] if params.reads_outputs else ()
            if size == 1 and params.seed is None:  # the usual row: one sample, no key, no proposals
                rows.append(RowSampling(params, None, (), outputs, eos, row))
                repeats.append(1)
                continue
            num_outputs = len(state.token_ids) - state.num_prompt_tokens
            if state.spec_token_ids:  # each position as a plain step would sample it (spec_verify.py)
                spec = state.spec_token_ids
                for j in range(size):
                    rows.append(RowSampling(params, sample_key(params, state.sample_index, num_outputs + j),
                                            (), outputs + spec[:j] if outputs else (), eos,
                                            row, list(spec[:j]) if row >= 0 else ()))
                repeats += [1] * size
                continue
            indices = [state.sample_index] if size == 1 else range(size)  # a fork: samples 0..n-1 here
            for index in indices:
                rows.append(RowSampling(params, sample_key(params, index, num_outputs), (), outputs, eos, row))
            repeats.append(size)
        if any(r > 1 for r in repeats):
            logits = logits.repeat_interleave(to_device(repeats, torch.long, logits.device), dim=0,
                                              output_size=len(rows))  # known here: no device read
        constrained = [i for i, state in enumerate(states)  # (a row still in its reasoning samples freely)
                       if state.params.structured_output is not None and self.grammars.prepare(state)]
        masks = self.grammar_masks(states, starts, sizes, constrained) if constrained else None
        pending = self.sampler.sample(logits, rows, masks, self.penalty_counts)
        if counted:  # rows sampling exactly their next token count it on the device now (penalty_counts.py)
            plain = [(counted[id(state)], start) for state, start, size in zip(states, starts, sizes)
                     if id(state) in counted and size == 1 and not state.spec_token_ids]
            self.penalty_counts.add_sampled([r for r, _ in plain], pending.token_ids, [s for _, s in plain])
        return PendingTokens(self, states, starts, sizes, constrained, pending)

    def profile(self, logits: torch.Tensor) -> list[int]:
        """Sample logits' rows as the costliest sampled step would (the worker's memory profile: vLLM's dummy
        sampler run): every row sampled with a top_k past the candidates (the vocabulary sorted), top_p and
        min_p, the top 20 logprobs, every other row seeded (its draws a [rows, vocab] table), and penalties
        read from a table of its own. Returns the sampled ids."""
        vocab = logits.shape[1]
        counts = PenaltyCounts(vocab, logits.device, rows=logits.shape[0])
        states = [RequestState(f"profile-{i}", [i % vocab] * 2, 1, SamplingParams(), [], 0, 0, [], [])
                  for i in range(logits.shape[0])]
        table_rows = counts.sync(states)
        rows = [RowSampling(SamplingParams(temperature=0.8, top_k=vocab - 1, top_p=0.95, min_p=0.01, logprobs=20,
                                           repetition_penalty=1.1, frequency_penalty=0.1, seed=i if i % 2 else None),
                            sample_key(SamplingParams(temperature=0.8, seed=i), 0, 0) if i % 2 else None, [], [],
                            self.eos_token_ids, row) for i, row in enumerate(table_rows)]
        return self.sampler.sample(logits, rows, counts=counts).result().token_ids

    def penalty_rows(self, states: list[RequestState], vocab: int) -> dict[int, int]:
        """id(state) -> its row of the penalty counts, written up to its token ids, for the states that sample
        with penalties (the table made at the first; the rows of states that no longer do are freed)."""
        penalized = [state for state in states if state.params.needs_penalties]
        if not penalized and self.penalty_counts is None:
            return {}
        if self.penalty_counts is None:
            self.penalty_counts = PenaltyCounts(vocab, self.device)
        return dict(zip(map(id, penalized), self.penalty_counts.sync(penalized)))

    def tokens(self, states: list[RequestState], starts: list[int], sizes: list[int], constrained: list[int],
                out: SamplerOutput) -> dict[str, list[SampledToken]]:
        """Each state's sampled tokens from the sampler's rows (a verified row's accepted ones), its
        grammar advanced."""
        sampled = {}
        ids = out.token_ids
        for state, start, size in zip(states, starts, sizes):
            if size == 1 and out.logprobs is None:  # the usual row: one token, no logprobs (nor proposals)
                sampled[state.req_id] = [SampledToken(ids[start])]
                continue
            tokens = [SampledToken(ids[row], None if out.logprobs is None else out.logprobs[row],
                                   None if out.top_logprobs is None else out.top_logprobs[row])
                      for row in range(start, start + size)]
            sampled[state.req_id] = spec_verify.accept(tokens, state.spec_token_ids) if state.spec_token_ids else tokens
        for i in constrained:  # samples 2..n of a fork build their own matcher when they next sample
            self.grammars.advance(states[i].matcher, sampled[states[i].req_id][0].token_id)
        return sampled

    def grammar_masks(self, states: list[RequestState], starts: list[int], sizes: list[int],
                       constrained: list[int]) -> TokenMasks:
        """The constrained rows' bitmasks (their matchers built by GrammarMatchers.prepare, on a
        state's first sampling step from its outputs so far). starts, sizes: each state's first
        sampler row and its number of rows (a constrained state never carries proposals: the
        scheduler does not speculate for it)."""
        rows = [starts[i] + j for i in constrained for j in range(sizes[i])]
        row_of = [k for k, i in enumerate(constrained) for _ in range(sizes[i])]
        bitmask = self.grammars.fill([states[i].matcher for i in constrained], row_of)
        return TokenMasks(torch.tensor(rows, dtype=torch.long), bitmask)

    def share(self, pending: PendingTokens | None, states: list[RequestState]) -> PendingTokens:
        """Rank 0 samples; every rank needs the same ids, to feed the next step and keep its states. Rank 0
        broadcasts its sampler rows' ids on the device as the step begins (one small collective, at the
        same place of every rank's step: the ranks' collectives keep one order whatever steps are in
        flight, so a step may begin before the one before it is finished: step_overlap.py). The other
        ranks take their tokens from those rows as rank 0 does (a verified row's accepted ones), without
        logprobs; their next step's held rows read the ids on the device."""
        if tp_group().rank == 0:
            ids = pending.pending.token_ids
            assert ids.dtype == torch.int64 and ids.is_contiguous(), "the ranks' broadcast needs int64 rows"
            broadcast_from_rank0(ids)
            return pending
        starts, sizes = sampler_rows(states)
        ids = broadcast_from_rank0(torch.empty(sum(sizes), dtype=torch.int64, device=self.device))
        return PendingTokens(self, states, starts, sizes, [], PendingSample(ids, [], [], 0))


def plain_greedy(state: RequestState) -> bool:
    """Whether a state's sampler rows are plain argmaxes of its logits rows (sampler.plain_argmax), with no
    grammar and no forks (whose rows repeat the logits)."""
    return plain_argmax(state.params) and state.params.structured_output is None and not state.child_req_ids


def sampler_rows(states: list[RequestState]) -> tuple[list[int], list[int]]:
    """Each state's first sampler row and its number of rows, as StepSampling.sample lays them out: k + 1
    for a state verifying k proposals, one per sample for a state forking its samples, else one."""
    starts, sizes, total = [], [], 0
    for state in states:
        size = len(state.spec_token_ids) + 1 if state.spec_token_ids else 1 + len(state.child_req_ids)
        starts.append(total)
        sizes.append(size)
        total += size
    return starts, sizes
