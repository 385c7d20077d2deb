"""SharedAnswer: one async fetch's answer shared by every caller for a while (the open /health and
/metrics, which take no key: however many pollers, the tokenizer and the schedulers are asked at
most once per max_age).

A caller gets the last answer while it is younger than max_age; else it starts a fetch, and every
caller that comes while that fetch runs waits for the same one. A fetch that raised is an answer
too (its exception is raised to every caller until it ages), so a service that is down is not
asked by every poller either. A caller's cancellation does not cancel the shared fetch.

Threads: one event loop (the gateway's serving loop); no locks (no await between check and set).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")
MAX_AGE_S = 0.5


class SharedAnswer(Generic[T]):
    def __init__(self, fetch: Callable[[], Awaitable[T]], max_age_s: float = MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fetch, self.max_age_s, self.clock = fetch, max_age_s, clock
        self.fetches = 0  # how many times fetch ran (tests, and the curious)
        self._at = -float("inf")
        self._value: T | None = None
        self._error: BaseException | None = None
        self._running: asyncio.Future | None = None

    async def get(self) -> T:
        if self.clock() - self._at < self.max_age_s:
            if self._error is not None:
                raise self._error
            return self._value  # type: ignore[return-value]
        if self._running is None:
            self._running = asyncio.ensure_future(self._run())
        return await asyncio.shield(self._running)

    async def _run(self) -> T:
        self.fetches += 1
        try:
            value = await self.fetch()
        except Exception as exc:  # noqa: BLE001 - the answer, for every caller until it ages
            self._value, self._error, self._at = None, exc, self.clock()
            raise
        else:
            self._value, self._error, self._at = value, None, self.clock()
            return value
        finally:
            self._running = None

    def forget(self) -> None:
        """The next get() fetches (a state change this process knows of, as draining)."""
        self._at = -float("inf")
