"""The server side of local calls (local_calls.py: why, the wire, security): LocalCallServer serves
a service's methods on a Unix socket in a private directory (mode 0700), one connection per call,
and runs each call's handler with a LocalContext, the part of grpc.aio.ServicerContext our
servicers use. The client side (LocalSocketPath, LocalOrGrpcCall) is local_calls.py.

Threads: the event loop of the serving process only (the service's loop).

Invariants: a call's STATUS frame is its last (nothing is written after it) and the server then
closes; a call whose client closes or goes away is cancelled: its context says cancelled() and
runs its done callbacks once, as gRPC's does; stop() removes the socket's directory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import grpc

from pagedserve.common.local_calls import MESSAGE, STATUS
from pagedserve.common.step_frames import FrameReader, frame

log = logging.getLogger("pagedserve.local_calls")  # (the logger local calls always had)

_END = object()  # a connection's requests ended (half-close or gone)


@dataclass(slots=True)
class Method:
    """A servicer method served locally: handler(request, context) or, with streaming_requests,
    handler(request_iterator, context); either returns an async iterator of responses."""
    handler: Callable[..., AsyncIterator[Any]]
    request_type: type
    streaming_requests: bool = False


class LocalAbort(Exception):
    """Raised by LocalContext.abort: ends the handler with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class LocalContext:
    """The part of grpc.aio.ServicerContext our servicers use."""

    def __init__(self, metadata: tuple) -> None:
        self._metadata = metadata
        self._callbacks: list[Callable] = []
        self._cancelled = False

    def invocation_metadata(self) -> tuple:
        return self._metadata

    def add_done_callback(self, callback: Callable) -> None:
        self._callbacks.append(callback)

    def cancelled(self) -> bool:
        return self._cancelled

    def time_remaining(self) -> None:
        return None

    def peer(self) -> str:
        return "unix:local"

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise LocalAbort(code, details)

    def _done(self) -> None:
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback(self)
            except Exception:  # noqa: BLE001 - as gRPC: a callback's failure is logged, not raised
                log.exception("a local call's done callback failed")


class LocalCallServer:
    """Serves `methods` on <private dir>/calls.sock; start() returns the path, stop() removes it."""

    def __init__(self, methods: dict[str, Method], name: str) -> None:
        self.methods = methods
        self.name = name
        self.directory = ""
        self.path = ""
        self.server: asyncio.AbstractServer | None = None
        self.connections: set[_ServerConnection] = set()

    async def start(self) -> str:
        self.directory = tempfile.mkdtemp(prefix=f"pagedserve-{self.name}-")  # mode 0700
        self.path = os.path.join(self.directory, "calls.sock")
        loop = asyncio.get_running_loop()
        self.server = await loop.create_unix_server(lambda: _ServerConnection(self), self.path)
        return self.path

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting; calls still running get `grace` seconds, then are cancelled."""
        if self.server is not None:
            self.server.close()
        running = [c.task for c in self.connections if c.task is not None and not c.task.done()]
        if running and grace:
            await asyncio.wait(running, timeout=grace)
        for connection in list(self.connections):
            connection.close()
        if running:
            await asyncio.wait(running, timeout=1.0)
        shutil.rmtree(self.directory, ignore_errors=True)


class _ServerConnection(asyncio.Protocol):
    """One call: the head, then the request(s); runs the handler and writes what it yields."""

    def __init__(self, server: LocalCallServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.frames = FrameReader()
        self.method: Method | None = None
        self.context: LocalContext | None = None
        self.requests: asyncio.Queue | None = None
        self.task: asyncio.Task | None = None
        self.writable: asyncio.Future | None = None  # set while the transport's buffer is full
        self.lost = False  # the client closed (or the connection broke)
        self.ended = False  # the status is written

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        self.frames.feed(data)
        while not self.ended and (body := self.frames.next()) is not None:
            if self.context is None:
                self._head(body)
            elif self.requests is not None:
                self.requests.put_nowait(body if body[:1] == MESSAGE else _END)
            elif self.task is None:  # a unary call's one request
                try:
                    request = self._parse(body)
                except LocalAbort as exc:
                    self._finish(exc.code, exc.details)
                    return
                self._start(request)

    def eof_received(self) -> bool:
        return False  # the client closed: the call is cancelled (connection_lost follows)

    def connection_lost(self, exc) -> None:
        self.lost = True
        self.server.connections.discard(self)
        if self.requests is not None:
            self.requests.put_nowait(_END)
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        if self.task is not None and not self.task.done():
            self.context._cancelled = True
            self.task.cancel()

    def pause_writing(self) -> None:
        self.writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.writable = None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _head(self, body: bytes) -> None:
        try:
            head = json.loads(body)
            method = self.server.methods[head["method"]]
            metadata = tuple((str(k), str(v)) for k, v in head.get("metadata") or ())
        except (ValueError, KeyError, TypeError) as exc:
            self._finish(grpc.StatusCode.UNIMPLEMENTED, f"not a call this socket serves: {exc!r}")
            return
        self.method, self.context = method, LocalContext(metadata)
        if method.streaming_requests:
            self.requests = asyncio.Queue()
            self._start(self._request_iterator())

    async def _request_iterator(self):
        while (body := await self.requests.get()) is not _END:
            yield self._parse(body)

    def _parse(self, body: bytes):
        try:
            if body[:1] != MESSAGE:
                raise ValueError(f"a frame of kind {body[:1]!r} where a request message belongs")
            return self.method.request_type.FromString(body[1:])
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and kin
            raise LocalAbort(grpc.StatusCode.INVALID_ARGUMENT, f"a malformed request message: {exc}") from None

    def _start(self, request) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run(request))

    async def _run(self, request) -> None:
        code, details = grpc.StatusCode.OK, ""
        try:
            async for response in self.method.handler(request, self.context):
                if self.lost:
                    break
                self.transport.write(frame(MESSAGE + response.SerializeToString()))
                if self.writable is not None:  # the client reads slower than we write: wait for it
                    await self.writable
        except LocalAbort as exc:
            code, details = exc.code, exc.details
        except asyncio.CancelledError:
            self.context._cancelled = True
            self.context._done()
            raise
        except Exception as exc:  # noqa: BLE001 - as grpc.aio: the call fails, the server goes on
            log.exception("local call %s failed", self.server.name)
            code, details = grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc)}: {exc}"
        self._finish(code, details)
        self.context._done()

    def _finish(self, code: grpc.StatusCode, details: str) -> None:
        self.ended = True
        if not self.lost and self.transport is not None:
            self.transport.write(frame(STATUS + code.name.encode() + b"\n" + details.encode("utf-8", "replace")))
            self.transport.close()
