"""Structured outputs at the worker: one llguidance matcher per constrained sequence, and the
step's token bitmask for the rows that sample under a grammar.

- The model's LLTokenizer is built on the first constrained request (about a second; a worker
  that never sees one never pays it).
- Compiled grammars are cached by spec (an LRU keyed by StructuredOutput.key()): a cached
  matcher is never advanced, each sequence starts from a deep copy of it.
- The scheduler asks for a request's grammar when the request arrives (SchedulerOutput.grammars) and
  holds the request until a step result lists it ready (scheduler/core/grammar_wait.py): `compile_ahead`
  compiles it on a background thread (llguidance releases the GIL), `take_ready` puts what has
  compiled into the cache and names it. A sequence whose grammar is not in the cache when it first
  samples (a spec dropped from the cache, a worker that never got the ask) compiles it there, on the
  step thread, as before.
- A sequence's matcher lives in its RequestState and is built lazily, the first time the
  sequence samples, by consuming its output tokens so far. That one rule covers a new request
  (no outputs), the samples 2..n forked after the first token, a request re-sent after a
  recompute preemption or a worker restart, and one resumed from the store.
- With a reasoning parser (spec.reasoning_end, vLLM's behaviour) the grammar reads only the output
  after the reasoning: until the end marker's token ids appear in the output the row samples
  unconstrained (matcher REASONING; each step checks whether the output now ends with them),
  then the matcher is built from the tokens after the marker. A sequence rebuilt from its
  outputs (fork, preemption, restart) searches them whole once.
- Only tensor-parallel rank 0 samples, so only rank 0 builds matchers; the other ranks get the
  token ids from rank 0 and never consult a grammar.

Threads: the model runner's step thread calls everything here (llguidance's executor fills the rows
in parallel inside one call); the one compile thread runs only `_compile`, and builds the tokenizer
under its lock. The cache and the futures are the step thread's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagedserve.common import structured_output
from pagedserve.common.sampling_params import StructuredOutput

log = logging.getLogger(__name__)

GRAMMAR_CACHE_SIZE = 64
FAILED = "failed"  # a RequestState.matcher that could not be built: the row may only sample eos
# A RequestState.matcher while the sequence is still in its reasoning (spec.reasoning_end not yet
# written): the row samples unconstrained; its matcher is built on the step after the end.
REASONING = "reasoning"
# How long a step with nothing to run waits for a compile to end before it answers: the scheduler's
# poll while only requests waiting for their grammars are left.
IDLE_WAIT_S = 0.01


@dataclass(slots=True)
class TokenMasks:
    """The step's grammar masks: rows[i] of the batch may only sample the tokens whose bit is set
    in bitmask[i] (llguidance's layout: token t is bit t % 32 of int32 word t // 32)."""
    rows: torch.Tensor  # [k] long, batch row indices
    bitmask: torch.Tensor  # [k, ceil(V / 32)] int32


def forbidden_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[k, W] int32 bitmask -> [k, vocab] bool, True where the token is forbidden. Vectorised: on
    the CPU numpy's unpackbits (little-endian words: bit t % 8 of byte t // 8 is token t), which is
    about a hundred times faster here than torch's shifts; on a GPU torch's shifts on the device."""
    if bitmask.device.type == "cpu":
        words = bitmask.numpy()
        bits = np.unpackbits((~words).view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, :vocab].view(np.bool_))
    return forbidden_tokens_torch(bitmask, vocab)


def forbidden_tokens_torch(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab] == 0


class GrammarMatchers:
    def __init__(self, tokenizer_folder: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer_folder = Path(tokenizer_folder)
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._tokenizer = None
        self._executor = None
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._hf = None  # the HF tokenizer (encodes the reasoning end markers)
        self._special: dict[str, int] = {}  # its special tokens' texts -> ids (a structural tag's triggers)
        self._end_ids: dict[str, list[int]] = {}
        self._tokenizer_lock = threading.Lock()
        self._compiling: dict[str, futures.Future] = {}  # key -> the compile thread's matcher
        self._pool: futures.ThreadPoolExecutor | None = None
        self._unreported: list[str] = []  # compiles ended, not yet named by take_ready
        # Times the step thread waited for a grammar: compiled one (none asked ahead, or dropped from
        # the cache), or waited for its compile ahead (the scheduler held none of its requests back).
        self.stalls = 0
        self.mask_time_s = 0.0  # filling the bitmasks, summed over steps (the sampler times applying them)
        self.mask_steps = 0  # steps that had at least one constrained row

    def _ll_tokenizer(self):
        with self._tokenizer_lock:
            return self._built_tokenizer()

    def _built_tokenizer(self):
        if self._tokenizer is None:
            import llguidance
            import llguidance.hf

            from pagedserve.model_files.tokenizer_files import load_tokenizer

            if not (self.tokenizer_folder / "tokenizer.json").is_file():
                raise ValueError(f"structured outputs need the model's tokenizer.json, and {self.tokenizer_folder} "
                                 "has none")
            hf = self._hf = load_tokenizer(self.tokenizer_folder)
            self._special = {t.content: i for i, t in hf.added_tokens_decoder.items() if t.special}
            # The logits' width, or the tokenizer's when it has more (added) tokens than the model
            # head: the bitmask is sized by the tokenizer and cut to the logits when applied.
            self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=max(self.vocab_size, len(hf)),
                                                           eos_token=list(self.eos_token_ids) or None)
            self._executor = llguidance.LLExecutor()
        return self._tokenizer

    def prepare(self, state) -> bool:
        """Build or update a constrained sequence's matcher before it samples (its RequestState:
        params, token_ids, num_prompt_tokens, matcher); True when the row samples under its grammar
        this step, False while it is still reasoning."""
        spec = state.params.structured_output
        if state.matcher is not None and state.matcher is not REASONING:
            return True
        outputs = state.token_ids[state.num_prompt_tokens:]
        try:
            after = self.after_reasoning(spec, outputs, whole=state.matcher is None)
        except Exception:  # noqa: BLE001 - e.g. no tokenizer: the matcher fails the same way below
            after = outputs
        state.matcher = REASONING if after is None else self.new_matcher(spec, after)
        return state.matcher is not REASONING

    def after_reasoning(self, spec: StructuredOutput, outputs: list[int], whole: bool) -> list[int] | None:
        """The outputs the grammar reads: all of them without spec.reasoning_end; else those after
        the end marker's token ids, or None while they have not appeared. whole: search every
        output; else only whether the outputs end with the marker (at the previous step the
        sequence was still reasoning, so the marker can only have just been completed)."""
        if not spec.reasoning_end:
            return outputs
        end = self._end_ids.get(spec.reasoning_end)
        if end is None:
            self._ll_tokenizer()
            end = self._end_ids[spec.reasoning_end] = list(
                self._hf.encode(spec.reasoning_end, add_special_tokens=False))
        n = len(end)
        if not whole:
            return [] if n and outputs[-n:] == end else None
        for i in range(len(outputs) - n + 1):
            if outputs[i:i + n] == end:
                return outputs[i + n:]
        return None

    def new_matcher(self, spec: StructuredOutput, output_token_ids: list[int]):
        """A matcher for a sequence that has produced output_token_ids so far, or FAILED when none
        can be built (the sequence then may only end: a bad request fails alone, not the step)."""
        try:
            return self._new_matcher(spec, output_token_ids)
        except Exception:  # noqa: BLE001 - e.g. a model folder without tokenizer.json
            log.exception("cannot build a grammar matcher for %s; the sequence is ended", spec.key()[:80])
            return FAILED

    def _new_matcher(self, spec: StructuredOutput, output_token_ids: list[int]):
        key = spec.key()
        fresh = self._cache.get(key)
        if fresh is None and key in self._compiling:  # asked ahead, not ready yet: wait for that compile
            self.stalls += 1
            futures.wait([self._compiling[key]])
            self._collect()
            fresh = self._cache.get(key)
        if fresh is None:
            self.stalls += 1
            fresh = self._compile(spec)
            self._keep(key, fresh)
        else:
            self._cache.move_to_end(key)
        matcher = fresh.deep_copy()
        if output_token_ids and not matcher.consume_tokens(output_token_ids):
            log.warning("rebuilding a grammar matcher: the tokens so far do not match it (%s)", matcher.get_error())
        return matcher

    def _compile(self, spec: StructuredOutput):
        """A fresh matcher of the spec's grammar (any thread); raises when it cannot be built."""
        import llguidance

        tokenizer = self._ll_tokenizer()
        fresh = llguidance.LLMatcher(tokenizer, structured_output.grammar_text(spec, self._special), log_level=0,
                                     limits=structured_output.parser_limits())
        if fresh.is_error():
            log.warning("grammar %s failed to compile against the tokenizer: %s", spec.key()[:80], fresh.get_error())
        return fresh

    def _keep(self, key: str, fresh) -> None:
        self._cache[key] = fresh
        self._cache.move_to_end(key)
        if len(self._cache) > GRAMMAR_CACHE_SIZE:
            self._cache.popitem(last=False)

    def compile_ahead(self, specs: list[StructuredOutput]) -> None:
        """Start compiling the grammars a step asks for (SchedulerOutput.grammars) in the background;
        one already cached or compiling is not compiled again (take_ready names it all the same)."""
        for spec in specs:
            key = spec.key()
            if key in self._compiling:
                continue
            if self._pool is None:
                self._pool = futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
            if key in self._cache:
                done = self._compiling[key] = futures.Future()
                done.set_result(self._cache[key])
            else:
                self._compiling[key] = self._pool.submit(self._compile, spec)

    def take_ready(self, wait_s: float = 0.0) -> list[str]:
        """The keys whose compile has ended since the last call (ModelRunnerOutput.grammars_ready), their
        matchers now in the cache; a compile that raised is named too (its requests get FAILED matchers
        when they first sample, which end them). wait_s: with none ended yet, wait that long for one."""
        if wait_s and self._compiling and not self._unreported and not any(f.done() for f in self._compiling.values()):
            futures.wait(self._compiling.values(), timeout=wait_s, return_when=futures.FIRST_COMPLETED)
        self._collect()
        ready, self._unreported = self._unreported, []
        return ready

    def _collect(self) -> None:
        """The ended compiles' matchers into the cache, their keys to report."""
        for key in [key for key, f in self._compiling.items() if f.done()]:
            try:
                self._keep(key, self._compiling.pop(key).result())
            except Exception:  # noqa: BLE001 - e.g. no tokenizer.json: the matcher fails at its first sample
                log.exception("cannot compile the grammar %s ahead", key[:80])
            self._unreported.append(key)

    def fill(self, matchers: list, row_of: list[int]) -> torch.Tensor:
        """One bitmask row per batch row: row_of[r] is the index into matchers of row r's matcher
        (a forked request's n rows share its one matcher)."""
        started = time.perf_counter()
        import llguidance.numpy

        vocab = self.vocab_size if self._tokenizer is None else self._tokenizer.vocab_size
        words = (vocab + 31) // 32
        filled = np.full((len(matchers), words), -1, dtype=np.int32)
        live = [(m, i) for i, m in enumerate(matchers) if m is not FAILED]
        if len(live) == 1:
            llguidance.numpy.fill_next_token_bitmask(live[0][0], filled, live[0][1])
        elif live:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, live, filled)
        for i in (i for i, m in enumerate(matchers) if m is FAILED):
            filled[i] = 0
            for eos in self.eos_token_ids:
                filled[i, eos // 32] |= np.int32(np.uint32(1 << (eos % 32)).view(np.int32))
        bitmask = torch.from_numpy(filled[row_of] if len(row_of) != len(matchers) else filled)
        self.mask_time_s += time.perf_counter() - started
        self.mask_steps += 1
        return bitmask

    @staticmethod
    def advance(matcher, token_id: int) -> None:
        if matcher is FAILED or matcher is REASONING:
            return
        if not matcher.is_stopped() and not matcher.consume_token(token_id):
            log.warning("grammar matcher refused sampled token %d: %s", token_id, matcher.get_error())
