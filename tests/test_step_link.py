"""The local step link (common/step_frames.py, worker/step_socket.py, scheduler/worker_client.py)
over real Unix sockets: steps answered in order, sent ahead, large both ways without a deadlock;
a worker's error, a hung rank, a rank that dies; a quiet link gives the torch thread back; which
transport a rank gets. The ranks here are plain objects with what StepSocket needs of a
WorkerService (its torch thread, begin_step and finish_step); the real worker over both transports is
tests/test_worker_client.py's."""

import logging
import os
import stat
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedserve.common.messages import SchedulerOutput
from pagedserve.common.step_frames import (FrameReader, StepLinkError, error_reply, frame, reply_payload,
                                           result_reply)
from pagedserve.scheduler.worker_client import WorkerError, WorkerGroup, _LocalStepStream, _StepStream
from pagedserve.v1 import worker_pb2
from pagedserve.worker.server import SessionMismatch
from pagedserve.worker.step_socket import IDLE_S, StepSocket


class FakeRank:
    """What StepSocket uses of a WorkerService (its torch thread, begin_step and finish_step);
    `answer(request)` is its run_step. A begun step is done at once, as on the CPU."""

    def __init__(self, answer) -> None:
        self.torch_thread = ThreadPoolExecutor(1, thread_name_prefix="fake-torch")
        self.answer = answer
        self.threads: set[int] = set()

    def begin_step(self, request: worker_pb2.StepRequest):
        self.threads.add(threading.get_ident())
        return _Begun(request)

    def finish_step(self, begun) -> worker_pb2.StepResult:
        return self.answer(begun.request)


class _Begun:
    def __init__(self, request) -> None:
        self.request = request

    def ready(self) -> bool:
        return True


def echo(request: worker_pb2.StepRequest) -> worker_pb2.StepResult:
    return worker_pb2.StepResult(step_id=request.step_id, worker_time_s=0.001)


@pytest.fixture
def rank():
    opened = []

    def start(answer=echo):
        fake = FakeRank(answer)
        sock = StepSocket(fake)
        opened.append((fake, sock))
        return fake, sock

    yield start
    for fake, sock in opened:
        sock.close()
        fake.torch_thread.shutdown(wait=False, cancel_futures=True)


def group_on(path: str, timeout_s: float | None = 10.0) -> WorkerGroup:
    group = WorkerGroup(["127.0.0.1:1"], step_timeout_s=timeout_s)  # the gRPC channel is never used
    group.session_id = "s"
    group.infos = [worker_pb2.WorkerInfo(step_socket=path)]
    group.streams = group._open_streams()  # what init_session opens
    assert isinstance(group.streams[0], _LocalStepStream)
    return group


def empty_step(step_id: int) -> SchedulerOutput:
    return SchedulerOutput(step_id=step_id, new_requests=[], cached_requests=[], num_scheduled_tokens={})


def test_frames_are_cut_from_any_split_of_the_byte_stream():
    data = frame(b"first") + result_reply(b"\x08\x07") + error_reply("NOT_FOUND", "no request r1") + frame(b"")
    reader = FrameReader()
    bodies = []
    for i in range(len(data)):  # one byte at a time
        reader.feed(data[i:i + 1])
        while (body := reader.next()) is not None:
            bodies.append(body)
    assert bodies[0] == b"first" and bodies[3] == b""
    assert worker_pb2.StepResult.FromString(reply_payload(bodies[1])).step_id == 7
    with pytest.raises(StepLinkError) as error:
        reply_payload(bodies[2])
    assert error.value.code == "NOT_FOUND" and error.value.details() == "no request r1"
    with pytest.raises(StepLinkError, match="unknown kind"):
        reply_payload(b"\x07junk")


def test_steps_sent_ahead_are_answered_in_order_on_the_torch_thread(rank):
    fake, sock = rank()
    assert stat.S_IMODE(os.stat(os.path.dirname(sock.path)).st_mode) == 0o700  # this user's alone
    group = group_on(sock.path)
    try:
        for step_id in (1, 2, 3):
            group.send(empty_step(step_id))
        for step_id in (1, 2, 3):
            result, overhead = group.receive(empty_step(step_id), set())
            assert result.step_id == step_id and overhead >= 0.0
        result, _ = group.step(empty_step(4), set())
        assert result.step_id == 4
        torch_thread = fake.torch_thread.submit(threading.get_ident).result()
        assert fake.threads == {torch_thread}
    finally:
        group.close()
    sock.close()
    assert not os.path.exists(os.path.dirname(sock.path))


def test_large_steps_and_replies_both_ways_do_not_deadlock(rank):
    """A step sent ahead that fills the socket while the worker writes a reply that fills it the
    other way: the scheduler writes the rest of its step while it reads."""
    big = 8 << 20

    def large_reply(request):
        return worker_pb2.StepResult(step_id=request.step_id, sampled=[worker_pb2.SampledTokens(req_id="r" * big)])

    _, sock = rank(large_reply)
    stream = _LocalStepStream(sock.path)
    got = []

    def run():
        for step_id in (1, 2, 3):
            stream.send(worker_pb2.StepRequest(step_id=step_id, session_id="s" * big))
        got.extend(stream.receive() for _ in range(3))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    try:
        assert not thread.is_alive(), "the link deadlocked"
        assert [r.step_id for r in got] == [1, 2, 3] and all(len(r.sampled[0].req_id) == big for r in got)
    finally:
        stream.close()


@pytest.mark.parametrize("failure, code", [
    (SessionMismatch("step 1 belongs to another session"), "FAILED_PRECONDITION"),
    (KeyError("no request r9"), "NOT_FOUND"),
    (RuntimeError("out of memory"), "INTERNAL")])
def test_a_failed_step_fails_the_rank_with_the_workers_words(rank, failure, code):
    def fail(request):
        raise failure

    _, sock = rank(fail)
    group = group_on(sock.path)
    try:
        with pytest.raises(WorkerError, match=r"during step 1: .*(another session|no request r9|out of memory)"):
            group.step(empty_step(1), set())
        assert group.streams[0].broken.code == code
        with pytest.raises(WorkerError):  # the link stays broken until a new session opens one
            group.step(empty_step(2), set())
    finally:
        group.close()


def test_a_rank_that_never_answers_is_cancelled_at_the_step_timeout(rank):
    release = threading.Event()
    _, sock = rank(lambda request: (release.wait(30), echo(request))[1])
    group = group_on(sock.path, timeout_s=0.4)
    started = time.monotonic()
    try:
        with pytest.raises(WorkerError, match=r"during step 7: no step result within 0.4 s \(--step-timeout\)"):
            group.step(empty_step(7), set())
        assert 0.4 <= time.monotonic() - started < 3.0
    finally:
        release.set()
        group.close()


RANK_PROCESS = """
import threading
from concurrent.futures import ThreadPoolExecutor
from pagedserve.v1 import worker_pb2
from pagedserve.worker.step_socket import StepSocket

class Begun:
    def __init__(self, request):
        self.request = request
    def ready(self):
        return True

class Rank:
    torch_thread = ThreadPoolExecutor(1)
    def begin_step(self, request):
        return Begun(request)
    def finish_step(self, begun):
        return worker_pb2.StepResult(step_id=begun.request.step_id)

print(StepSocket(Rank()).path, flush=True)
threading.Event().wait()
"""


def test_a_rank_that_dies_fails_the_step_without_waiting_for_the_timeout(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", RANK_PROCESS], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    group = None
    try:
        path = proc.stdout.readline().strip()
        group = group_on(path, timeout_s=30.0)
        assert group.step(empty_step(1), set())[0].step_id == 1
        proc.kill()
        proc.wait(10)
        started = time.monotonic()
        with pytest.raises(WorkerError) as failure:
            group.step(empty_step(2), set())
        assert time.monotonic() - started < 5.0
        assert "--step-timeout" not in str(failure.value)
    finally:
        proc.kill()
        if group is not None:
            group.close()


def test_a_tmpdir_too_deep_for_a_socket_path_puts_the_socket_in_tmp(rank, tmp_path, monkeypatch):
    """A Unix socket's path holds at most 107 bytes: under a deeper $TMPDIR the link is still made
    (in a private directory in /tmp), not lost."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    assert len(os.fsencode(os.path.join(tempfile.mkdtemp(), "steps.sock"))) > 107
    fake, sock = rank()
    assert os.path.dirname(os.path.dirname(sock.path)) == "/tmp"
    assert stat.S_IMODE(os.stat(os.path.dirname(sock.path)).st_mode) == 0o700
    assert not any(name.startswith("pagedserve-worker-") for name in os.listdir(deep))
    group = group_on(sock.path)
    try:
        assert group.step(empty_step(1), set())[0].step_id == 1
    finally:
        group.close()


def test_a_quiet_link_gives_the_torch_thread_back(rank):
    fake, sock = rank()
    group = group_on(sock.path)
    try:
        group.step(empty_step(1), set())
        # The connection's task now waits for a step on the torch thread; other work (a new
        # session's Profile) runs within about IDLE_S, and the link still answers after it.
        started = time.monotonic()
        assert fake.torch_thread.submit(lambda: "profiled").result(timeout=10) == "profiled"
        assert time.monotonic() - started < IDLE_S * 5
        assert group.step(empty_step(2), set())[0].step_id == 2
    finally:
        group.close()


def test_each_rank_gets_the_local_link_only_where_it_can_be_opened(rank, tmp_path, caplog):
    _, sock = rank()
    not_a_socket = tmp_path / "steps.sock"
    not_a_socket.write_text("")
    cases = [("auto", sock.path, _LocalStepStream), ("grpc", sock.path, _StepStream),
             ("auto", "", _StepStream), ("auto", str(tmp_path / "gone.sock"), _StepStream),
             ("auto", str(not_a_socket), _StepStream)]
    for transport, path, kind in cases:
        group = WorkerGroup(["127.0.0.1:1"], transport=transport)
        group.infos = [worker_pb2.WorkerInfo(step_socket=path)]
        with caplog.at_level(logging.WARNING, logger="pagedserve.scheduler"):
            [stream] = group._open_streams()
        try:
            assert isinstance(stream, kind), (transport, path)
        finally:
            stream.close()
            group.close()
    assert "cannot be opened" in caplog.text and str(not_a_socket) in caplog.text
    # Two ranks, one without a link: both take the Step stream, never a mix.
    group = WorkerGroup(["127.0.0.1:1", "127.0.0.1:2"])
    group.infos = [worker_pb2.WorkerInfo(step_socket=sock.path), worker_pb2.WorkerInfo(rank=1)]
    streams = group._open_streams()
    try:
        assert [type(s) for s in streams] == [_StepStream, _StepStream]
    finally:
        for stream in streams:
            stream.close()
        group.close()
    with pytest.raises(ValueError, match="--worker-transport must be auto or grpc"):
        WorkerGroup(["127.0.0.1:1"], transport="zmq")


def test_ranks_whose_steps_wait_on_each_other_get_their_large_steps_in_full(rank):
    """Tensor-parallel ranks: rank 0 cannot answer a step before rank 1 has it all (their
    collectives). With steps larger than a socket's buffer, sent ahead, the step loop writes rank
    1's rest while it waits for rank 0's reply."""
    arrived = {step_id: threading.Event() for step_id in (1, 2, 3)}

    def rank0(request):
        assert arrived[request.step_id].wait(20), f"rank 1 never got step {request.step_id}"
        return echo(request)

    def rank1(request):
        arrived[request.step_id].set()
        return echo(request)

    _, sock0 = rank(rank0)
    _, sock1 = rank(rank1)
    group = WorkerGroup(["127.0.0.1:1", "127.0.0.1:2"], step_timeout_s=60.0)
    group.session_id = "s" * (8 << 20)  # every step message carries it: 8 MiB each
    group.infos = [worker_pb2.WorkerInfo(step_socket=sock0.path), worker_pb2.WorkerInfo(step_socket=sock1.path)]
    group.streams = group._open_streams()
    got = []

    def run():
        for step_id in (1, 2, 3):
            group.send(empty_step(step_id))
        got.extend(group.receive(empty_step(step_id), set())[0].step_id for step_id in (1, 2, 3))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    try:
        assert not thread.is_alive(), "the ranks deadlocked"
        assert got == [1, 2, 3]
    finally:
        group.close()


@pytest.mark.parametrize("where", ["begin", "finish"])
@pytest.mark.parametrize("failure, code", [
    (SessionMismatch("step 2 belongs to another session"), "FAILED_PRECONDITION"),
    (KeyError("no request r9"), "NOT_FOUND"),
    (RuntimeError("out of memory"), "UNKNOWN")])
def test_a_failed_step_over_grpc_fails_the_rank_after_the_steps_before_it(failure, code, where):
    """The gRPC Step stream (worker/step_stream.py, ranks on other hosts) with the same plain rank: step 1
    is answered, step 2 fails in begin or in finish, and the stream ends with the worker's status (a
    step's own failures by name; any other error as gRPC reports a handler's exception)."""
    import grpc

    from pagedserve.common.grpc_util import free_port
    from pagedserve.v1 import worker_pb2_grpc
    from pagedserve.worker.server import WorkerServicer

    def answer(request):
        if where == "finish" and request.step_id == 2:
            raise failure
        return echo(request)

    fake = FakeRank(answer)
    if where == "begin":
        begin = fake.begin_step

        def begin_step(request):
            if request.step_id == 2:
                raise failure
            return begin(request)

        fake.begin_step = begin_step
    ready = threading.Event()
    ready.set()
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(fake, ready), server)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    server.start()
    group = WorkerGroup([address], step_timeout_s=10.0, transport="grpc")
    group.session_id = "s"
    group.infos = [worker_pb2.WorkerInfo()]
    group.streams = group._open_streams()
    try:
        assert isinstance(group.streams[0], _StepStream)
        group.step(empty_step(1), set())
        with pytest.raises(WorkerError, match=r"(another session|no request r9|out of memory)"):
            group.step(empty_step(2), set())
        assert group.streams[0].broken.code().name == code
    finally:
        group.close()
        server.stop(0)
        fake.torch_thread.shutdown(wait=False, cancel_futures=True)
