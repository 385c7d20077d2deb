"""The scheduler service's live requests: each client request (a GroupState) from its admission
until its last tokens are published, and every sample id they hold.

Threads: the gRPC event loop (admission, attach, leave, abort), the step loop (publish, fail) and
the record writer (forget) all use it. `lock` guards `groups`, `live_ids` and each group's
subscriber list; whoever walks a group's subscribers takes it (the record writer is handed the
same lock). Invariant: `live_ids` is exactly the sample ids (`<id>#<i>`, core/request.py) of the
groups in `groups`, so two concurrent submits of one id cannot both be admitted.
"""

from __future__ import annotations

import threading

import grpc

from pagedserve.common.grpc_util import StatusError
from pagedserve.scheduler.core.request import sample_ids
from pagedserve.scheduler.records import GroupState


class LiveGroups:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.groups: dict[str, GroupState] = {}
        self.live_ids: set[str] = set()

    def get(self, group_id: str) -> GroupState | None:
        """The live group of that id (a single dict read: any thread, without the lock)."""
        return self.groups.get(group_id)

    def claim(self, group: GroupState) -> None:
        """Under lock: the group becomes live with its samples' ids, or ALREADY_EXISTS when a live
        request holds one of them."""
        ids = sample_ids(group.group_id, group.n)
        taken = next((i for i in ids if i in self.live_ids), None)
        if taken is not None:
            which = "is" if taken == group.group_id else f"(n={group.n}) cannot be used: its sample id {taken!r} is"
            raise StatusError(grpc.StatusCode.ALREADY_EXISTS,
                              f"request id {group.group_id!r} {which} already in use by a live request")
        self.live_ids.update(ids)
        self.groups[group.group_id] = group

    def readmit(self, group: GroupState) -> None:
        """At start, before anything else runs: a request re-admitted from the store is live."""
        self.groups[group.group_id] = group
        self.live_ids.update(sample_ids(group.group_id, group.n))

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
                self.live_ids.difference_update(sample_ids(group.group_id, group.n))
