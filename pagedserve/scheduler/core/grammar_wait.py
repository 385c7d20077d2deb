"""Requests that wait for their grammar (vLLM's WAITING_FOR_FSM).

A structured request's grammar is compiled by the worker against the model's tokenizer: ~0.1-0.6 s for
a large JSON schema (structured_output.GRAMMAR_SYMBOLS bounds it). Compiled at the request's first
sample, on the worker's step thread, it stalled every stream of that step for as long. Instead the
worker compiles it in the background as soon as the request arrives: the scheduler asks for it once
(SchedulerOutput.grammars), and the request stays in the waiting queue, passed over by admission,
until a step result lists its key (ModelRunnerOutput.grammars_ready); the requests behind it in the
queue go on meanwhile. Steps carry on as before; a step with nothing else to run still goes out (the
worker holds such a step until a compile ends, or briefly: it is the scheduler's poll).

Keys, not requests: every request with the same spec shares one ask and one compile. The ready keys
are an LRU as large as the worker's cache of compiled grammars: a key dropped here is asked again
(the worker answers at once while it still holds the grammar); one the worker dropped first is
compiled on the step thread at the request's first sample, as before (correct, only slower). A key
not ready MAX_WAIT_S after its ask (a worker that does not compile ahead) holds its requests no longer:
they too compile at their first sample.

Single-threaded: the Scheduler's (its step-loop thread).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from pagedserve.common.sampling_params import StructuredOutput

# The worker's compiled-grammar cache holds as many (worker/structured_output.GRAMMAR_CACHE_SIZE).
READY_KEYS_KEPT = 64
# A compile within the grammar bound takes ~0.6 s at most on a 2-core CPU.
MAX_WAIT_S = 30.0

log = logging.getLogger(__name__)


class GrammarWait:
    def __init__(self, kept: int = READY_KEYS_KEPT, clock=time.monotonic) -> None:
        self.kept, self.clock = kept, clock
        self._ready: OrderedDict[str, None] = OrderedDict()  # compiled (or failed) on the worker
        self._asked: dict[str, float] = {}  # sent to the worker, not yet ready: when
        self._to_ask: dict[str, StructuredOutput] = {}  # the next step's asks

    def holds(self, spec: StructuredOutput | None) -> bool:
        """Whether a request with this spec must wait for its grammar; asks for it (once) if so."""
        if spec is None:
            return False
        key = spec.key()
        if key in self._ready:
            self._ready.move_to_end(key)
            return False
        asked = self._asked.get(key)
        if asked is None:
            self._asked[key] = self.clock()
            self._to_ask[key] = spec
        elif self.clock() - asked > MAX_WAIT_S:
            log.warning("grammar %s: not compiled %g s after it was asked for; its requests compile it "
                        "when they first sample", key[:80], MAX_WAIT_S)
            self.ready([key])
            return False
        return True

    def take_asks(self) -> list[StructuredOutput]:
        """The grammars the next step asks the worker for."""
        asks = list(self._to_ask.values())
        self._to_ask.clear()
        return asks

    def put_back(self, asks: list[StructuredOutput]) -> None:
        """A step that was not sent: its asks go with the next one."""
        for spec in asks:
            self._to_ask.setdefault(spec.key(), spec)

    def ready(self, keys: list[str]) -> None:
        """A step result's grammars_ready."""
        for key in keys:
            self._asked.pop(key, None)
            self._to_ask.pop(key, None)
            self._ready[key] = None
            self._ready.move_to_end(key)
        while len(self._ready) > self.kept:
            self._ready.popitem(last=False)

    def forget(self) -> None:
        """The worker lost its grammars (a new session): every key is asked again when a request needs it."""
        self._ready.clear()
        self._asked.clear()
        self._to_ask.clear()
