"""The local step link's frames: the Step stream's messages between the scheduler and a worker rank
on the same host, over the rank's Unix socket (WorkerInfo.step_socket), with no gRPC threads on
either side. vLLM's engine core talks to its workers over local sockets for the same reason: over
gRPC, each step woke ~6 threads across the two processes (a request-iterator thread and a channel
spin thread in the scheduler; the server's poller, a reader and a handler thread in the worker),
~1 ms of CPU a step on the cores the worker computes on (docs/performance.md).

A frame is a 4-byte big-endian length and that many bytes.
  scheduler -> worker: one serialized StepRequest per frame, in step order; a step may be sent
    before the last one's reply has been read (async scheduling), as on the gRPC stream.
  worker -> scheduler: one reply per request, in the same order: RESULT + a serialized StepResult,
    or ERROR + a gRPC status code's name + "\\n" + details. The worker closes the connection after
    an error, as a gRPC stream ends with its status.

Standard library only: the scheduler imports this (no torch, no protobuf here).
"""

from __future__ import annotations

import struct

HEADER = struct.Struct("!I")
MAX_FRAME_BYTES = (1 << 32) - 1
RESULT, ERROR = b"\x00", b"\x01"


class StepLinkError(Exception):
    """The link failed or the worker answered with an error; `code` is a grpc.StatusCode name."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self._details = details

    def details(self) -> str:  # as grpc.RpcError's, so callers report both alike
        return self._details


def frame(payload: bytes) -> bytes:
    if len(payload) > MAX_FRAME_BYTES:
        raise ValueError(f"a step message of {len(payload)} bytes is over the frame limit of {MAX_FRAME_BYTES}")
    return HEADER.pack(len(payload)) + payload


def result_reply(result: bytes) -> bytes:
    return frame(RESULT + result)


def error_reply(code: str, details: str) -> bytes:
    return frame(ERROR + code.encode() + b"\n" + details.encode("utf-8", "replace"))


def reply_payload(body: bytes) -> bytes:
    """The serialized StepResult of a reply frame's body; an error reply raises StepLinkError."""
    if body[:1] == RESULT:
        return body[1:]
    if body[:1] == ERROR:
        code, _, details = body[1:].decode("utf-8", "replace").partition("\n")
        raise StepLinkError(code or "UNKNOWN", details)
    raise StepLinkError("INTERNAL", f"a reply frame of unknown kind {body[:1]!r}")


class FrameReader:
    """Cuts a byte stream into frames: feed() what recv() returned, then next() until None."""

    __slots__ = ("buffer",)

    def __init__(self) -> None:
        self.buffer = bytearray()

    def feed(self, data: bytes) -> None:
        self.buffer += data

    def next(self) -> bytes | None:
        if len(self.buffer) < HEADER.size:
            return None
        (size,) = HEADER.unpack_from(self.buffer)
        end = HEADER.size + size
        if len(self.buffer) < end:
            return None
        body = bytes(self.buffer[HEADER.size:end])
        del self.buffer[:end]
        return body
