"""The worker's end of a gRPC Step stream (ranks on another host than their scheduler; the local step link,
step_socket.py, serves the others): the same rule as the local link, over gRPC's messages.

A step is begun (launched) on the torch thread as soon as it arrives, and answered as soon as the device is
done with it; a step the scheduler sent ahead (async scheduling) that arrives while the device still runs
the one before begins first, its rows reading that one's tokens on the device (worker/step_overlap.py).
On the CPU a begun step is done when begin returns: each is answered before the next begins, as before.

Threads: `read` on the stream's reader thread queues the requests and, when no pump task is queued or
running, submits one to WorkerService.torch_thread; the pump begins and answers steps until nothing is
begun and nothing waits, then gives the torch thread back (Profile and InitCache of a new session run
between two pumps). The gRPC handler thread takes the replies from `replies`.

Invariants: replies go out in request order, one per request, then None when the stream has ended or
failed; every begun step is finished (the model runner holds one step in flight at most); after a step
fails, the requests behind it are dropped (the handler aborts the stream with the first failure)."""

from __future__ import annotations

import collections
import queue
import threading
import time

from pagedserve.worker.step_socket import WAIT_S

_END = object()  # the request stream has ended


class StepPump:
    def __init__(self, service) -> None:
        self.service = service
        self.replies: queue.SimpleQueue = queue.SimpleQueue()  # StepResult | BaseException | None (the end)
        self._requests: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._queued = False  # a pump task is queued or running on the torch thread
        self._failed = False

    def read(self, request_iterator) -> None:
        """On the stream's reader thread: every request, then the end."""
        try:
            for request in request_iterator:
                self._push(request)
        except Exception:  # noqa: BLE001 - cancelled or closed: the stream is over either way
            pass
        self._push(_END)

    def _push(self, item) -> None:
        with self._lock:
            self._requests.append(item)
            if self._queued:
                return
            self._queued = True
        try:
            self.service.torch_thread.submit(self._pump)
        except RuntimeError:  # the torch thread was shut down: the worker is stopping, no step will run
            self.replies.put(None)

    def _next(self, begun):
        """The next request; None when there is none yet. With nothing begun and nothing waiting, the pump
        ends (the next request queues another)."""
        with self._lock:
            if self._requests:
                return self._requests.popleft()
            if begun is None:
                self._queued = False
            return None

    def _pump(self) -> None:
        """On the torch thread: begin the steps that are here, answer each when the device is done with it."""
        begun = None
        while True:
            if begun is not None and begun.ready():
                self._answer(begun)
                begun = None
            item = self._next(begun)
            if item is None:
                if begun is None:
                    return
                time.sleep(WAIT_S)  # the device is busy and no next step is here yet
                continue
            if item is _END:
                if begun is not None:
                    self._answer(begun)
                self.replies.put(None)
                return  # nothing follows the end: the task stays marked queued, so none is submitted again
            following, failure = self._begin(item)  # begun first while the device still runs the one before
            if begun is not None:
                self._answer(begun)
            if failure is not None:
                self._fail(failure)
            begun = following

    def _begin(self, request):
        """(the begun step, None), (None, why it failed), or (None, None) once the stream has failed."""
        if self._failed:
            return None, None
        try:
            return self.service.begin_step(request), None
        except Exception as exc:  # noqa: BLE001 - the handler aborts the stream with it
            return None, exc

    def _answer(self, begun) -> None:
        try:
            result = self.service.finish_step(begun)
        except Exception as exc:  # noqa: BLE001 - the handler aborts the stream with it
            self._fail(exc)
            return
        if not self._failed:
            self.replies.put(result)

    def _fail(self, exc: BaseException) -> None:
        if not self._failed:
            self._failed = True
            self.replies.put(exc)
