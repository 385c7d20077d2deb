"""Recovery of the scheduler service: re-admitting unfinished requests from the store after a
restart, and re-initialising the workers after a rank died or hung. Every request survives both
and resumes by recompute; tokens already delivered are never sent again.

Its interface: `readmit_from_store(live)` (at start), `resume_plan(record)` and
`add_resumed(record, requests)` (also for adoption.py), `recover_workers(cause)` (the step loop,
on a WorkerError) and `num_worker_recoveries`.

Threads: `readmit_from_store` runs in start() before the step loop exists; `add_resumed` and
`recover_workers` on the step-loop thread (the latter blocks the loop until the workers are back);
`resume_plan` touches no scheduler state (any thread).
"""

from __future__ import annotations

import json
import logging
import threading
import time

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.store import RecordWrite, RequestStore
from pagedserve.scheduler.core.scheduler import Scheduler
from pagedserve.scheduler.health import Health
from pagedserve.scheduler.records import GroupState, LiveGroups, resumed_requests
from pagedserve.v1 import worker_pb2

log = logging.getLogger("pagedserve.scheduler")


class Recovery:
    def __init__(self, store: RequestStore, workers, scheduler: Scheduler, health: Health,
                 stopping: threading.Event, profile: worker_pb2.ProfileRequest,
                 eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        """profile: what opened the workers' session at start; a new session asks for the same."""
        self.store, self.workers, self.scheduler, self.health = store, workers, scheduler, health
        self.stopping, self.profile = stopping, profile
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len
        self.num_worker_recoveries = 0

    def readmit_from_store(self, live: LiveGroups) -> list[str]:
        """The ids of the unfinished requests of the store, now live and handed to the scheduler."""
        readmitted = []
        for request_id in self.store.active_ids():
            record = self.store.load(request_id)
            if record is None:
                continue
            group, requests = self.resume_plan(record)
            if not requests:
                continue
            self.add_resumed(record, requests)  # (the Scheduler refuses colliding ids first)
            with live.lock:
                live.claim(group)
            readmitted.append(request_id)
        if readmitted:
            log.info("re-admitted %d unfinished request(s) from the store; they resume by recompute",
                     len(readmitted))
        return readmitted

    def resume_plan(self, record) -> tuple[GroupState | None, list]:
        """The group and the Requests that resume a stored unfinished request by recompute; a
        record that cannot resume, or whose samples had all finished, is marked finished (no
        requests then). Touches no scheduler state: any thread."""
        request_id = record.request_id
        try:
            params = SamplingParams(**record.params)
            group = GroupState(request_id, record.n, record.prompt_token_ids, params, record.priority,
                               dict(record.timings), [""] * record.n, images=record.images)
            group.timings.pop("worker_time_s", None)
            requests, reasons = resumed_requests(record, params, self.eos_token_ids, self.max_model_len,
                                                 record.timings.get("scheduler_received", time.time()))
            group.finish_reasons = reasons
        except (TypeError, ValueError) as exc:
            log.warning("request %s cannot be resumed (%s): marked aborted", request_id, exc)
            requests, group = [], None
        if not requests:
            fields = {"status": "finished"}
            if group is not None:
                fields["finish_reasons"] = json.dumps(group.finish_reasons)
            self.store.write([RecordWrite(request_id, fields, finished=True)])
        return group, requests

    def add_resumed(self, record, requests: list) -> None:
        """On the step-loop thread (or before it runs): hand the resumed Requests to the scheduler."""
        if requests and not any(record.outputs):
            self.scheduler.add_request(requests[0])  # n samples fork from the prompt as usual
        elif requests:
            self.scheduler.add_resumed_group(requests)

    def recover_workers(self, cause: str) -> None:
        """A rank died or hung. Every request is kept (the scheduler holds its tokens so far, the
        store its record): mark the engine unhealthy, wait until every rank answers again (the
        launcher or the container runtime restarts dead ones), open a new session on them (they
        forget every request) and put every request back to waiting to resume by recompute.
        Clients see a pause; tokens already delivered are not sent again."""
        failed_at = time.monotonic()
        self.health.worker_gone(cause)
        log.error("%s; keeping %d request(s) in flight until the workers are back", cause,
                  len(self.scheduler.requests))
        self.workers.close_streams()
        attempt = 0
        while not self.stopping.is_set():
            try:
                self.workers.connect(min(5.0 + attempt, 30.0))
                sizes = self.workers.init_session(self.profile)  # a fresh KV pool: a new session
            except Exception as exc:  # noqa: BLE001 - keep trying until stopped
                attempt += 1
                if attempt == 1 or attempt % 10 == 0:
                    log.warning("workers not back yet: %s", exc)
                time.sleep(0.5)
                continue
            moved = self.scheduler.preempt_all_for_new_session(sizes.num_gpu_blocks, sizes.num_cpu_blocks)
            self.num_worker_recoveries += 1
            self.health.worker_back()
            log.info("the workers answer again after %.1f s: %d request(s) resume by recompute (%d were running)",
                     time.monotonic() - failed_at, len(self.scheduler.waiting), moved)
            return
