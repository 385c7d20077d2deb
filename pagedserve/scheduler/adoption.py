"""Adopting the request of a dead engine replica (docs/scale-out.md, "Failover").

A tokenizer whose stream to a replica broke re-attaches each request (attach=true, skip_tokens)
to another replica once the first is out of the registry. The adopter finds the request's record
in the shared Redis, and adopts it only if its owner no longer heart-beats: it moves the id from
the owner's active set to its own (SMOVE: of several adopters exactly one wins, and a restarted
owner will not re-admit it), then resumes it by recompute from the stored tokens, as a restarted
scheduler does (recovery.py). The service then attaches the subscriber as to a live request: it
replays the tokens so far and the tokenizer's skip_tokens drops those it had delivered.

Its interface: `adopt(record)`. Threads: the gRPC event loop (from SchedulerService.submit); the
resumed Requests reach the Scheduler through a step-loop command.
"""

from __future__ import annotations

import logging

import grpc

from pagedserve.common.grpc_util import StatusError
from pagedserve.common.replicas import RegistryKeys
from pagedserve.common.store import RequestStore, StoredRequest
from pagedserve.scheduler.records import GroupState, LiveGroups
from pagedserve.scheduler.recovery import Recovery
from pagedserve.scheduler.step_loop import StepLoop

log = logging.getLogger("pagedserve.scheduler")


class Adoption:
    def __init__(self, store: RequestStore, live: LiveGroups, recovery: Recovery, step_loop: StepLoop) -> None:
        self.store, self.live, self.recovery, self.step_loop = store, live, recovery, step_loop

    def adopt(self, record: StoredRequest) -> GroupState | None:
        """The live group of an adopted request (its Requests on their way to the Scheduler); None
        when this replica does not adopt it (no replicas, finished, or its own): the stored record
        answers then. Raises UNAVAILABLE (the tokenizer retries elsewhere) while its owner still
        lives."""
        me = getattr(self.store, "replica_id", "")
        if not me or record.status == "finished":
            return None
        owner = self.store.owner(record.request_id)
        if owner == me:
            return None
        if owner and self.store.client.exists(RegistryKeys(self.store.prefix).info(owner)):
            raise StatusError(grpc.StatusCode.UNAVAILABLE,
                              f"request {record.request_id!r} runs on replica {owner!r}, which is alive")
        if not self.store.adopt(record.request_id, owner, me):
            raise StatusError(grpc.StatusCode.UNAVAILABLE,
                              f"request {record.request_id!r} was adopted by another replica or finished")
        record = self.store.load(record.request_id) or record  # the latest tokens, after the move
        group, requests = self.recovery.resume_plan(record)
        if not requests:
            return None
        with self.live.lock:
            self.live.claim(group)
        self.step_loop.post(lambda: self.recovery.add_resumed(record, requests))
        log.info("adopted request %s from replica %s (%d tokens so far); it resumes by recompute",
                 record.request_id, owner or "?", sum(len(o) for o in record.outputs))
        return group
