"""One error family for everything that crosses the wire.

Every error the server sends carries a stable ``code`` (an :class:`ErrorCode`) and a readable
message. The client turns each code back into the matching exception class, so callers can catch
``wstream.protocol.AuthError`` and friends rather than parse strings.
"""

from __future__ import annotations

import enum


class ErrorCode(str, enum.Enum):
    BAD_MESSAGE = "bad_message"  # not msgpack, wrong field types, out-of-range values
    UNKNOWN_OP = "unknown_op"
    VERSION_MISMATCH = "version_mismatch"
    AUTH_FAILED = "auth_failed"  # wrong token or proof
    SESSION_EXPIRED = "session_expired"  # unknown session: its lease ended, or the server restarted
    UNKNOWN_JOB = "unknown_job"
    JOB_EXISTS = "job_exists"
    MEMORY_LIMIT = "memory_limit"
    BAD_LAYOUT = "bad_layout"  # stage layout invalid or not what this worker expects
    BAD_GRADIENT = "bad_gradient"  # wrong size/dtype/slot, duplicate push
    STALE_STEP = "stale_step"  # asks for weights or pushes for a step that is gone
    NOT_READY = "not_ready"  # job still uploading
    BAD_STATE = "bad_state"  # op not valid now (upload twice, train before join, ...)
    UNAVAILABLE = "unavailable"  # client side: the server did not answer in time
    WAIT_TIMEOUT = "wait_timeout"  # client side: other workers did not do their part in time
    INTERNAL = "internal"  # a bug in wstream: please report


class WstreamError(Exception):
    """Base of every wstream error; ``code`` says which kind."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class ProtocolError(WstreamError):
    """A message could not be decoded or failed its schema."""

    code = ErrorCode.BAD_MESSAGE


class UnknownOpError(ProtocolError):
    code = ErrorCode.UNKNOWN_OP


class VersionMismatchError(ProtocolError):
    code = ErrorCode.VERSION_MISMATCH


class AuthError(WstreamError):
    code = ErrorCode.AUTH_FAILED


class SessionExpiredError(AuthError):
    """The server does not know this session (any more): attach again. A trainer does so itself."""

    code = ErrorCode.SESSION_EXPIRED


class UnknownJobError(WstreamError):
    code = ErrorCode.UNKNOWN_JOB


class JobExistsError(WstreamError):
    code = ErrorCode.JOB_EXISTS

    BEING_CREATED = "is still being created"
    """In the message when the job's creation is not sealed yet: nothing to attach to (``exist_ok``)."""

    @property
    def being_created(self) -> bool:
        return self.BEING_CREATED in self.message


class MemoryLimitError(WstreamError):
    code = ErrorCode.MEMORY_LIMIT


class LayoutError(WstreamError):
    code = ErrorCode.BAD_LAYOUT


class GradientError(WstreamError):
    code = ErrorCode.BAD_GRADIENT


class StaleStepError(WstreamError):
    code = ErrorCode.STALE_STEP


class NotReadyError(WstreamError):
    code = ErrorCode.NOT_READY


class StateError(WstreamError):
    code = ErrorCode.BAD_STATE


class ServerUnavailable(WstreamError):
    """The server did not answer within the deadline; the connection is now unusable."""

    code = ErrorCode.UNAVAILABLE


class WaitTimeoutError(WstreamError):
    """A wait on other workers (their gradients, their joining) outlasted the client's
    ``wait_timeout``, or a request the server holds (``await_step``, ``save``, ``seal``) its
    timeout; the message says what the job waited for. The server did answer, and the connection
    stays usable."""

    code = ErrorCode.WAIT_TIMEOUT


class InternalError(WstreamError):
    """An invariant of wstream itself broke: this is a bug in wstream, please report it."""

    code = ErrorCode.INTERNAL


_BY_CODE: dict[ErrorCode, type[WstreamError]] = {
    cls.code: cls
    for cls in (
        ProtocolError,
        UnknownOpError,
        VersionMismatchError,
        AuthError,
        SessionExpiredError,
        UnknownJobError,
        JobExistsError,
        MemoryLimitError,
        LayoutError,
        GradientError,
        StaleStepError,
        NotReadyError,
        StateError,
        ServerUnavailable,
        InternalError,
    )
}


def error_from_code(code: str, message: str) -> WstreamError:
    """Rebuild the exception a server error reply stands for (unknown codes stay generic)."""
    try:
        ec = ErrorCode(code)
    except ValueError:
        return WstreamError(f"[{code}] {message}")
    return _BY_CODE[ec](message)
