"""Streaming calls between two services on one host over a Unix socket, shaped like gRPC's: the
same request and response messages, status codes and details, with no gRPC threads on either side.

Why: over grpc.aio each streamed message costs ~0.3 ms of CPU in the sender and ~0.2-0.3 ms in the
receiver (its poller and event-engine threads, and each completion's trip back to the event loop);
at one stream that is per token, on the cores the worker computes on (docs/performance.md). A frame
here costs the sender one transport write and the receiver one read, on the event loop.

Who uses it: the tokenizer's Stream to the scheduler and the gateway's Generate calls to the
tokenizer. A service that serves calls this way names its socket in GetLocalSocket (over gRPC); a
client that gets a path it can connect to uses it, else gRPC as before (another host or container,
or --service-transport grpc). `LocalOrGrpcCall` makes that choice inside the call, so callers keep
gRPC's call surface: read() / async for, cancel(), grpc.aio.AioRpcError, grpc.aio.EOF. This module
holds the wire's frame kinds and the client side; the server side (LocalCallServer, Method,
LocalContext) is local_call_server.py.

Wire (step_frames' 4-byte length frames), one connection per call:
  client -> server: a head frame (JSON: {"method", "metadata": [[key, value], ...]}), then
    MESSAGE + one request message a frame; HALF_CLOSE ends a stream of requests.
  server -> client: MESSAGE + one response message a frame, then STATUS + a grpc.StatusCode name +
    "\\n" + details ("OK" for a clean end); then the server closes.
  The client cancels by closing the connection (so does a client that dies): at end of file the
  server cancels the handler, whose context then says cancelled() and runs its done callbacks, as
  gRPC's does.

Security: the socket is in a private directory (mode 0700), so only this user's processes on this
host can connect; the internal TLS does not cover it (docs/security.md).

Threads: the event loop of the process only (the server's service loop; the caller's loop).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Callable

import grpc

from pagedserve.common.step_frames import FrameReader, frame

log = logging.getLogger("pagedserve.local_calls")

MESSAGE, STATUS, HALF_CLOSE = b"M", b"S", b"H"
_CANCELLED = object()  # in a call's responses: cancel() came; every read from then raises CancelledError
_CODES = {code.name: code for code in grpc.StatusCode}


class LocalSocketPath:
    """Where a service's local socket is: asked once over gRPC (GetLocalSocket), asked again after
    a connection to it failed (the service restarted). None: use gRPC."""

    def __init__(self, ask: Callable[[], Any] | None) -> None:
        self.ask = ask  # an async () -> LocalSocket; None: never local (--service-transport grpc)
        self.path: str | None = None
        self.known = False

    async def get(self) -> str | None:
        if self.ask is None:
            return None
        if not self.known:
            try:
                reply = await self.ask()
                self.path = reply.path or None
            except grpc.RpcError:
                self.path = None  # an older service, or not reachable yet: gRPC decides
                return None
            self.known = True
            if self.path is not None:
                log.info("calls go over the local socket %s", self.path)
        return self.path

    def forget(self) -> None:
        self.known, self.path = False, None


class LocalOrGrpcCall:
    """A streaming call over the service's local socket when it has one this process can reach,
    else the gRPC call `grpc_call()` makes. Either way: read() returns a response or grpc.aio.EOF
    and raises grpc.aio.AioRpcError; cancel() makes a read raise CancelledError, a later one or one
    waiting already (as grpc.aio's does: a gateway cancels a call its client left while it reads).

    request: a unary call's request; requests: an async iterator (a streaming-request call)."""

    def __init__(self, where: LocalSocketPath, method: str, response_type: type,
                 grpc_call: Callable[[], Any], request=None, requests=None, metadata=None,
                 timeout: float | None = None) -> None:
        loop = asyncio.get_running_loop()
        self.where, self.method, self.response_type = where, method, response_type
        self.grpc_call, self.request, self.requests = grpc_call, request, requests
        self.metadata = [list(pair) for pair in metadata or ()]
        self.responses: asyncio.Queue = asyncio.Queue()
        self.call = None  # the gRPC call, when it came to that
        self.transport: asyncio.Transport | None = None
        self.writer: asyncio.Task | None = None
        self.cancelled = False
        self.failed: grpc.aio.AioRpcError | None = None  # the deadline passed before the call began
        self.deadline = loop.call_later(timeout, self._expire) if timeout is not None else None
        self.opening = loop.create_task(self._open())

    async def _open(self) -> None:
        path = await self.where.get()
        if path is not None and not self.cancelled:
            try:
                loop = asyncio.get_running_loop()
                self.transport, _ = await loop.create_unix_connection(lambda: _ClientConnection(self), path)
            except OSError as exc:
                log.info("local socket %s: %s; this call and the next ask over gRPC", path, exc)
                self.where.forget()
        if self.cancelled or self.failed is not None:
            if self.transport is not None:
                self.transport.close()
            return
        if self.transport is None:
            self.call = self.grpc_call()
            return
        head = json.dumps({"method": self.method, "metadata": self.metadata}).encode()
        self.transport.write(frame(head))
        if self.requests is None:
            self.transport.write(frame(MESSAGE + self.request.SerializeToString()))
        else:
            self.writer = asyncio.get_running_loop().create_task(self._write_requests())

    async def _write_requests(self) -> None:
        async for request in self.requests:
            if self.transport.is_closing():
                return
            self.transport.write(frame(MESSAGE + request.SerializeToString()))
        if not self.transport.is_closing():
            self.transport.write(frame(HALF_CLOSE))

    @property
    def over_local_socket(self) -> bool:
        """Whether the call went over the local socket (known once the first read returned)."""
        return self.transport is not None

    async def read(self):
        if not self.opening.done():
            await asyncio.shield(self.opening)
        if self.cancelled:
            raise asyncio.CancelledError()
        if self.failed is not None:
            raise self.failed
        if self.call is not None:
            return await self.call.read()
        item = await self.responses.get()
        if item is _CANCELLED:
            self.responses.put_nowait(item)
            raise asyncio.CancelledError()
        if isinstance(item, grpc.aio.AioRpcError):
            self.responses.put_nowait(item)  # every later read fails alike
            raise item
        if item is grpc.aio.EOF:
            self.responses.put_nowait(item)
        return item

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        while (response := await self.read()) is not grpc.aio.EOF:
            yield response

    def cancel(self) -> bool:
        if self.cancelled:
            return False
        self.cancelled = True
        if self.deadline is not None:
            self.deadline.cancel()
        if self.call is not None:
            return self.call.cancel()
        self.responses.put_nowait(_CANCELLED)  # wakes a read waiting for a response
        self._close()
        return True

    def _close(self) -> None:
        if self.writer is not None:
            self.writer.cancel()
        if self.transport is not None:
            self.transport.close()

    def _expire(self) -> None:
        if self.call is None and not self.cancelled:
            if self.transport is None:  # still choosing: no call will begin
                self.failed = grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, None, None, "Deadline Exceeded")
            self._fail(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            self._close()

    def _fail(self, code: grpc.StatusCode, details: str) -> None:
        self.responses.put_nowait(grpc.aio.AioRpcError(code, None, None, details))

    # called by _ClientConnection
    def _frame(self, body: bytes) -> None:
        if body[:1] == MESSAGE:
            try:
                self.responses.put_nowait(self.response_type.FromString(body[1:]))
            except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and kin
                self._fail(grpc.StatusCode.INTERNAL, f"a malformed response message: {exc}")
                self._close()
            return
        code, _, details = body[1:].decode("utf-8", "replace").partition("\n")
        if self.deadline is not None:
            self.deadline.cancel()
        if code == "OK":
            self.responses.put_nowait(grpc.aio.EOF)
        else:
            self._fail(_CODES.get(code, grpc.StatusCode.UNKNOWN), details)

    def _lost(self, ended: bool) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        if self.writer is not None:
            self.writer.cancel()
        if not ended and not self.cancelled:  # no status came: the service went away mid-call
            self._fail(grpc.StatusCode.UNAVAILABLE, "the service's local socket closed during the call")


class _ClientConnection(asyncio.Protocol):
    def __init__(self, call: LocalOrGrpcCall) -> None:
        self.call = call
        self.frames = FrameReader()
        self.ended = False

    def data_received(self, data: bytes) -> None:
        self.frames.feed(data)
        while (body := self.frames.next()) is not None:
            self.ended |= body[:1] == STATUS
            self.call._frame(body)

    def connection_lost(self, exc) -> None:
        self.call._lost(self.ended)
