"""The worker's end of the local step link (pagedserve/common/step_frames.py): a Unix socket in a
private directory (mode 0700: only this user's processes on this host can connect) whose
connections carry the Step stream's messages, read and answered on the torch thread itself.

Threads: one accept thread; each connection is served by a task on WorkerService.torch_thread,
which reads a step, runs it, writes its reply and reads the next; a step the scheduler sent ahead
is already in the socket when the one before it ends, so no thread is woken between the two. On a
GPU, a step sent ahead that arrives while the device still runs the one before begins at once, its
tokens read on the device (WorkerService.begin_step), and the one before is answered after it.
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
import time

from pagedserve.common.step_frames import FrameReader, error_reply, result_reply
from pagedserve.v1 import worker_pb2
from pagedserve.worker.step_errors import step_failure

log = logging.getLogger("pagedserve.worker")

IDLE_S = 0.1  # a connection with no step for this long gives the torch thread back
WAIT_S = 20e-6  # a begun step's wait between looks at the device and the socket
RECV_BYTES = 1 << 20
SUN_PATH_MAX = 107  # the bytes of a Unix socket's path (sockaddr_un.sun_path, less its NUL, on Linux)


def private_directory() -> str:
    """A new directory of mode 0700 for the socket: in $TMPDIR, or in /tmp where $TMPDIR is so deep
    that the socket's path would not fit in a sockaddr_un."""
    directory = tempfile.mkdtemp(prefix="pagedserve-worker-")
    if len(os.fsencode(os.path.join(directory, "steps.sock"))) <= SUN_PATH_MAX:
        return directory
    os.rmdir(directory)
    return tempfile.mkdtemp(prefix="pagedserve-worker-", dir="/tmp")


class StepSocket:
    """Listens on <private dir>/steps.sock for `service` (a WorkerService); close() removes it."""

    def __init__(self, service) -> None:
        self.service = service
        self.directory = private_directory()
        self.path = os.path.join(self.directory, "steps.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.listener.bind(self.path)
        except OSError:
            self.listener.close()
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
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
        """On the torch thread: answer the connection's steps until it is idle, closed or failed.

        A step is begun (launched) and answered as soon as the device is done with it; while the
        device still runs it, a next step already sent (async scheduling) is begun first, reading its
        tokens on the device (worker/step_overlap.py). On the CPU a begun step is done when begin
        returns: each is answered before the next is read, as before."""
        begun = None  # a step begun, not yet answered
        while True:
            if self.closed:  # the worker is stopping: the scheduler sees the link end, as a stream's
                conn.close()
                return
            if begun is not None and begun.ready():  # answered as soon as the device is done with it
                if self._send(conn, self._finish(begun)):
                    return
                begun = None
            body = reader.next()
            if body is None:
                if begun is not None:
                    if not poller.poll(0):  # the device is busy and no next step is here yet
                        time.sleep(WAIT_S)
                        continue
                elif not poller.poll(IDLE_S * 1000):  # idle: let other work run, then come back
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
            following, failure = self._begin(body)  # (begun first, if the device still runs it)
            if begun is not None and self._send(conn, self._finish(begun)):
                return
            begun = following
            if failure is not None:
                self._send(conn, failure)
                conn.close()
                return

    def _send(self, conn: socket.socket, reply: tuple[bytes, bool]) -> bool:
        """Send one reply frame; True when the connection is over (the reply said so, or it broke)."""
        frame, failed = reply
        try:
            conn.sendall(frame)
        except OSError:
            failed = True
        if failed:
            conn.close()
        return failed

    def _begin(self, body: bytes):
        """(the begun step, None), or (None, its error reply)."""
        try:
            return self.service.begin_step(worker_pb2.StepRequest.FromString(body)), None
        except Exception as exc:  # noqa: BLE001 - the scheduler recovers the ranks; this worker stays up
            return None, self._error(exc)

    def _finish(self, begun) -> tuple[bytes, bool]:
        """The reply frame to a begun step, and whether it ends the connection."""
        try:
            result = self.service.finish_step(begun)
        except Exception as exc:  # noqa: BLE001 - the scheduler recovers the ranks; this worker stays up
            return self._error(exc)
        return result_reply(result.SerializeToString()), False

    @staticmethod
    def _error(exc: Exception) -> tuple[bytes, bool]:
        failure = step_failure(exc)
        if failure is not None:
            return error_reply(*failure), True
        log.exception("a step on the local step link failed")
        return error_reply("INTERNAL", f"the step failed on the worker: {exc}"), True
