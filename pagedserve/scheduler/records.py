"""The scheduler service's requests: each client request's state (GroupState), the live ones
(LiveGroups), and their records and delivery: what the scheduler writes to the store each step,
and the thread that writes it and then hands the step's tokens to the subscribed streams (one
hand-over per stream and step; see subscriptions.py).

LiveGroups holds each request from its admission until its last tokens are published, and every
sample id they hold. The gRPC event loop (admission, attach, leave, abort), the step loop
(publish, fail) and the record writer (forget) all use it: its `lock` guards `groups`, `ids` and
each group's subscriber list; whoever walks a group's subscribers takes it (the record writer is
handed the same lock). Invariant: `ids` holds exactly the sample ids (core/sample_ids.py) of the
groups in `groups`, so two concurrent submits of one id cannot both be admitted.

Tokens reach a client only after the step that made them is in the store ("durable before
delivered"), so a restarted scheduler never resumes behind what a client has already seen.
The write runs on its own thread, off the step loop's critical path.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import grpc

from pagedserve.common.grpc_util import StatusError
from pagedserve.common.multimodal import ImageInput, images_to_json
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.stop_rules import finish_reason
from pagedserve.common.store import RecordWrite, RequestStore, StoredRequest
from pagedserve.scheduler.core.request import Request, RequestIdInUse
from pagedserve.scheduler.core.sample_ids import SampleIds
from pagedserve.scheduler.subscriptions import Delivery, Subscription

log = logging.getLogger("pagedserve.scheduler")


@dataclass(slots=True)
class GroupState:
    """The service's view of one client request (n samples share it)."""
    group_id: str
    n: int
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    timings: dict[str, float]
    finish_reasons: list[str]
    subscribers: list[Subscription] = field(default_factory=list)
    worker_time_s: float = 0.0
    num_steps: int = 0
    last_step_id: int = -1
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    done: bool = False
    num_prefill_chunks: int = 0
    prefill_chunks: list[tuple[float, int]] = field(default_factory=list)  # (scheduled at, tokens): the first 64
    output_tokens: int = 0  # summed over the samples
    spec_draft_tokens: int = 0  # speculative decoding: proposed for its samples, and accepted
    spec_accepted_tokens: int = 0
    # Samples the Scheduler has let go (finished or aborted) while the group is still live: a
    # subscriber attaching before the group is forgotten is replayed their tokens from here.
    ended_samples: dict[int, Request] = field(default_factory=dict)
    images: tuple[ImageInput, ...] = ()  # a multimodal model's, in prompt order (common/multimodal.py)

    def timings_snapshot(self) -> dict:
        spec = {"spec_draft_tokens": self.spec_draft_tokens,
                "spec_accepted_tokens": self.spec_accepted_tokens} if self.spec_draft_tokens else {}
        return {**self.timings, **spec, "worker_time_s": self.worker_time_s, "num_steps": self.num_steps,
                "num_preemptions": self.num_preemptions, "prefill_chunks": self.num_prefill_chunks}

    def creation_fields(self) -> dict[str, str]:
        return {"status": "waiting", "prompt": json.dumps(self.prompt_token_ids),
                "params": json.dumps(self.params.to_dict()), "n": str(self.n), "priority": str(self.priority),
                "timings": json.dumps(self.timings_snapshot()), "finish_reasons": json.dumps(self.finish_reasons),
                **({"images": images_to_json(self.images)} if self.images else {})}


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


class RecordWriter:
    """Writes each step's records in one round trip, then publishes that step's deliveries."""

    def __init__(self, store: RequestStore, lock: threading.Lock, on_group_done) -> None:
        self.store = store
        self.lock = lock  # guards every GroupState.subscribers list
        self.on_group_done = on_group_done
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.store_healthy = True
        self.thread = threading.Thread(target=self._run, name="record-writer", daemon=True)
        self.thread.start()

    def submit(self, writes: list[RecordWrite], publishes: list[tuple[GroupState, list[Delivery]]],
               done: list[GroupState] = (), only_to: Subscription | None = None) -> None:
        self.inbox.put((writes, publishes, list(done), only_to))

    def stop(self) -> None:
        self.inbox.put(None)
        self.thread.join(timeout=5)

    def _run(self) -> None:
        while (batch := self.inbox.get()) is not None:
            writes, publishes, done, only_to = batch
            try:
                self.store.write(writes)
                if not self.store_healthy:
                    log.info("the request store answers again")
                self.store_healthy = True
            except Exception as exc:  # noqa: BLE001 - a store outage must not stop generation
                if self.store_healthy:
                    log.warning("writing request records failed (%s); generation goes on without durability", exc)
                self.store_healthy = False
            # One hand-over per stream: a tokenizer's Stream carries all its requests of the step.
            batches: dict = {}
            with self.lock:
                for group, deliveries in publishes:
                    targets = [only_to] if only_to is not None else group.subscribers
                    for sub in targets:
                        batches.setdefault(sub.outbox, []).append((sub, (only_to is not None, deliveries)))
            for outbox, items in batches.items():
                outbox.post(items)
            for group in done:
                self.on_group_done(group)


# ---- re-admission after a restart -----------------------------------------------------------
def sample_finish_reason(outputs: list[int], params: SamplingParams, num_prompt_tokens: int,
                         eos_token_ids: tuple[int, ...], max_model_len: int) -> str:
    """Whether a stored sample had already finished (its last write may have been lost)."""
    return finish_reason(outputs, num_prompt_tokens, params, eos_token_ids, max_model_len)


def resumed_requests(record: StoredRequest, params: SamplingParams, eos_token_ids: tuple[int, ...],
                     max_model_len: int, received_wall: float) -> tuple[list[Request], list[str]]:
    """The Requests that re-run a stored request by recompute, and each sample's finish reason."""
    prompt = record.prompt_token_ids
    arrival = time.monotonic() - max(0.0, time.time() - received_wall)  # keep the original FCFS order
    reasons = [record.finish_reasons[i] if i < len(record.finish_reasons) else "" for i in range(record.n)]
    outputs = record.outputs + [[] for _ in range(record.n - len(record.outputs))]
    for i in range(record.n):
        if not reasons[i] and outputs[i]:
            reasons[i] = sample_finish_reason(outputs[i], params, len(prompt), eos_token_ids, max_model_len)
    if not any(outputs):  # never sampled: the samples fork from the prompt as usual
        if reasons[0]:
            return [], reasons
        return [Request(record.request_id, list(prompt), len(prompt), params, eos_token_ids,
                        record.priority, arrival, images=record.images)], reasons
    requests = [Request(record.request_id if i == 0 else f"{record.request_id}#{i}", prompt + outputs[i],
                        len(prompt), params, eos_token_ids, record.priority, arrival,
                        group_id=record.request_id, sample_index=i, images=record.images)
                for i in range(record.n) if not reasons[i]]
    return requests, reasons
