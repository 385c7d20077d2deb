"""An engine replica's heartbeat (docs/scale-out.md): every --heartbeat-interval seconds the
replica publishes its address, model, capacity, load and prefix cache's change to the Redis
registry (common/replicas.py). A replica is registered only once it is ready, and a clean stop
takes it out at once; one that dies drops out --heartbeat-ttl seconds after its last beat.

Threads: one "heartbeat" thread. The load and the prefix cache's hashes are read on the step-loop
thread (a command; the only thread that may walk the Scheduler), between two steps; when the loop
does not answer within the interval (a long step, a dead worker) the beat still goes out with the
last load known, so that a busy replica is not mistaken for a dead one.
"""

from __future__ import annotations

import logging
import threading
import time

from pagedserve.common.replicas import ReplicaInfo, ReplicaPublisher

log = logging.getLogger("pagedserve.scheduler")


class Heartbeat:
    def __init__(self, service, publisher: ReplicaPublisher, addr: str, interval_s: float) -> None:
        self.service, self.publisher, self.addr, self.interval_s = service, publisher, addr, interval_s
        self.started = time.time()
        self.last: tuple[ReplicaInfo, list[int]] | None = None
        self.thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self.failing = False
        self.halt = threading.Event()

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.halt.set()
        if self.thread.is_alive():
            self.thread.join(timeout=self.interval_s + 6)
        try:
            self.publisher.remove()
        except Exception as exc:  # noqa: BLE001 - it then expires with its TTL
            log.info("replica %s: could not leave the registry (%s)", self.publisher.id, exc)

    def _run(self) -> None:
        while not (self.halt.is_set() or self.service.stopping.is_set()):
            self.beat()
            self.halt.wait(self.interval_s)

    def beat(self) -> None:
        snapshot = self._snapshot()
        if snapshot is not None:
            self.last = snapshot
        if self.last is None:
            return
        info, hashes = self.last
        info.healthy = not self.service.unhealthy_cause()
        try:
            self.publisher.beat(info, hashes if snapshot is not None else None)
            if self.failing:
                log.info("replica %s: heartbeat published again", self.publisher.id)
            self.failing = False
        except Exception as exc:  # noqa: BLE001 - Redis away: health says so; keep beating
            if not self.failing:
                log.warning("replica %s: heartbeat failed (%s)", self.publisher.id, exc)
            self.failing = True

    def _snapshot(self) -> tuple[ReplicaInfo, list[int]] | None:
        """(info, prefix cache hashes, most recently cached last), taken on the step loop."""
        service = self.service
        if not service.ready or service.step_loop is None:
            return None
        done = threading.Event()
        out: list = []

        def take() -> None:
            sched = service.scheduler
            bm = sched.block_manager
            cfg = sched.config
            info = ReplicaInfo(
                id=self.publisher.id, addr=self.addr, model=service.model_name(),
                num_gpu_blocks=bm.num_total_blocks, block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                num_waiting=len(sched.waiting) + service.step_loop.pending_admissions, num_running=len(sched.running),
                waiting_tokens=sum(r.num_tokens for r in sched.waiting),
                running_tokens=sum(r.num_tokens for r in sched.running), kv_usage=round(bm.usage(), 4),
                pending_tokens=sum(max(0, r.num_tokens - r.num_computed_tokens) for q in (sched.waiting, sched.running)
                                   for r in q),
                prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits, started=self.started)
            out.append((info, list(bm.pool.cached)))  # dict order: most recently cached last
            done.set()

        service.step_loop.post(take)
        return out[0] if done.wait(self.interval_s) and out else None
