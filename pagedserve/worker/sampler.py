"""Turns a batch of next-token logits into one token per request (plus logprobs when asked).

The whole step is vectorised over the vocabulary; the only per-row Python loops build small
index lists. Seeded rows draw all together from their keys (seeded_draws.py), the others from the
global torch RNG. Order: penalties, then the rules of logit_rules.py (logit_bias, allowed_token_ids
and bad words, min_tokens, the grammar masks last, so that a bias cannot revive a token the grammar
forbids), then temperature and truncation. A batch without any of these pays nothing for them.

On a GPU the step never waits for the device in the middle: the rows' parameters go up through
pinned memory without blocking (`to_device`), rows are picked by index tensors made the same way
(never by a Python list, which would copy up and wait), nothing reads a device value to decide
what to do next, and the sampled ids (with the logprobs and top logprobs when a row asks) come back in one
device->host copy at the end, started without blocking (`Sampler.sample` returns a `PendingSample`; its
`result()` waits for the copy and unpacks the `SamplerOutput`), so the model runner does the step's other
host work while the device finishes.

Threads: the worker's torch thread only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.worker.device_rows import put_rows, row_index, take_rows, to_device
from pagedserve.worker.logit_rules import (AllowedIds, min_tokens_pending, apply_logit_bias, apply_token_masks,
                                           block_min_tokens, mask_tokens)
from pagedserve.worker.penalties import apply_penalties
from pagedserve.worker.penalty_counts import PenaltyCounts
from pagedserve.worker.seeded_draws import exponentials, race_cpu
from pagedserve.worker.structured_output import TokenMasks
from pagedserve.worker.truncation import truncate

def plain_argmax(p: SamplingParams) -> bool:
    """Whether a row with these settings samples the argmax of its logits as they are: greedy, no logprobs,
    nothing that changes the logits (penalties, a bias, min_tokens, allowed or bad tokens; a grammar is the
    caller's to add)."""
    return (p.temperature == 0.0 and p.logprobs is None and not p.logit_bias and not p.min_tokens
            and not p.needs_penalties and not p.masks_tokens)


@dataclass(slots=True)
class RowSampling:
    params: SamplingParams
    key: int | None  # a seeded row's int64 stream key (seeded_draws.stream_key), or None: the global torch RNG
    prompt_token_ids: Sequence[int]  # repetition_penalty covers prompt + output, as HF does
    output_token_ids: Sequence[int]  # presence/frequency cover output only, as vLLM/OpenAI do
    eos_token_ids: tuple[int, ...]
    # With a PenaltyCounts table (the model runner's): the row of its state there, whose counts stand for
    # the two lists above, and the tokens after them (a verifying row's proposals before it).
    counts_row: int = -1
    extra_output_ids: Sequence[int] = ()


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None  # sampled token's logprob per row; None when no row asked
    top_logprobs: list[list[tuple[int, float]] | None] | None  # sorted desc; None for rows that did not ask


def _draw(y: torch.Tensor, keys: list[int | None], device_forms: bool = False) -> torch.Tensor:
    """One token a row, an exact draw from softmax(y) (y: the rows' final logits, a temporary it may overwrite).

    Rows without a key: inverse transform sampling with one uniform a row from the global torch RNG
    (`_inverse_cdf`). Seeded rows: the exponential race, argmax(probs / q) with q ~ Exp(1) a token, their
    q drawn together from their keys (seeded_draws.py: a counter-based hash, a fixed number of ops for any
    number of rows, no host read), so a seeded row's tokens do not depend on the batch around it.
    """
    seeded = [j for j, k in enumerate(keys) if k is not None]
    if not seeded:
        return _inverse_cdf(y)
    dev = y.device
    seeded_keys = [keys[j] for j in seeded]
    if len(seeded) == len(keys):
        return _seeded_race(y.softmax(-1), seeded_keys, device_forms)
    shared = to_device([j for j, k in enumerate(keys) if k is None], torch.long, dev)
    seeded_rows = to_device(seeded, torch.long, dev)
    tokens = torch.empty(len(keys), dtype=torch.long, device=dev)
    put_rows(tokens, shared, _inverse_cdf(y.index_select(0, shared)))
    put_rows(tokens, seeded_rows, _seeded_race(y.index_select(0, seeded_rows).softmax(-1), seeded_keys, device_forms))
    return tokens


def _seeded_race(probs: torch.Tensor, keys: list[int], device_forms: bool = False) -> torch.Tensor:
    """The race of seeded rows: on the CPU from the few tokens that can win (seeded_draws.race_cpu, the
    same tokens as the full race bit for bit), elsewhere (and with device_forms) over every token's draw."""
    if probs.device.type == "cpu" and not device_forms and probs.dtype == torch.float32 \
            and (ops := _cpu_ops()) is not None:
        return race_cpu(probs, keys, ops)
    return _race(probs, exponentials(keys, probs.shape[1], probs.device))


def _race(probs: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """argmax(probs / q), q ~ Exp(1) a token: an exact draw from probs (the exponential race)."""
    q.clamp_min_(torch.finfo(q.dtype).tiny)  # a zero draw would give inf, or nan (argmax's favourite) when masked
    return argmax(probs.div_(q))


def _inverse_cdf(y: torch.Tensor) -> torch.Tensor:
    """The first token whose cumulative probability (softmax(y), y overwritten on the CPU) passes u x the row's
    total, u ~ U[0, 1) from the global torch RNG: an exact draw with one random number a row (the exponential
    race takes one a token: torch's exponential_ over 64 rows of 49k tokens cost ~50 ms of a W64 step on a
    2-core Xeon). Tokens of probability 0 (truncated, masked) are never the first to pass it: their
    cumulative sum does not rise. On the CPU one compiled pass a row does it all (logits_ops.cpp draw_rows:
    torch's softmax, cumsum and searchsorted took ~4.3 ms of 64 rows of 49k tokens, it ~1 ms). Elsewhere,
    where a parallel scan's rounding lets a zero slip through (a GPU's cumsum need not be monotone to the
    last bit), the row takes its most likely token instead."""
    u = torch.rand(y.shape[0], 1, dtype=torch.float32, device=y.device)
    if y.device.type == "cpu" and y.dtype == torch.float32 and y.is_contiguous() and y.shape[1]:
        from pagedserve.kernels import cpu_ops
        ops = cpu_ops.load()
        if ops is not None:
            return ops.draw_rows(y, u.view(-1))
    probs = y.softmax(-1)
    cdf = probs.cumsum(-1)
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp_max_(probs.shape[1] - 1)
    possible = probs.gather(1, tokens[:, None]).squeeze(1) > 0
    return torch.where(possible, tokens, argmax(probs))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1). On the CPU in float32 through the compiled kernel (torch's took ~2 ms of a batch-64
    step over a 49k vocabulary, the kernel ~0.4); elsewhere in x's own dtype (the same index: a float32
    copy of 256 rows of 128k bfloat16 logits would be 128 MB more written and read on the GPU)."""
    if x.device.type != "cpu":
        return x.argmax(-1)
    x = x.float()
    if x.dim() == 2 and x.shape[1] and x.is_contiguous():
        from pagedserve.kernels import cpu_ops
        ops = cpu_ops.load()
        if ops is not None:
            return ops.argmax_rows(x)
    return x.argmax(-1)


class Sampler:
    def __init__(self, device_forms: bool = False) -> None:
        self.mask_time_s = 0.0  # applying grammar masks, summed over steps (the bench reads it)
        # True: the forms a GPU runs (no host read) on the CPU too, where penalties would otherwise read the
        # rows' seen tokens on the host (tests of the device's rules)
        self.device_forms = device_forms
        self.allowed_ids = AllowedIds()  # allowed_token_ids' index tensors, per request

    def __call__(self, logits: torch.Tensor, rows: list[RowSampling], masks: TokenMasks | None = None) -> SamplerOutput:
        """masks: the grammar masks of the constrained rows (None: no row is constrained)."""
        return self.sample(logits, rows, masks).result()

    def greedy(self, logits: torch.Tensor, params: list[SamplingParams]) -> PendingSample:
        """sample()'s result for rows that are all plain argmaxes (the model runner's plain_greedy): params one
        per logits row."""
        return PendingSample(argmax(logits), params, [], 0)

    def sample(self, logits: torch.Tensor, rows: list[RowSampling], masks: TokenMasks | None = None,
               counts: PenaltyCounts | None = None) -> PendingSample:
        """The step's sampling, all on the device (no host read: every decision comes from the rows'
        parameters), and its results' copy to the host started (PendingSample.result waits for it). counts:
        the penalised rows' histories as rows of that table (RowSampling.counts_row), else their lists."""
        params = [r.params for r in rows]
        if masks is None and all(map(plain_argmax, params)):
            return self.greedy(logits, params)
        raw = logits.float()
        want_lp = any(p.logprobs is not None for p in params)
        mutate = masks is not None or any(p.needs_penalties or p.logit_bias or p.masks_tokens
                                          or min_tokens_pending(r) for p, r in zip(params, rows))

        # raw must stay untouched: logprobs are reported from the model's own distribution.
        x = raw.clone() if mutate else raw
        apply_penalties(x, rows, counts, sparse=False if self.device_forms else None)
        apply_logit_bias(x, rows)
        if any(p.masks_tokens for p in params):
            mask_tokens(x, rows, self.allowed_ids)
        block_min_tokens(x, rows)
        if masks is not None:
            started = time.perf_counter()
            apply_token_masks(x, raw, masks)
            self.mask_time_s += time.perf_counter() - started
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if len(sampled) < len(rows):
            tokens = argmax(x)
        else:
            tokens = torch.empty(len(rows), dtype=torch.long, device=x.device)
        if sampled:
            temp = to_device([params[i].temperature for i in sampled], torch.float32, x.device)
            index = row_index(sampled, x.shape[0], x.device)
            y = take_rows(x, index) / temp[:, None]
            put_rows(tokens, index, self._sample_rows(y, [params[i] for i in sampled],
                                                      [rows[i].key for i in sampled]))

        if not want_lp:
            return PendingSample(tokens, params, [], 0)
        return _with_logprobs(raw, tokens, params)


    def _sample_rows(self, y: torch.Tensor, params: list[SamplingParams], keys: list[int | None]) -> torch.Tensor:
        """A token a row of y (temperature-scaled logits, a temporary overwritten here): top_k, top_p and min_p
        (truncation.py), then an exact draw. On the CPU the unseeded rows take one compiled pass each
        (logits_ops.cpp nucleus_draw_rows: top_k and the nucleus found without a sort or candidate guesses, and
        the draw among what they keep; seeded rows race over every token)."""
        ops = _cpu_ops() if y.device.type == "cpu" and not self.device_forms and y.dtype == torch.float32 else None
        vocab = y.shape[1]
        fused = [j for j, k in enumerate(keys) if k is None] if ops is not None else []
        if not fused:
            return _draw(truncate(y, params), keys, self.device_forms)
        if len(fused) < len(params):
            taken = set(fused)
            rest = [j for j in range(len(params)) if j not in taken]
            tokens = torch.empty(len(params), dtype=torch.long)
            tokens[rest] = self._sample_rows(y[rest], [params[j] for j in rest], [keys[j] for j in rest])
            tokens[fused] = self._sample_rows(y[fused].contiguous(), [params[j] for j in fused], [None] * len(fused))
            return tokens
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params], dtype=torch.long)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
        return ops.nucleus_draw_rows(y.contiguous(), top_k, top_p, min_p, torch.rand(len(params), dtype=torch.float32))


def _cpu_ops():
    from pagedserve.kernels import cpu_ops
    return cpu_ops.load()


def _with_logprobs(raw: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]) -> PendingSample:
    """The sampled ids, their logprobs and the asked-for top logprobs as one float64 row, for one copy:
    ids, logprobs, then the top values and ids of the rows that want them (token ids are exact in
    float64, float32 logprobs too)."""
    # log_softmax(raw) = raw - logsumexp(raw), without materialising a second [B, V] tensor.
    lse = raw.logsumexp(-1)
    logprobs = raw.gather(1, tokens[:, None]).squeeze(1) - lse
    parts = [tokens.double(), logprobs.double()]
    want_top = [i for i, p in enumerate(params) if p.logprobs]
    k = min(max((params[i].logprobs for i in want_top), default=0), raw.shape[1])
    if want_top:
        index = row_index(want_top, raw.shape[0], raw.device)
        vals, ids = take_rows(raw, index).topk(k, dim=-1)
        parts += [(vals - take_rows(lse, index)[:, None]).double().flatten(), ids.double().flatten()]
    return PendingSample(torch.cat(parts), params, want_top, k, tokens)


class PendingSample:
    """A step's sampled values on their way to the host: the step's one device->host copy, started
    without blocking on CUDA (into pinned memory, an event recorded after it), so the host can go on
    with work that does not need the tokens; `result()` waits for the copy and unpacks it once. On the
    CPU there is nothing to copy: `result()` reads the values where they are (the same results).

    values: the sampled ids [R] (int64) alone, or with logprobs the float64 row _with_logprobs packs;
    token_ids: the sampled ids [R] on the device (values when they are the ids alone): a step begun
    before this one's result is taken reads its input ids from there (step_overlap.py)."""

    __slots__ = ("_host", "_event", "_params", "_want_top", "_k", "_output", "token_ids")

    def __init__(self, values: torch.Tensor, params: list[SamplingParams], want_top: list[int], k: int,
                 token_ids: torch.Tensor | None = None) -> None:
        self._params, self._want_top, self._k, self._output = params, want_top, k, None
        self.token_ids = values if token_ids is None else token_ids
        self._event = None
        if values.device.type == "cuda":
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(values.device))
        else:
            self._host = values

    def ready(self) -> bool:
        """Whether result() would not wait (its copy has arrived; always on the CPU)."""
        return self._event is None or self._output is not None or self._event.query()

    def result(self) -> SamplerOutput:
        if self._output is None:
            if self._event is not None:
                self._event.synchronize()
            self._output = self._unpack(self._host.tolist())
        return self._output

    def _unpack(self, values: list) -> SamplerOutput:
        params = self._params
        rows = len(params)
        if self._host.dtype != torch.float64:  # the ids alone
            return SamplerOutput(values, None, None)
        token_ids = [int(t) for t in values[:rows]]
        top: list[list[tuple[int, float]] | None] = [[] if p.logprobs is not None else None for p in params]
        k, start = self._k, 2 * rows
        span = len(self._want_top) * k
        for j, i in enumerate(self._want_top):
            n = params[i].logprobs
            row_vals = values[start + j * k:start + j * k + n]
            row_ids = values[start + span + j * k:start + span + j * k + n]
            top[i] = [(int(t), v) for t, v in zip(row_ids, row_vals)]
        return SamplerOutput(token_ids, values[rows:2 * rows], top)
