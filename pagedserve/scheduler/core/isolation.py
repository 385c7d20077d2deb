"""Keeping one request's trouble its own (a mixin of Scheduler, scheduler.py).

Sample ids: a request of n samples runs as n sequences named by request.sample_ids, and each is the
key of a block table. A new request whose id or any of whose sample ids a live request holds is
refused (RequestIdInUse) before anything is allocated: otherwise a client sending `X#1` and then
`X` with n=2 would make the fork of X's sample 1 find X#1's blocks and raise in the middle of a
step that every request shares.

Faults: an exception raised while scheduling one request or while taking in its results ends that
request's whole group (aborted, blocks freed, whatever the step being built had given it taken
back) and is queued for take_failed; the step goes on for every other request.

Threads: the Scheduler's (one thread: the step loop, or the in-process engine's caller).
Invariants: sample_ids holds exactly sample_ids(g, n) of every group g in groups; a failed group is
in neither groups nor the queues once _fail returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedserve.common.messages import NewRequestData, SchedulerOutput
from pagedserve.scheduler.core.request import Request, RequestIdInUse, RequestStatus, sample_ids

if TYPE_CHECKING:
    from pagedserve.scheduler.core.scheduler import Scheduler


class Isolation:
    def _claim(self: Scheduler, group_id: str, n: int) -> None:
        ids = sample_ids(group_id, n)
        taken = next((i for i in ids if i in self.sample_ids), None)
        if taken is not None:
            what = "is" if taken == group_id else f"(n={n}) is refused: its sample id {taken!r} is"
            raise RequestIdInUse(f"request id {group_id!r} {what} already in use by a live request")
        self.sample_ids.update(ids)

    def _forget(self: Scheduler, group_id: str) -> None:
        group = self.groups.pop(group_id)
        self.sample_ids.difference_update(sample_ids(group_id, group[0].params.n))

    def take_failed(self: Scheduler) -> list[tuple[str, Exception]]:
        """(group id, exception) of the groups ended by a fault in their own bookkeeping since the
        last call; they are aborted already (blocks freed): the caller tells their clients."""
        failed, self.failed = self.failed, []
        return failed

    def _fail(self: Scheduler, req: Request, exc: Exception, out: SchedulerOutput | None = None,
              worker_forked: Sequence[str] = ()) -> None:
        """req's scheduling (out: the step being built) or its results raised: abort its whole
        group, taking back what this step had given its sequences, so the others go on.
        worker_forked: sample ids the worker created (it forks at its first sampled token) that
        may not have been registered here; the worker is told to drop them."""
        self.failed.append((req.group_id, exc))
        unregistered = [i for i in worker_forked if i not in self.requests]
        if out is not None:
            for r in self.groups.get(req.group_id) or [req]:
                if r.request_id in out.num_scheduled_tokens:
                    self._budget += out.num_scheduled_tokens.pop(r.request_id)
                    self._copies.pop(r.request_id, None)
                    if isinstance(self._entries.pop(r.request_id, None), NewRequestData):
                        r.sent_to_worker = False  # the worker never hears of it
        if not self.abort(req.group_id) and not req.status.finished:
            self._finish(req, RequestStatus.FINISHED_ABORTED)
        self._dropped_ids.extend(unregistered)
        if out is not None:  # what it held on the worker is dropped by this same step
            out.finished_req_ids.extend(self._dropped_ids)
            self._dropped_ids.clear()
