"""The wstream wire protocol: message records, codec, errors, layouts and shared-memory naming.

``wstream.server`` and ``wstream.client`` both import this package and nothing of each other.
"""

from .codec import check_frames, decode_reply, decode_request, encode, expect, peek_id
from .errors import (
    AuthError,
    SessionExpiredError,
    ErrorCode,
    GradientError,
    InternalError,
    JobExistsError,
    LayoutError,
    MemoryLimitError,
    NotReadyError,
    ProtocolError,
    ServerUnavailable,
    StaleStepError,
    StateError,
    UnknownJobError,
    UnknownOpError,
    VersionMismatchError,
    WstreamError,
    error_from_code,
)
from .messages import PROTOCOL_VERSION, SGD, AdamW, GroupSpec, JobOptions, OptimizerSpec, ParamSpec, StageSpec
from .units import format_bytes, parse_size, version_line

__all__ = [
    "PROTOCOL_VERSION",
    "SGD",
    "AdamW",
    "AuthError",
    "SessionExpiredError",
    "ErrorCode",
    "GradientError",
    "GroupSpec",
    "InternalError",
    "JobExistsError",
    "LayoutError",
    "MemoryLimitError",
    "NotReadyError",
    "JobOptions",
    "OptimizerSpec",
    "ParamSpec",
    "ProtocolError",
    "ServerUnavailable",
    "StageSpec",
    "StaleStepError",
    "StateError",
    "UnknownJobError",
    "UnknownOpError",
    "VersionMismatchError",
    "WstreamError",
    "check_frames",
    "decode_reply",
    "decode_request",
    "encode",
    "error_from_code",
    "expect",
    "format_bytes",
    "parse_size",
    "peek_id",
    "version_line",
]
