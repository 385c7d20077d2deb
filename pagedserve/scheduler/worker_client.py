"""The scheduler's side of the worker ranks: one gRPC channel and one Step stream per rank.

Every step goes to every rank (tensor-parallel ranks run the same step on their shards); rank 0's
answer carries the samples. A rank that fails or stops answering raises WorkerError.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc

from pagedserve.common import wire
from pagedserve.common.grpc_util import internal_channel, wait_for_health
from pagedserve.common.messages import ModelRunnerOutput, SchedulerOutput
from pagedserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("pagedserve.scheduler")

_CLOSE = object()


class WorkerError(RuntimeError):
    pass


class _StepStream:
    """A bidi Step stream fed from a queue: send() then receive(), one message each per step. A
    reader thread drains the responses so that receive() can give up after a deadline (a stopped
    or hung rank never answers, and a plain next() on the stream would wait forever)."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub) -> None:
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.responses = stub.Step(iter(self.outbox.get, _CLOSE))
        threading.Thread(target=self._read, name="step-reader", daemon=True).start()

    def _read(self) -> None:
        try:
            for response in self.responses:
                self.inbox.put(response)
            self.inbox.put(StopIteration())
        except grpc.RpcError as exc:
            self.inbox.put(exc)

    def send(self, message: worker_pb2.StepRequest) -> None:
        self.outbox.put(message)

    def receive(self, timeout_s: float | None = None) -> worker_pb2.StepResult:
        try:
            item = self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError from None
        if isinstance(item, BaseException):
            self.inbox.put(item)  # the stream stays broken
            raise item
        return item

    def close(self) -> None:
        self.outbox.put(_CLOSE)
        self.responses.cancel()


class WorkerGroup:
    def __init__(self, addresses: list[str], step_timeout_s: float | None = None) -> None:
        if not addresses:
            raise ValueError("at least one worker address is needed (--worker-addrs)")
        self.addresses = addresses
        self.step_timeout_s = step_timeout_s  # a step with no answer by then counts as a dead rank
        self.channels = [internal_channel(a) for a in addresses]
        self.stubs = [worker_pb2_grpc.WorkerStub(c) for c in self.channels]
        self.streams: list[_StepStream] = []
        self.session_id = ""
        self.info: worker_pb2.WorkerInfo | None = None

    def connect(self, timeout_s: float) -> worker_pb2.WorkerInfo:
        """Wait until every rank has loaded its model; return rank 0's description."""
        for address in self.addresses:
            wait_for_health(address, timeout_s)
        infos = [stub.Describe(worker_pb2.DescribeRequest(), timeout=30) for stub in self.stubs]
        for rank, info in enumerate(infos):
            if info.rank != rank:
                raise WorkerError(f"the worker at {self.addresses[rank]} is rank {info.rank}, "
                                  f"but it is listed as rank {rank} in --worker-addrs")
        self.info = infos[0]
        return self.info

    def init_session(self, profile: worker_pb2.ProfileRequest) -> worker_pb2.ProfileResponse:
        """Size the KV pool (the smallest any rank can hold), allocate it on every rank and open
        the Step streams. A new session id makes the workers drop every earlier request."""
        self.close_streams()
        # Concurrently: on CUDA each rank profiles a forward pass whose collectives need every rank.
        with ThreadPoolExecutor(len(self.stubs)) as pool:
            sizes = list(pool.map(lambda stub: stub.Profile(profile, timeout=600), self.stubs))
        smallest = min(sizes, key=lambda s: s.num_gpu_blocks)
        self.session_id = uuid.uuid4().hex[:12]
        request = worker_pb2.InitCacheRequest(num_gpu_blocks=smallest.num_gpu_blocks,
                                              num_cpu_blocks=min(s.num_cpu_blocks for s in sizes),
                                              block_size=profile.block_size, session_id=self.session_id)
        for stub in self.stubs:
            stub.InitCache(request, timeout=600)
        self.streams = [_StepStream(stub) for stub in self.stubs]
        return smallest

    def step(self, step: SchedulerOutput, wants_logprobs: set[str]) -> tuple[ModelRunnerOutput, float]:
        """Run one step on every rank; return rank 0's output and the round trip beyond the
        worker's own time (serialisation, the network, gRPC)."""
        message = wire.step_to_proto(step, self.session_id)
        started = time.perf_counter()
        try:
            for stream in self.streams:
                stream.send(message)
            deadline = None if self.step_timeout_s is None else started + self.step_timeout_s
            results = [stream.receive(None if deadline is None else max(0.0, deadline - time.perf_counter()))
                       for stream in self.streams]
        except (grpc.RpcError, StopIteration, TimeoutError) as exc:
            if isinstance(exc, TimeoutError):
                detail = f"no step result within {self.step_timeout_s:g} s (--step-timeout)"
            else:
                detail = exc.details() if isinstance(exc, grpc.RpcError) else "the stream ended"
            raise WorkerError(f"a worker rank failed during step {step.step_id}: {detail}") from exc
        elapsed = time.perf_counter() - started
        first = results[0]
        return wire.result_from_proto(first, wants_logprobs), max(0.0, elapsed - first.worker_time_s)

    def close_streams(self) -> None:
        for stream in self.streams:
            stream.close()
        self.streams = []

    def close(self) -> None:
        self.close_streams()
        for channel in self.channels:
            channel.close()
