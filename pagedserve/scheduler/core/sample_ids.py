"""The sample ids of the live requests, and the one rule on them: no two live requests share one.

A request of n samples runs as n sequences named by request.sample_ids (`<id>`, `<id>#1` ...),
and each is the key of a block table. A new request whose id or any of whose sample ids a live
request holds is refused (RequestIdInUse) before anything is allocated: otherwise a client sending
`X#1` and then `X` with n=2 would make the fork of X's sample 1 find X#1's blocks and raise in the
middle of a step that every request shares. The Scheduler keeps one set (its groups), and the
scheduler service another (its live groups, which outlive the Scheduler's while their last tokens
are written), so that a colliding request is refused at submit, before it reaches the step loop.

Threads: its owner's (the service guards its own with the live groups' lock).
"""

from __future__ import annotations

from pagedserve.scheduler.core.request import RequestIdInUse, sample_ids


class SampleIds:
    def __init__(self) -> None:
        self._ids: set[str] = set()

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def claim(self, group_id: str, n: int, refusal: str = "is refused") -> None:
        """Take the ids of a request's n samples, or raise RequestIdInUse (naming the taken one,
        `refusal` saying what becomes of the request) and take none."""
        ids = sample_ids(group_id, n)
        taken = next((i for i in ids if i in self._ids), None)
        if taken is not None:
            what = "is" if taken == group_id else f"(n={n}) {refusal}: its sample id {taken!r} is"
            raise RequestIdInUse(f"request id {group_id!r} {what} already in use by a live request")
        self._ids.update(ids)

    def release(self, group_id: str, n: int) -> None:
        self._ids.difference_update(sample_ids(group_id, n))
