"""The gateway's request errors, in OpenAI's {"error": {...}} shape: RequestError (an HTTP status
and the field it names), bad_request (a 400), internal_error (a 500 that keeps the exception's
text in the log only). A leaf module: protocol, structured and tools all raise these, and
import nothing of one another for it (no cycle)."""

from __future__ import annotations

import logging
import uuid

log = logging.getLogger("pagedserve.gateway")


class RequestError(Exception):
    """An error with its HTTP status, rendered in OpenAI's {"error": {...}} shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def internal_error(exc: BaseException) -> RequestError:
    """A 500 for an unexpected exception: a generic message and a correlation id, never the
    exception's text (it may hold another request's data or internals); the log has both."""
    correlation = uuid.uuid4().hex[:16]
    log.error("internal error %s: %s: %s", correlation, type(exc).__name__, exc, exc_info=exc)
    return RequestError(500, f"internal server error (correlation id {correlation})", type="server_error",
                        code="internal_error")


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> RequestError:
    return RequestError(400, message, param)
