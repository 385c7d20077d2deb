"""The scheduler service's live requests: each client request (a GroupState) from its admission
until its last tokens are published, and every sample id they hold.

Threads: the gRPC event loop (admission, attach, leave, abort), the step loop (publish, fail) and
the record writer (forget) all use it. `lock` guards `groups`, `ids` and each group's subscriber
list; whoever walks a group's subscribers takes it (the record writer is handed the same lock).
Invariant: `ids` holds exactly the sample ids (core/sample_ids.py) of the groups in `groups`, so
two concurrent submits of one id cannot both be admitted.
"""

from __future__ import annotations

import threading

import grpc

from pagedserve.common.grpc_util import StatusError
from pagedserve.scheduler.core.request import RequestIdInUse
from pagedserve.scheduler.core.sample_ids import SampleIds
from pagedserve.scheduler.records import GroupState


class LiveGroups:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.groups: dict[str, GroupState] = {}
        self.ids = SampleIds()  # the sample ids of every group in groups

    def get(self, group_id: str) -> GroupState | None:
        """The live group of that id (a single dict read: any thread, without the lock)."""
        return self.groups.get(group_id)

    def claim(self, group: GroupState) -> None:
        """Under lock: the group becomes live with its samples' ids, or ALREADY_EXISTS when a live
        request holds one of them."""
        try:
            self.ids.claim(group.group_id, group.n, refusal="cannot be used")
        except RequestIdInUse as exc:
            raise StatusError(grpc.StatusCode.ALREADY_EXISTS, str(exc)) from None
        self.groups[group.group_id] = group

    def push_error(self, group: GroupState, error: StatusError) -> None:
        """Every subscriber of the group gets the error (its stream ends)."""
        with self.lock:
            for sub in group.subscribers:
                sub.push(error)

    def forget(self, group: GroupState) -> None:
        """The group's last records are written: its id and sample ids are free again."""
        with self.lock:
            if self.groups.get(group.group_id) is group:
                del self.groups[group.group_id]
                self.ids.release(group.group_id, group.n)
