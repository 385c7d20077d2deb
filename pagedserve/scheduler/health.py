"""Health of the scheduler service: why the engine cannot serve now ("" when it can): the model
is loading, a worker rank is gone, the store (Redis) is unreachable, or the engine made no
progress with work pending. The gRPC health service, the replica heartbeat and GetStats report it.

Its interface: `ready` (set by the service once started, cleared at stop), `progress()` (the step
loop's heartbeat: a step done, or idle), `worker_gone(cause)` / `worker_back()` (recovery),
`start_store_checks()` and `unhealthy_cause()`.

Threads: the store checker runs on its own thread and alone writes `store_cause`; the step loop
(and recovery, on it) writes `worker_cause` and `last_progress`; `unhealthy_cause` is called from
the gRPC event loop and reads single attributes (the stall is computed when asked: the step loop
may be stuck).
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("pagedserve.scheduler")


class Health:
    def __init__(self, store, stopping: threading.Event, stall_timeout_s: float,
                 store_check_interval_s: float) -> None:
        self.store, self.stopping = store, stopping
        self.stall_timeout_s, self.store_check_interval_s = stall_timeout_s, store_check_interval_s
        self.ready = False
        self.worker_cause = ""
        self.store_cause = ""
        self.last_progress = time.monotonic()

    def progress(self) -> None:
        self.last_progress = time.monotonic()

    def worker_gone(self, cause: str) -> None:
        self.worker_cause = f"a worker rank is gone ({cause}); waiting for it to come back"

    def worker_back(self) -> None:
        self.worker_cause = ""
        self.progress()

    def start_store_checks(self) -> None:
        threading.Thread(target=self._check_store, name="store-check", daemon=True).start()

    def _check_store(self) -> None:
        """Ping the store now and then; an unreachable Redis makes the engine unhealthy."""
        while not self.stopping.wait(self.store_check_interval_s):
            ok = self.store.ping()
            if not ok and not self.store_cause:
                log.error("the request store (Redis) does not answer")
            elif ok and self.store_cause:
                log.info("the request store (Redis) answers again")
            self.store_cause = "" if ok else "the request store (Redis) is unreachable"

    def unhealthy_cause(self) -> str:
        """Why the engine cannot serve now, or "" when it can."""
        if not self.ready:
            return "the model is loading" if not self.stopping.is_set() else "the scheduler is stopping"
        causes = [c for c in (self.worker_cause, self.store_cause) if c]
        stalled = time.monotonic() - self.last_progress
        if not self.worker_cause and stalled > self.stall_timeout_s:
            causes.append(f"the engine made no progress for {stalled:.0f} s with work pending "
                          f"(--stall-timeout {self.stall_timeout_s:g} s)")
        return "; ".join(causes)
