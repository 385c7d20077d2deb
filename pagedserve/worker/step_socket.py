"""The worker's end of the local step link (pagedserve/common/step_frames.py): a Unix socket in a
private directory (mode 0700: only this user's processes on this host can connect) whose
connections carry the Step stream's messages, read and answered on the torch thread itself.

Threads: one accept thread; each connection is served by a task on WorkerService.torch_thread,
which reads a step, runs it, writes its reply and reads the next; a step the scheduler sent ahead
is already in the socket when the one before it ends, so no thread is woken between the two.
When no step comes for IDLE_S the task queues itself again behind whatever else waits for the
torch thread (Profile and InitCache of a new session), so a quiet connection never holds it.

Invariants: replies go out in request order, one per request; after an error reply the
connection is closed (the scheduler then treats the rank as failed, as after a gRPC status).
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import socket
import tempfile
import threading

from pagedserve.common.step_frames import FrameReader, error_reply, result_reply
from pagedserve.v1 import worker_pb2
from pagedserve.worker.step_errors import step_failure

log = logging.getLogger("pagedserve.worker")

IDLE_S = 0.1  # a connection with no step for this long gives the torch thread back
RECV_BYTES = 1 << 20


class StepSocket:
    """Listens on <private dir>/steps.sock for `service` (a WorkerService); close() removes it."""

    def __init__(self, service) -> None:
        self.service = service
        self.directory = tempfile.mkdtemp(prefix="pagedserve-worker-")  # 0700
        self.path = os.path.join(self.directory, "steps.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(8)
        self.closed = False
        threading.Thread(target=self._accept, name="step-socket", daemon=True).start()

    def close(self) -> None:
        self.closed = True
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            poller = select.poll()
            poller.register(conn, select.POLLIN)
            self.service.torch_thread.submit(self._serve, conn, poller, FrameReader(),
                                             memoryview(bytearray(RECV_BYTES)))

    def _serve(self, conn: socket.socket, poller: select.poll, reader: FrameReader, received: memoryview) -> None:
        """On the torch thread: answer the connection's steps until it is idle, closed or failed."""
        while True:
            if self.closed:  # the worker is stopping: the scheduler sees the link end, as a stream's
                conn.close()
                return
            body = reader.next()
            if body is None:
                if not poller.poll(IDLE_S * 1000):  # idle: let other torch-thread work run, then come back
                    self.service.torch_thread.submit(self._serve, conn, poller, reader, received)
                    return
                try:
                    size = conn.recv_into(received)  # into one buffer: no allocation per step
                except OSError:
                    size = 0
                if not size:  # the scheduler closed it (a new session, or it went away)
                    conn.close()
                    return
                reader.feed(received[:size])
                continue
            reply, failed = self._answer(body)
            try:
                conn.sendall(reply)
            except OSError:
                failed = True
            if failed:
                conn.close()
                return

    def _answer(self, body: bytes) -> tuple[bytes, bool]:
        """The reply frame to one request, and whether it ends the connection."""
        try:
            request = worker_pb2.StepRequest.FromString(body)
            result = self.service.run_step(request)
        except Exception as exc:  # noqa: BLE001 - the scheduler recovers the ranks; this worker stays up
            failure = step_failure(exc)
            if failure is not None:
                return error_reply(*failure), True
            log.exception("a step on the local step link failed")
            return error_reply("INTERNAL", f"the step failed on the worker: {exc}"), True
        return result_reply(result.SerializeToString()), False
