"""The tokenizer's one stream to the scheduler, shared by all its requests.

Each request subscribes with a tag; the scheduler answers with one StepDeltas message per step
carrying every subscription's deltas, and the link hands each delta to its subscription's queue.
A subscription leaves with `leave()` (the scheduler aborts a request whose last subscriber left).

When the stream breaks (the scheduler restarted or went away), every subscription on it gets
BROKEN and the link forgets it; the next subscribe opens a new stream. Requests re-attach by
subscribing again with attach=True and skip_tokens (tokenizer/generation.py does this).

A scheduler on this host carries the stream on its local socket (common/local_calls.py: the same
messages, no gRPC threads); the link asks where it is at each new stream, since a restarted
scheduler has a new one.

Threads: one asyncio event loop (the tokenizer's); the link's reader is a task on it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import grpc

from pagedserve.common.grpc_util import StatusError
from pagedserve.common.local_calls import LocalOrGrpcCall, LocalSocketPath
from pagedserve.v1 import common_pb2, scheduler_pb2

log = logging.getLogger("pagedserve.tokenizer")

_CLOSE = object()
LOCAL_SOCKET_TIMEOUT_S = 2.0


class Broken:
    """Put in a subscription's queue when its stream broke: the request may still be running."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details


class SchedulerSubscription:
    """One request's deltas, in order. `read()` returns a TokenDelta, or a Broken; it raises
    StatusError when the scheduler refused or failed the request."""

    def __init__(self, link: SchedulerLink, tag: int, stream: _Stream) -> None:
        self.link, self.tag, self.stream = link, tag, stream
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False

    async def read(self):
        item = await self.queue.get()  # cancelling this loses nothing: the item stays queued
        if isinstance(item, StatusError):
            self.closed = True
            raise item
        if isinstance(item, Broken):
            self.closed = True
        return item

    def leave(self) -> None:
        """Stop listening; the scheduler aborts the request if nobody else listens."""
        if not self.closed:
            self.closed = True
            self.link._leave(self)


class _Stream:
    """One open Stream call and the subscriptions riding on it."""

    def __init__(self, call) -> None:
        self.call = call
        self.commands: asyncio.Queue = asyncio.Queue()
        self.subs: dict[int, SchedulerSubscription] = {}
        self.broken: Broken | None = None

    async def command_iterator(self):
        while (command := await self.commands.get()) is not _CLOSE:
            yield command


class SchedulerLink:
    """local: use the scheduler's local socket when it has one this process can reach
    (--service-transport auto), else gRPC."""

    def __init__(self, stub, local: bool = True) -> None:
        self.stub = stub
        self.stream: _Stream | None = None
        self.tags = itertools.count(1)
        self.reader: asyncio.Task | None = None
        self.where = LocalSocketPath(self._ask_local_socket if local else None)

    def _ask_local_socket(self):
        return self.stub.GetLocalSocket(common_pb2.LocalSocketRequest(), timeout=LOCAL_SOCKET_TIMEOUT_S)

    def _open(self) -> _Stream:
        if self.stream is None or self.stream.broken is not None:
            holder = _Stream(None)
            self.where.forget()  # a new stream may be to a restarted scheduler: ask again
            holder.call = LocalOrGrpcCall(self.where, "Stream", scheduler_pb2.StepDeltas,
                                          lambda: self.stub.Stream(holder.command_iterator()),
                                          requests=holder.command_iterator())
            self.stream = holder
            self.reader = asyncio.get_running_loop().create_task(self._read(holder))
        return self.stream

    def subscribe(self, schedule: scheduler_pb2.ScheduleRequest) -> SchedulerSubscription:
        """Send schedule (a new request, or attach=True to a known one) on the stream; its first
        message will be accepted, a SubscriptionError (raised by read) or Broken."""
        stream = self._open()
        sub = SchedulerSubscription(self, next(self.tags), stream)
        stream.subs[sub.tag] = sub
        msg = scheduler_pb2.ScheduleRequest()
        msg.CopyFrom(schedule)
        msg.tag = sub.tag
        stream.commands.put_nowait(scheduler_pb2.StreamCommand(schedule=msg))
        return sub

    def _leave(self, sub: SchedulerSubscription) -> None:
        stream = sub.stream
        if stream.subs.pop(sub.tag, None) is not None and stream.broken is None:
            stream.commands.put_nowait(scheduler_pb2.StreamCommand(leave=sub.tag))

    async def _read(self, stream: _Stream) -> None:
        broken = Broken(grpc.StatusCode.UNAVAILABLE, "the scheduler closed the stream")
        try:
            async for message in stream.call:
                for delta in message.deltas:
                    sub = stream.subs.get(delta.tag)
                    if sub is not None:
                        sub.queue.put_nowait(delta)
                for error in message.errors:
                    sub = stream.subs.pop(error.tag, None)
                    if sub is not None:
                        sub.queue.put_nowait(StatusError(_status(error.code), error.message))
        except grpc.aio.AioRpcError as exc:
            broken = Broken(exc.code(), exc.details() or exc.code().name)
        except asyncio.CancelledError:
            broken = Broken(grpc.StatusCode.CANCELLED, "the tokenizer is closing")
            raise
        finally:
            stream.broken = broken
            stream.commands.put_nowait(_CLOSE)
            subs, stream.subs = stream.subs, {}
            if subs:
                log.info("the scheduler stream broke (%s) under %d request(s)", broken.code.name, len(subs))
            for sub in subs.values():
                sub.queue.put_nowait(broken)

    def is_connected(self) -> bool:
        return self.stream is not None and self.stream.broken is None

    async def close(self) -> None:
        if self.stream is not None and self.stream.broken is None:
            self.stream.call.cancel()
        if self.reader is not None:
            self.reader.cancel()
            try:
                await self.reader
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing anyway
                pass


def _status(code: int) -> grpc.StatusCode:
    return next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
