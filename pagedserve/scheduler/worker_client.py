"""The scheduler's side of the worker ranks: one gRPC channel per rank, and one step stream: the
gRPC Step stream, or the rank's local step link (its Unix socket, common/step_frames.py) when the
rank is on this host and --worker-transport is auto.

Every step goes to every rank (tensor-parallel ranks run the same step on their shards); rank 0's
answer carries the samples. A rank that fails or stops answering raises WorkerError. Steps may be
sent ahead of the last one's results (send, then receive in the same order): the streams keep order.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import socket
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import grpc

from pagedserve.common import wire
from pagedserve.common.grpc_util import internal_channel, wait_for_health
from pagedserve.common.messages import ModelRunnerOutput, SchedulerOutput
from pagedserve.common.step_frames import FrameReader, StepLinkError, frame, reply_payload
from pagedserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("pagedserve.scheduler")

_CLOSE = object()
RECV_BYTES = 1 << 20  # the local step link's read size


class WorkerError(RuntimeError):
    pass


class _StepStream:
    """A bidi Step stream fed from a queue: send() then receive(), one message each per step.
    receive() reads the stream on the caller's thread (the step loop): no reader thread and no
    second queue between the answer and the step, one thread hand-off fewer per step. A stopped or
    hung rank is the _Watchdog's business: it cancels the stream, and receive() raises."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub) -> None:
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.responses = stub.Step(iter(self.outbox.get, _CLOSE))
        self.broken: BaseException | None = None  # the stream stays broken

    def send(self, message: worker_pb2.StepRequest) -> None:
        self.outbox.put(message)

    def receive(self, peers=()) -> worker_pb2.StepResult:
        """The next answer (`peers` is the local link's business: gRPC sends on its own thread)."""
        if self.broken is not None:
            raise self.broken
        try:
            return next(self.responses)
        except (grpc.RpcError, StopIteration) as exc:
            self.broken = exc
            raise

    def cancel(self) -> None:
        self.responses.cancel()

    def close(self) -> None:
        self.outbox.put(_CLOSE)
        self.responses.cancel()


class _LocalStepStream:
    """The same protocol as _StepStream over the rank's Unix socket, on the step loop's thread
    alone: send() writes what the socket takes now and keeps the rest; receive() waits for the
    reply while writing that rest, so a large step sent ahead can never block on a worker that is
    itself blocked writing a large reply. cancel() (the _Watchdog's) shuts the socket down."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect(path)
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)
        self.poller = select.poll()
        self.reader = FrameReader()
        self.received = memoryview(bytearray(RECV_BYTES))  # recv_into: no allocation per step
        self.unsent = bytearray()
        self.cancelled = False
        self.broken: BaseException | None = None

    def send(self, message: worker_pb2.StepRequest) -> None:
        if self.broken is not None:
            return  # receive() raises it
        self.unsent += frame(message.SerializeToString())
        self._write()

    def _write(self) -> None:
        try:
            del self.unsent[:self.sock.send(self.unsent)]
        except BlockingIOError:
            pass
        except OSError as exc:
            self.broken = StepLinkError("UNAVAILABLE", f"the local step link failed: {exc}")

    def receive(self, peers: list[_LocalStepStream] = ()) -> worker_pb2.StepResult:
        """This rank's next reply. Meanwhile the rest of the steps sent to `peers` (the other
        ranks) is written too: a rank whose step is not all sent would hold up this rank's
        collectives, and with them this reply."""
        own = self.sock.fileno()
        while self.broken is None:
            body = self.reader.next()
            if body is not None:
                try:
                    return worker_pb2.StepResult.FromString(reply_payload(body))
                except StepLinkError as exc:
                    self.broken = exc
                    break
            self.poller.register(own, select.POLLIN | (select.POLLOUT if self.unsent else 0))
            writing = {peer.sock.fileno(): peer for peer in peers
                       if peer is not self and peer.unsent and peer.broken is None}
            for fd in writing:
                self.poller.register(fd, select.POLLOUT)
            events = self.poller.poll()
            for fd in writing:
                self.poller.unregister(fd)
            for fd, _ in events:
                if fd in writing:
                    writing[fd]._write()  # a failure there is that rank's receive()'s to raise
            if any(fd == own and mask & select.POLLOUT for fd, mask in events):
                self._write()
            if any(fd == own and mask & (select.POLLIN | select.POLLHUP | select.POLLERR) for fd, mask in events):
                try:
                    size = self.sock.recv_into(self.received)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    size, why = 0, str(exc)
                else:
                    why = "the worker closed its step link"
                if not size:
                    code = "CANCELLED" if self.cancelled else "UNAVAILABLE"
                    self.broken = StepLinkError(code, "cancelled" if self.cancelled else why)
                    break
                self.reader.feed(self.received[:size])
        raise self.broken

    def cancel(self) -> None:
        self.cancelled = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.cancel()
        self.sock.close()


class _Watchdog:
    """Cancels the Step streams of a step that outlives its deadline. The step loop arms and
    disarms it with two plain assignments (no wake-up on the hot path); its thread polls a few times
    per timeout, so a hung rank is noticed within timeout * 1.25."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.deadline: float | None = None
        self.streams: list[_StepStream] = []
        self.fired = False
        self.closed = threading.Event()
        threading.Thread(target=self._run, name="step-watchdog", daemon=True).start()

    def arm(self, streams: list[_StepStream]) -> None:
        self.fired = False
        self.streams = streams
        self.deadline = time.monotonic() + self.timeout_s

    def disarm(self) -> None:
        self.deadline = None

    def _run(self) -> None:
        while not self.closed.wait(min(1.0, self.timeout_s / 4)):
            deadline, streams = self.deadline, self.streams
            if deadline is not None and time.monotonic() > deadline:
                self.fired = True
                self.deadline = None
                for stream in streams:
                    stream.cancel()


class WorkerGroup:
    def __init__(self, addresses: list[str], step_timeout_s: float | None = None, transport: str = "auto") -> None:
        if not addresses:
            raise ValueError("at least one worker address is needed (--worker-addrs)")
        self.addresses = addresses
        self.step_timeout_s = step_timeout_s  # a step with no answer by then counts as a dead rank
        if transport not in ("auto", "grpc"):
            raise ValueError(f"--worker-transport must be auto or grpc, not {transport!r}")
        self.transport = transport  # auto: each rank's local step link when it can be opened
        self.watchdog = _Watchdog(step_timeout_s) if step_timeout_s else None
        self.channels = [internal_channel(a) for a in addresses]
        self.stubs = [worker_pb2_grpc.WorkerStub(c) for c in self.channels]
        self.streams: list[_StepStream] = []
        self._sent: deque[float] = deque()  # when each step sent and not yet received was sent
        self._last_received = 0.0
        self.session_id = ""
        self.info: worker_pb2.WorkerInfo | None = None
        self.infos: list[worker_pb2.WorkerInfo] = []  # every rank's, as connect() last read them

    def connect(self, timeout_s: float) -> worker_pb2.WorkerInfo:
        """Wait until every rank has loaded its model; return rank 0's description."""
        for address in self.addresses:
            wait_for_health(address, timeout_s)
        infos = [stub.Describe(worker_pb2.DescribeRequest(), timeout=30) for stub in self.stubs]
        for rank, info in enumerate(infos):
            if info.rank != rank:
                raise WorkerError(f"the worker at {self.addresses[rank]} is rank {info.rank}, "
                                  f"but it is listed as rank {rank} in --worker-addrs")
        self.infos = infos
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
        self.streams = self._open_streams()
        return smallest

    def _open_streams(self) -> list[_StepStream] | list[_LocalStepStream]:
        """Every rank's local step link where each has one this process can open, else every
        rank's Step stream: never a mix (a rank's step half-written on a link while the step loop
        waits on a gRPC stream would hold up the others' collectives)."""
        links = []
        for rank in range(len(self.stubs)):
            path = self.infos[rank].step_socket if rank < len(self.infos) else ""
            if self.transport != "auto" or not path or not os.path.exists(path):
                break
            try:
                links.append(_LocalStepStream(path))
            except OSError as exc:
                log.warning("rank %d's local step link %s cannot be opened (%s): steps go over gRPC", rank, path, exc)
                break
        if len(links) == len(self.stubs):
            log.info("steps go to %d rank(s) over their local step links", len(links))
            return links
        for link in links:
            link.close()
        return [_StepStream(stub) for stub in self.stubs]

    def step(self, step: SchedulerOutput, wants_logprobs: set[str]) -> tuple[ModelRunnerOutput, float]:
        """Run one step on every rank; return rank 0's output and the round trip beyond the
        worker's own time (serialisation, the network, gRPC)."""
        self.send(step)
        return self.receive(step, wants_logprobs)

    def send(self, step: SchedulerOutput) -> None:
        """Queue a step on every rank's stream. The ranks run their steps in the order sent; one
        may be sent before the last one's results are received (async scheduling)."""
        message = wire.step_to_proto(step, self.session_id)
        for stream in self.streams:
            stream.send(message)
        self._sent.append(time.perf_counter())

    def receive(self, step: SchedulerOutput, wants_logprobs: set[str]) -> tuple[ModelRunnerOutput, float]:
        """The results of the oldest step sent (`step`): rank 0's output, and the time beyond the
        worker's own from when the ranks could start it (sent, and the step before it received)
        to its results here."""
        sent = self._sent.popleft() if self._sent else time.perf_counter()
        if self.watchdog is not None:
            self.watchdog.arm(self.streams)
        try:
            results = [stream.receive(self.streams) for stream in self.streams]
        except (grpc.RpcError, StepLinkError, StopIteration) as exc:
            if self.watchdog is not None and self.watchdog.fired:
                detail = f"no step result within {self.step_timeout_s:g} s (--step-timeout)"
            else:
                detail = "the stream ended" if isinstance(exc, StopIteration) else exc.details()
            raise WorkerError(f"a worker rank failed during step {step.step_id}: {detail}") from exc
        finally:
            if self.watchdog is not None:
                self.watchdog.disarm()
        received = time.perf_counter()
        elapsed = received - max(sent, self._last_received)
        self._last_received = received
        first = results[0]
        if first.step_id != step.step_id:
            raise WorkerError(f"rank 0 answered step {first.step_id} where step {step.step_id} was due")
        return wire.result_from_proto(first, wants_logprobs), max(0.0, elapsed - first.worker_time_s)

    def close_streams(self) -> None:
        for stream in self.streams:
            stream.close()
        self.streams = []
        self._sent.clear()

    def close(self) -> None:
        self.close_streams()
        if self.watchdog is not None:
            self.watchdog.closed.set()
        for channel in self.channels:
            channel.close()
