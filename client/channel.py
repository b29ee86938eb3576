"""A request/reply channel to the server over one DEALER socket.

ZeroMQ sockets are not thread-safe, so each thread that talks to the server (the caller, the
prefetch thread, the heartbeat thread, the gradient pusher) owns one :class:`Channel`. Every wait
has a deadline; a server that does not answer in time makes the channel *broken*, raising
:class:`ServerUnavailable` at once on every later call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec
import zmq

from wstream.protocol import ServerUnavailable, decode_reply, encode, error_from_code
from wstream.protocol import messages as m

log = logging.getLogger(__name__)

R = TypeVar("R", bound=m.Message)

_POLL_SLICE_MS = 100


class Channel:
    """One DEALER socket with request ids, reply matching and deadlines. One thread only."""

    def __init__(self, ctx: zmq.Context[Any], address: str, *, timeout_s: float) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.linger = 0
        self._sock.connect(address)
        self._next_id = 1
        self._broken: str | None = None

    def close(self) -> None:
        self._sock.close(linger=0)

    def _check(self) -> None:
        if self._broken is not None:
            raise ServerUnavailable(self._broken)

    def send(self, msg: m.Message, frames: Sequence[object] = (), *, copy: bool = True) -> int:
        """Send ``msg`` with a fresh request id; return the id."""
        self._check()
        rid = self._next_id
        self._next_id += 1
        header = encode(msgspec.structs.replace(msg, id=rid))
        self._sock.send_multipart([header, *frames], copy=copy)
        return rid

    def recv(
        self, *, timeout_s: float | None = None, stop: threading.Event | None = None
    ) -> tuple[m.Message, list[zmq.Frame]]:
        """The next reply (errors included, not raised). Honours ``stop`` between poll slices."""
        self._check()
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        while True:
            if stop is not None and stop.is_set():
                raise InterruptedError("channel wait interrupted by shutdown")
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                self._broken = (
                    f"wstream-server at {self.address} did not answer within {limit:g} s; "
                    "this connection is closed (is the server running?)"
                )
                raise ServerUnavailable(self._broken)
            if self._sock.poll(min(remaining_ms, _POLL_SLICE_MS), zmq.POLLIN):
                frames = self._sock.recv_multipart(copy=False)
                return decode_reply(frames[0].buffer), frames[1:]

    def request(
        self,
        msg: m.Message,
        reply_type: type[R],
        frames: Sequence[object] = (),
        *,
        timeout_s: float | None = None,
        stop: threading.Event | None = None,
    ) -> tuple[R, list[zmq.Frame]]:
        """Send ``msg`` and wait for its reply; a server error reply raises its exception class."""
        rid = self.send(msg, frames)
        while True:
            reply, data = self.recv(timeout_s=timeout_s, stop=stop)
            if reply.id != rid:
                log.debug("dropping a late reply %s to request %d", type(reply).__name__, reply.id)
                continue
            return raise_or_narrow(reply, reply_type), data


def raise_or_narrow(reply: m.Message, reply_type: type[R]) -> R:
    """Raise the exception of an ``error`` reply, or check the reply's type."""
    if isinstance(reply, m.Error):
        raise error_from_code(reply.code, reply.message)
    if not isinstance(reply, reply_type):
        from wstream.protocol import ProtocolError

        raise ProtocolError(f"expected a {reply_type.__name__} reply, got {type(reply).__name__}")
    return reply
