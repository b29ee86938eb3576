"""Encoding and validating wstream messages.

Decoding happens in two passes over the (small) header frame: first a loose *envelope*
(``v``, ``op``, ``id``) so that every error can name the op and echo the request id, then the
op's own strict schema. Data frames are never decoded here: they are raw tensor bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec

from .errors import ProtocolError, UnknownOpError, VersionMismatchError
from .messages import (
    MAX_DATA_FRAMES,
    MAX_HEADER_BYTES,
    MAX_REQUEST_ID,
    PROTOCOL_VERSION,
    REPLY_TYPES,
    REQUEST_TYPES,
    Message,
)

M = TypeVar("M", bound=Message)


_NO_VERSION = -1
"""``Envelope.v`` of a header that carries none."""


class Envelope(msgspec.Struct, frozen=True):
    """The fields every header has; other fields are ignored at this stage."""

    op: str
    v: int = _NO_VERSION
    id: int = 0


_encoder = msgspec.msgpack.Encoder()
_envelope = msgspec.msgpack.Decoder(Envelope)
_decoders: dict[str, msgspec.msgpack.Decoder[Any]] = {
    op: msgspec.msgpack.Decoder(cls) for op, cls in {**REQUEST_TYPES, **REPLY_TYPES}.items()
}


def encode(message: Message) -> bytes:
    """The header frame of ``message``."""
    return _encoder.encode(message)


def peek_id(header: bytes) -> int:
    """The request id of a header, or 0 where it cannot be read (used for error replies)."""
    try:
        request_id = int(_envelope.decode(header).id)
        return request_id if 0 <= request_id <= MAX_REQUEST_ID else 0  # past RequestId's bound no reply decodes
    except (msgspec.DecodeError, ValueError, TypeError, OverflowError, RecursionError):
        return 0


def _decode(header: bytes | memoryview, table: dict[str, type[Message]], side: str) -> Message:
    if len(header) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header frame of {len(header)} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    try:
        env = _envelope.decode(header)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"header is not a msgpack map with 'op', 'v' and 'id': {exc}") from None
    except RecursionError:  # msgspec gives up on very deep nesting this way
        raise ProtocolError("header nests too deeply to decode") from None
    if env.op not in table:
        known = ", ".join(sorted(table))
        raise UnknownOpError(f"unknown {side} op {env.op!r}; known ops: {known}")
    if env.v == _NO_VERSION:
        raise VersionMismatchError(f"the {env.op!r} header has no protocol version 'v': this end speaks version {PROTOCOL_VERSION}")
    if env.v != PROTOCOL_VERSION:
        raise VersionMismatchError(
            f"protocol version {env.v} is not supported: this end speaks version {PROTOCOL_VERSION}; "
            "upgrade the older side"
        )
    try:
        msg = _decoders[env.op].decode(header)
    except (msgspec.DecodeError, ValueError) as exc:
        raise ProtocolError(f"bad {env.op!r} message: {exc}") from None
    except RecursionError:
        raise ProtocolError(f"bad {env.op!r} message: it nests too deeply to decode") from None
    assert isinstance(msg, Message)
    return msg


def decode_request(header: bytes | memoryview) -> Message:
    """Decode and validate a client->server header; raises a :class:`ProtocolError` subclass."""
    return _decode(header, REQUEST_TYPES, "request")


def decode_reply(header: bytes | memoryview) -> Message:
    """Decode and validate a server->client header; raises a :class:`ProtocolError` subclass."""
    return _decode(header, REPLY_TYPES, "reply")


def check_frames(message: Message, frames: Sequence[object]) -> None:
    """Raise unless the number of data frames is what ``message``'s op allows and, for ops with an
    ``nframes`` field, exactly the count its header declares (the header is signed, the frames
    are not: this stops frames being dropped or added on the way)."""
    low, high = message.frames
    if not low <= len(frames) <= high:
        want = str(low) if low == high else f"{low} to {high}"
        more = " or more" if len(frames) > MAX_DATA_FRAMES else ""  # the transport keeps one past the most
        raise ProtocolError(f"{type(message).__name__} takes {want} data frame(s), got {len(frames)}{more}")
    declared = getattr(message, "nframes", None)
    if declared is not None and declared != len(frames):
        raise ProtocolError(
            f"{type(message).__name__} declares nframes={declared} in its (signed) header but {len(frames)} "
            "data frame(s) came with it"
        )


def expect(message: Message, cls: type[M]) -> M:
    """Narrow a decoded reply to ``cls`` or raise a ProtocolError naming both."""
    if not isinstance(message, cls):
        raise ProtocolError(f"expected a {cls.__name__} reply, got {type(message).__name__}")
    return message

