"""Replies on their way out: :class:`Outgoing` (one reply to one peer) and :class:`Outbox` (where
every part of the server hands its replies, counting the error replies by code).

Nothing here touches a socket: the outbox sends through the callable it is given, the transport's
``send`` in a server process, or any other (a list's ``append`` for handlers driven in-process).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from wstream.protocol import WstreamError
from wstream.protocol import messages as m

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Outgoing:
    """A reply to send: ``identity`` is the ROUTER routing id of the requesting socket."""

    identity: bytes
    message: m.Message
    frames: list[object] = field(default_factory=list)

    @staticmethod
    def error(identity: bytes, request_id: int, exc: BaseException) -> Outgoing:
        """The ``error`` reply ``exc`` stands for (a non-wstream exception is an internal error)."""
        if isinstance(exc, WstreamError):
            return Outgoing(identity, m.Error(id=request_id, code=exc.code.value, message=exc.message))
        return Outgoing(identity, m.Error(id=request_id, code="internal", message=f"internal server error: {exc!r}"))


Send = Callable[[Outgoing], None]
"""Sends one reply; never raises for a peer that is gone (the transport logs it)."""


class Outbox:
    """The replies of the loop thread: sent through ``send``; every error reply is counted in
    ``errors`` by its code (``wstream_request_errors_total``)."""

    __slots__ = ("_send", "errors")

    def __init__(self, send: Send, errors: Counter[str]) -> None:
        self._send = send
        self.errors = errors

    def send(self, out: Outgoing) -> None:
        if isinstance(out.message, m.Error):  # also those the jobs' parts build (discards, failed updates, ...)
            self.errors[out.message.code] += 1
        self._send(out)

    def send_all(self, outs: Iterable[Outgoing]) -> None:
        for out in outs:
            self.send(out)

    def error(self, identity: bytes, request_id: int, exc: WstreamError) -> None:
        self.send(Outgoing(identity, m.Error(id=request_id, code=exc.code.value, message=exc.message)))
