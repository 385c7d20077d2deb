"""How a step that failed on this worker reaches the scheduler, the same on the gRPC Step stream
(server.py) and the local step link (step_socket.py): a step of another scheduler session, or sent
before the KV pool exists, is FAILED_PRECONDITION (SessionMismatch); a request id the worker does
not hold (KeyError: the delta and the worker's state disagree) is NOT_FOUND. Either way the
scheduler treats the rank as failed and recovers it (scheduler/recovery.py).

Below both transports, so that neither imports the other. Threads: any.
"""

from __future__ import annotations


class SessionMismatch(Exception):
    """A step for a session this worker's KV pool was not set up for (or for no pool at all)."""


def step_failure(exc: BaseException) -> tuple[str, str] | None:
    """(status code name, details) of a step's own failure; None for any other exception."""
    if isinstance(exc, SessionMismatch):
        return "FAILED_PRECONDITION", str(exc)
    if isinstance(exc, KeyError):  # a request id the worker does not hold: fail loudly
        return "NOT_FOUND", str(exc.args[0]) if exc.args else str(exc)
    return None
