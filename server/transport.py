"""The server's transport: one ROUTER socket bound to every endpoint (CURVE where configured), the
poll loop over it and the mailboxes' wake-up pipes, ``send`` and close.

It knows frames, not requests: each message received goes to the ``receive`` callback as the
sender's routing id and the frames after it; what to answer is the handlers' business
(:mod:`wstream.server.handlers`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from wstream.protocol import encode
from wstream.protocol import messages as m
from wstream.protocol.messages import MAX_DATA_FRAMES, MAX_HEADER_BYTES
from wstream.protocol.curve import load_secret_certificate, uses_curve
from wstream.protocol.host import is_ipv6_endpoint

from .auth import start_authenticator
from .config import ServerConfig
from .outgoing import Outgoing
from .ownership import HeldElsewhere, OwnerLock, holder

log = logging.getLogger(__name__)

MAX_MESSAGES_PER_TURN = 256
"""Messages taken from the socket before the loop looks at its mailboxes again."""
MAX_FRAMES_PER_TURN = 4096
"""Frames read before the loop looks at its mailboxes again, whatever the messages' count: each
frame is read one by one in Python (about 1.5 us), so a peer's messages of 65,536 frames, 256 to
a turn, held every job's finished updates back for 25 s (found by review). A message is read
whole, so a turn that passes this ends after it."""
DROPPED_WARNING_EVERY_S = 10.0
"""At most one warning this often about messages with frames dropped unread (they may come in floods)."""


class Transport:
    """The bound ROUTER socket of a server. Binding happens in the constructor; a failure closes
    everything opened so far and raises :class:`OSError`."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        # ZMQ_ROUTER_HANDOVER stays off: a peer may choose its routing id, and with hand-over a
        # newcomer claiming a connected worker's id would receive that worker's replies (its
        # weights among them). wstream's clients never choose one.
        # A reply that cannot be queued must be reported, not dropped silently (ZeroMQ's default
        # for a ROUTER at its high-water mark): raise instead, and queue up to 64 Ki replies per
        # peer (a worker's deferred fetches alone can be answered 1,024 at once).
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.sndhwm = 65_536
        # No frame may be longer than a header may be (data travels in CHUNK_BYTES frames): a peer
        # that sends a longer one is disconnected before the server holds it.
        self._sock.maxmsgsize = MAX_HEADER_BYTES
        self._dropped = 0  # frames the last message had past the most any op takes
        self._dropped_messages = 0
        self._dropped_warned = -DROPPED_WARNING_EVERY_S
        self._authenticator: ThreadAuthenticator | None = None
        self.endpoints: list[str] = []
        self.curve_public_key: bytes | None = None
        self._locks: list[OwnerLock] = []  # one per ipc socket (server/ownership.py)
        try:
            self._listen(config)
        except BaseException:
            self.close()
            raise

    def _listen(self, config: ServerConfig) -> None:
        """Bind every endpoint: CURVE on the non-ipc ones when the server has a key (NOTE [Which
        endpoints are encrypted] in ``wstream.protocol.curve``), behind the authorized-keys check
        when there is a directory of them."""
        if config.curve_secret_key_file is not None:
            public, secret = load_secret_certificate(config.curve_secret_key_file, "server secret key")
            self._sock.curve_publickey = public
            self._sock.curve_secretkey = secret
            self.curve_public_key = public
            if config.curve_authorized_keys_dir is not None:  # the ZAP handler must be up before a bind
                self._authenticator = start_authenticator(self._ctx, config.curve_authorized_keys_dir)
        for addr in config.bind:
            if self.curve_public_key is not None:  # security options apply to the binds after them
                self._sock.curve_server = uses_curve(addr)
            self._own(addr)
            self._sock.ipv6 = is_ipv6_endpoint(addr)  # (applies to the binds after it)
            try:
                self._sock.bind(addr)
            except zmq.ZMQError as exc:
                raise OSError(f"cannot listen on {addr}: {exc}") from None
            self.endpoints.append(self._sock.getsockopt_string(zmq.LAST_ENDPOINT))

    def _own(self, addr: str) -> None:
        """Lock an ipc socket's path before binding it: ZeroMQ would take a live server's socket
        over (a tcp port in use is refused by the kernel already). Abstract sockets (``ipc://@``)
        have no path to lock beside."""
        path = addr[len("ipc://") :] if addr.startswith("ipc://") else ""
        if not path or path.startswith("@"):
            return
        try:
            self._locks.append(OwnerLock(path + ".lock"))
        except HeldElsewhere as exc:
            raise OSError(f"cannot listen on {addr}: {holder(exc.pid)} holds it") from None
        except OSError as exc:  # e.g. its directory does not exist
            raise OSError(f"cannot listen on {addr}: {exc.strerror or exc}: {path}") from None

    # ---- the start-up log ----------------------------------------------------------------------
    def security(self, endpoint: str) -> str:
        """How ``endpoint`` is protected, for the start-up log."""
        if not uses_curve(endpoint):
            return "plaintext: local socket, file permissions"
        if self.curve_public_key is None:
            return "plaintext"
        if self._authenticator is not None:
            return f"CURVE, only clients of {self.config.curve_authorized_keys_dir}"
        return "CURVE, any client with the server's public key"

    def describe(self) -> str:
        """Every endpoint with its protection: ``ep (how), ...``."""
        return ", ".join(f"{ep} ({self.security(ep)})" for ep in self.endpoints)

    def log_security(self) -> None:
        if self.curve_public_key is not None:
            log.info("CURVE public key of this server: %s", self.curve_public_key.decode())
            if not any(uses_curve(ep) for ep in self.endpoints):
                log.warning("a CURVE key was given but every endpoint is ipc://: nothing is encrypted")
            return
        exposed = [ep for ep in self.endpoints if uses_curve(ep) and not _loopback(ep)]
        if exposed:
            log.warning(
                "%s not encrypted: job tokens (sent once, by create_job) and tensor data cross the network "
                "in clear; start with --curve-secret-key to encrypt them",
                ", ".join(exposed),
            )

    # ---- the loop --------------------------------------------------------------------------------
    def serve(
        self,
        stop: threading.Event,
        receive: Callable[[bytes, list[zmq.Frame]], None],
        wake_fds: Sequence[int],
        each_turn: Callable[[], None],
        tick: Callable[[float], None],
        tick_every_s: float,
    ) -> None:
        """Until ``stop`` is set: poll the socket and ``wake_fds``; each turn call ``each_turn``
        (drain the mailboxes), then ``receive`` each waiting message (up to
        :data:`MAX_MESSAGES_PER_TURN`, or until :data:`MAX_FRAMES_PER_TURN` frames were read),
        and ``tick(now)`` every ``tick_every_s`` (the first after 1 s)."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        for fd in wake_fds:
            poller.register(fd, zmq.POLLIN)
        next_tick = time.monotonic() + 1.0
        while not stop.is_set():
            events = dict(poller.poll(timeout=500))
            each_turn()
            if self._sock in events:
                read = 0
                for _ in range(MAX_MESSAGES_PER_TURN):
                    try:
                        frames = self.receive_one()
                    except zmq.Again:
                        break
                    receive(frames[0].bytes, frames[1:])
                    read += len(frames) + self._dropped
                    if read >= MAX_FRAMES_PER_TURN:
                        break
            now = time.monotonic()
            if now >= next_tick:
                tick(now)
                next_tick = now + tick_every_s

    def receive_one(self) -> list[zmq.Frame]:
        """The next message's frames (raises ``zmq.Again`` when none waits): the routing id, the
        header and at most MAX_DATA_FRAMES + 1 data frames (one more than any op takes, so its
        check refuses it); a peer's further frames are read and dropped, not kept."""
        sock = self._sock
        frames = [sock.recv(flags=zmq.NOBLOCK, copy=False)]
        dropped = 0
        while sock.get(zmq.RCVMORE):
            frame = sock.recv(copy=False)
            if len(frames) < MAX_DATA_FRAMES + 3:
                frames.append(frame)
            else:
                dropped += 1
        self._dropped = dropped
        if dropped:
            self._dropped_messages += 1
            now = time.monotonic()
            if now >= self._dropped_warned + DROPPED_WARNING_EVERY_S:
                log.warning(
                    "a message of %d frames: %d dropped unread (%d such messages since the last warning)",
                    len(frames) + dropped, dropped, self._dropped_messages,
                )
                self._dropped_warned, self._dropped_messages = now, 0
        return frames

    def send(self, out: Outgoing) -> None:
        try:
            parts: list[Any] = [out.identity, encode(out.message), *out.frames]
        except Exception as exc:  # a bug in whatever built the reply: never fatal for the loop
            log.exception("could not encode a %s reply", type(out.message).__name__)
            what = f"internal server error: the {type(out.message).__name__} reply could not be encoded ({exc!r})"
            parts = [out.identity, encode(m.Error(id=out.message.id, code="internal", message=ascii(what)[1:-1]))]
        try:
            self._sock.send_multipart(parts, copy=False, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or queue full: never fatal for the loop
            if exc.errno == zmq.EHOSTUNREACH:  # the peer disconnected (a worker that reconnects, a closed client): routine
                log.info("a %s reply's peer has gone: not sent", type(out.message).__name__)
            else:
                log.warning("could not send %s: %s", type(out.message).__name__, exc)

    def close(self, linger: bool = False) -> None:
        """Close the socket (``linger``: give replies queued a second to leave, e.g. the ``ok`` of a
        ``shutdown`` request), stop the authenticator, terminate the context."""
        self._sock.close(linger=1000 if linger else 0)
        if self._authenticator is not None:  # its sockets are on the context: before term()
            self._authenticator.stop()
            self._authenticator = None
        self._ctx.term()
        for lock in self._locks:  # after the socket is closed: no moment with two listeners
            lock.release()
        self._locks.clear()


def _loopback(endpoint: str) -> bool:
    """Whether a tcp endpoint listens on the loopback interface only."""
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")
