"""How a live request ends other than by finishing: aborted (a client's Abort, an orphan after a
restart), refused at admission (end_group: its id is taken, its prompt does not fit), or failed.

A bad request fails alone: an exception in one request's admission, its scheduling or results
(the Scheduler reports those through take_failed: end_failed), its publishing, replay or abort ends
that request (fail_group: its subscribers get INTERNAL, its blocks are freed, its record is finished)
and nothing else. fail_all is only for a step that failed as a whole (e.g. the forward pass), where
no single request can be blamed.

Threads: the step-loop thread only (step_loop.py calls these between and inside its steps), the one
that touches the Scheduler; the live groups' lock guards each group's subscriber list.

Invariants: a refused or failed group is done at once (no later update of it is published); a
failed group's samples without a finish reason get "abort" and its record, where one was stored, is
finished with the error; an aborted sample gets "abort", and its group is done once every sample
has a finish reason; an exception while freeing a failed request's blocks is logged and ends
nothing else.
"""

from __future__ import annotations

import json
import logging
import time

import grpc

from pagedserve.common.grpc_util import StatusError
from pagedserve.common.store import RecordWrite
from pagedserve.scheduler.core.request import RequestNotServable
from pagedserve.scheduler.core.scheduler import Scheduler
from pagedserve.scheduler.records import GroupState, LiveGroups, RecordWriter
from pagedserve.scheduler.stats_recorder import StatsRecorder
from pagedserve.scheduler.subscriptions import Delivery

log = logging.getLogger("pagedserve.scheduler")


class RequestEndings:
    """Ends live requests for the step loop: each method takes the group (or its id) it ends."""

    def __init__(self, scheduler: Scheduler, live: LiveGroups, writer: RecordWriter, recorder: StatsRecorder) -> None:
        self.scheduler, self.live, self.writer, self.recorder = scheduler, live, writer, recorder

    def abort(self, request_id: str, index: int | None) -> None:
        group = self.live.get(request_id)
        if group is None or group.done:
            return
        try:
            self._abort_group(group, index)
        except Exception as exc:  # noqa: BLE001 - this request fails alone
            self.fail_group(group, exc)

    def _abort_group(self, group: GroupState, index: int | None) -> None:
        request_id = group.group_id
        for req in self.scheduler.groups.get(request_id, ()):
            if index is None or req.sample_index == index:
                group.ended_samples.setdefault(req.sample_index, req)
        if not self.scheduler.abort(request_id, index) and index is not None:
            return
        now = time.time()
        deliveries = []
        for i in range(group.n) if index is None else [index]:
            if not group.finish_reasons[i]:
                group.finish_reasons[i] = "abort"
                deliveries.append(Delivery(i, 0, [], finish_reason="abort"))
        write = RecordWrite(request_id, {"finish_reasons": json.dumps(group.finish_reasons)})
        if all(group.finish_reasons):
            group.timings["finished"] = now
            group.done = True
            write.fields.update(status="finished", timings=json.dumps(group.timings_snapshot()))
            write.finished = True
            write.ttl_samples = group.n
            self.recorder.remember(group)  # ended by abort: not counted as finished
        for delivery in deliveries:
            delivery.timings = group.timings_snapshot()
        self.writer.submit([write], [(group, deliveries)], [group] if group.done else [])

    def end_group(self, group: GroupState, error: StatusError) -> None:
        group.done = True
        self.live.push_error(group, error)
        self.writer.submit([], [], [group])

    def end_failed(self) -> None:
        """The requests whose own bookkeeping raised in the Scheduler (aborted there already)."""
        for group_id, exc in self.scheduler.take_failed():
            group = self.live.get(group_id)
            if group is not None and not group.done:
                refused = None
                if isinstance(exc, RequestNotServable):  # the request's own doing: a 400 naming why
                    log.warning("request %s refused by the worker: %s", group_id, exc)
                    refused = StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                self.fail_group(group, exc, error=refused)

    def fail_group(self, group: GroupState, exc: Exception, stored: bool = True,
                   error: StatusError | None = None) -> None:
        """An exception in this request's own work: it ends alone. Its blocks are freed, its
        subscribers get INTERNAL (or error; the exception goes to the log, not to the client), its
        record (stored: one was written) is finished with the unfinished samples 'abort' and the error."""
        if error is None:
            log.error("request %s failed in the scheduler; it alone is ended", group.group_id, exc_info=exc)
        try:
            self.scheduler.abort(group.group_id)  # no-op when the Scheduler ended it already
        except Exception:  # noqa: BLE001 - its state may be what broke; the others go on regardless
            log.exception("request %s: freeing it failed too", group.group_id)
        group.finish_reasons = [r or "abort" for r in group.finish_reasons]
        group.timings["finished"] = time.time()
        error = error or StatusError(grpc.StatusCode.INTERNAL, f"request {group.group_id!r} failed in the "
                                     "scheduler (the scheduler's log says why); other requests are not affected")
        writes = []
        if stored:  # the error kept with it: a later attach (a resume) is told the same
            writes.append(RecordWrite(group.group_id, {
                "status": "finished", "finish_reasons": json.dumps(group.finish_reasons),
                "timings": json.dumps(group.timings_snapshot()), "error": error.details,
                "error_code": error.code.name}, finished=True, ttl_samples=group.n))
        group.done = True
        self.live.push_error(group, error)
        self.writer.submit(writes, [], [group])

    def fail_all(self, error: StatusError) -> None:
        """The step failed as a whole: every request ends with error, its record finished (those
        admitted have one) so that a restarted scheduler does not run them again for nobody."""
        for group in list(self.live.groups.values()):
            if not group.done:  # (fail_group frees it; an exception there cannot end this loop)
                self.fail_group(group, error, group.group_id in self.scheduler.groups, error)
