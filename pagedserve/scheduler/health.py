"""Health of the scheduler service: why the engine cannot serve now ("" when it can): the model
is loading, a worker rank is gone, the store (Redis) is unreachable, or the engine made no
progress with work pending. The gRPC health service and GetStats report it.

Threads: `_check_store` runs on its own thread; `unhealthy_cause` is called from the gRPC event
loop and reads single attributes the step loop writes. A mixin of SchedulerService.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("pagedserve.scheduler")


class Health:
    def _check_store(self) -> None:
        """Ping the store now and then; an unreachable Redis makes the engine unhealthy."""
        while not self.stopping.wait(self.config.store_check_interval_s):
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
        if not self.worker_cause and stalled > self.config.stall_timeout_s:
            causes.append(f"the engine made no progress for {stalled:.0f} s with work pending "
                          f"(--stall-timeout {self.config.stall_timeout_s:g} s)")
        return "; ".join(causes)
