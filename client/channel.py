"""A request/reply channel to the server over one DEALER socket.

ZeroMQ sockets are not thread-safe, so each thread that talks to the server (the caller, the
prefetch thread, the heartbeat thread, the gradient pusher) owns one :class:`Channel`. Every wait
has a deadline; a server that does not answer in time makes the channel *broken*, raising
:class:`ServerUnavailable` at once on every later call.

A channel signs the session requests it sends with its ``signer`` (NOTE [Signed requests] in
``wstream.protocol.auth``): every channel of one session shares one :class:`SessionSigner`, whose
counter keeps ``seq`` unique across them.

A channel is the only place the client opens a socket, so it is where CURVE keys are applied
(:func:`curve_keys` resolves them once per client; NOTE [Which endpoints are encrypted] in
``wstream.protocol.curve``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import msgspec
import zmq

from wstream.protocol import AuthError, ServerUnavailable, StateError, WaitTimeoutError, decode_reply, encode, error_from_code
from wstream.protocol import messages as m
from wstream.protocol.auth import SessionSigner, admin_proof, attach_proof, secret_key, session_key
from wstream.protocol.curve import ENV_CLIENT_KEY, ENV_SERVER_KEY, ClientKeys, KeySource, client_keys, uses_curve
from wstream.protocol.host import is_ipv6_endpoint

log = logging.getLogger(__name__)

R = TypeVar("R", bound=m.Message)

_POLL_SLICE_MS = 100


class Signer(Protocol):
    def sign(self, message: m.Message) -> m.Message:
        """``message`` with ``seq`` and ``mac`` set (unchanged when it carries no session)."""
        ...


class Keyring:
    """Signs with the signer of each message's own session: for a channel that serves several
    sessions (the client's own, used by every :class:`Job` handle). Keeps the newest
    ``KEPT_SESSIONS`` signers (so that the client can leave their sessions when it closes, even
    those of handles it no longer has), older ones weakly: their key goes when the last handle on
    them does."""

    KEPT_SESSIONS = 1024

    def __init__(self) -> None:
        self._signers: weakref.WeakValueDictionary[bytes, SessionSigner] = weakref.WeakValueDictionary()
        self._kept: deque[SessionSigner] = deque(maxlen=self.KEPT_SESSIONS)

    def add(self, signer: SessionSigner) -> None:
        self._signers[signer.session] = signer
        self._kept.append(signer)

    def sessions(self) -> list[bytes]:
        """The sessions whose signers are still held (by a handle, or the client's admin session)."""
        return list(self._signers.keys())

    def sign(self, message: m.Message) -> m.Message:
        if not isinstance(message, m.SessionMessage):
            return message
        signer = self._signers.get(message.session)
        return message if signer is None else signer.sign(message)  # unknown: the server refuses it


def curve_keys(
    server_public_key: KeySource | None = None, client_secret_key: str | os.PathLike[str] | None = None
) -> ClientKeys | None:
    """A client's CURVE keys: from the arguments, else from ``$WSTREAM_SERVER_KEY`` and
    ``$WSTREAM_CLIENT_KEY``; None (plaintext) when no server key is given either way. Without a
    client key an ephemeral keypair is made (encryption, but no place in an authorized-keys list)."""
    server = server_public_key if server_public_key is not None else os.environ.get(ENV_SERVER_KEY) or None
    mine = client_secret_key if client_secret_key is not None else os.environ.get(ENV_CLIENT_KEY) or None
    if server is None:
        if mine is not None:
            raise ValueError(
                f"a client secret key ({mine}) without the server's public key: give server_public_key= "
                f"(or ${ENV_SERVER_KEY}) too"
            )
        return None
    return client_keys(server, mine)


class Channel:
    """One DEALER socket with request ids, reply matching and deadlines. One thread only.

    ``curve``: the client's CURVE keys, applied when ``address`` is an encrypted endpoint (tcp)."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        address: str,
        *,
        timeout_s: float,
        signer: Signer | None = None,
        curve: ClientKeys | None = None,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.signer = signer
        self.curve = curve if curve is not None and uses_curve(address) else None
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.linger = 0
        try:
            if self.curve is not None:
                self.curve.apply(self._sock)
            self._sock.ipv6 = is_ipv6_endpoint(address)
            self._sock.connect(address)
        except BaseException:  # an address ZeroMQ cannot use: the socket is not left to the collector
            self._sock.close(linger=0)
            raise
        self._next_id = 1
        self._broken: str | None = None
        self._closed: str | None = None  # why, once closed

    def close(self, why: str = "this connection to the server is closed") -> None:
        self._closed = why
        self._sock.close(linger=0)

    @property
    def socket(self) -> zmq.Socket[Any]:
        """The DEALER socket, for a thread that polls it together with other sources."""
        return self._sock

    def _check(self) -> None:
        if self._closed is not None:
            raise StateError(self._closed)
        if self._broken is not None:
            raise ServerUnavailable(self._broken)

    def send(self, msg: m.Message, frames: Sequence[object] = (), *, copy: bool = True) -> int:
        """Send ``msg`` with a fresh request id (signed, with its frame count, when it belongs to a
        session); return the id."""
        self._check()
        rid = self._next_id
        self._next_id += 1
        if "nframes" in msg.__struct_fields__:
            msg = msgspec.structs.replace(msg, id=rid, nframes=len(frames))  # type: ignore[call-arg]
        else:
            msg = msgspec.structs.replace(msg, id=rid)
        if self.signer is not None:
            msg = self.signer.sign(msg)
        header = encode(msg)
        self._sock.send_multipart([header, *frames], copy=copy)
        return rid

    def recv(
        self, *, timeout_s: float | None = None, stop: threading.Event | None = None
    ) -> tuple[m.Message, list[zmq.Frame]]:
        """The next reply (errors included, not raised). Honours ``stop`` between poll slices."""
        self._check()
        limit = self.timeout_s if timeout_s is None else timeout_s
        got = self._next(time.monotonic() + limit, stop)
        if got is None:
            self._broken = no_answer(self.address, limit, self.curve)
            raise ServerUnavailable(self._broken)
        return got

    def _next(self, deadline: float, stop: threading.Event | None) -> tuple[m.Message, list[zmq.Frame]] | None:
        """The next reply, or None when none came before ``deadline``."""
        while True:
            if stop is not None and stop.is_set():
                raise InterruptedError("channel wait interrupted by shutdown")
            if self._closed is not None:  # closed by another thread (a Client's): its wait ends here
                raise StateError(self._closed)
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                return None
            try:
                if self._sock.poll(min(remaining_ms, _POLL_SLICE_MS), zmq.POLLIN):
                    frames = self._sock.recv_multipart(copy=False)
                    return decode_reply(frames[0].buffer), frames[1:]
            except zmq.ZMQError:
                if self._closed is not None:  # the socket went from under the poll all the same
                    raise StateError(self._closed) from None
                raise

    def request(
        self,
        msg: m.Message,
        reply_type: type[R],
        frames: Sequence[object] = (),
        *,
        timeout_s: float | None = None,
        stop: threading.Event | None = None,
        held: bool = False,
    ) -> tuple[R, list[zmq.Frame]]:
        """Send ``msg`` and wait for its reply; a server error reply raises its exception class.

        ``held``: a request the server holds until something happens (``await_step``, ``save``,
        ``seal``), whose ``timeout_s`` may pass while the server is well. Then a ``status`` request
        tells the two apart: answered, the wait raises :class:`WaitTimeoutError` and the connection
        stays usable (the held request's reply, should it come later, is dropped as late); not
        answered within the ordinary timeout, :class:`ServerUnavailable` as for any request."""
        rid = self.send(msg, frames)
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        probe: int | None = None
        while True:
            got = self._next(deadline, stop)
            if got is None:
                if held and probe is None:
                    probe = self.send(m.Status())
                    deadline = time.monotonic() + self.timeout_s
                    continue
                self._broken = no_answer(self.address, limit if probe is None else self.timeout_s, self.curve)
                raise ServerUnavailable(self._broken)
            reply, data = got
            if reply.id == rid:
                return raise_or_narrow(reply, reply_type), data
            if probe is not None and reply.id == probe:
                raise WaitTimeoutError(
                    f"{type(msg).__struct_config__.tag} was not answered within {limit:.3g} s; the server is up "
                    "(it answered a status request) and still holds the request: what it waits for has not "
                    "happened yet (wait longer with a larger timeout)"
                )
            log.debug("dropping a late reply %s to request %d", type(reply).__name__, reply.id)


def no_answer(address: str, limit: float, curve: ClientKeys | None) -> str:
    """The message of a request that got no answer in time."""
    text = (
        f"wstream-server at {address} did not answer within {limit:g} s; this connection is closed. "
        "Is the server running?"
    )
    hint = curve_hint(address, curve)
    return f"{text} {hint}" if hint else text


def curve_hint(address: str, curve: ClientKeys | None) -> str:
    """What to check about CURVE keys when a server at ``address`` does not answer: a failed CURVE
    handshake is silent in ZeroMQ (NOTE [Which endpoints are encrypted], point 4). Empty for ipc."""
    if not uses_curve(address):
        return ""
    if curve is None:
        return (
            f"If it uses CURVE encryption (--curve-secret-key), give this client the server's public key "
            f"(server_public_key=, ${ENV_SERVER_KEY} or --server-key): a CURVE server never answers a "
            "plaintext client."
        )
    hint = (
        f"This client used CURVE (server key {curve.server_public.decode()}): check that it is the "
        "server's public key (its NAME.key; a CURVE server never answers a client holding another key), "
        "and, if the server has --curve-authorized-keys, that this client's public key "
        f"({curve.public.decode()}) is in that directory."
    )
    if curve.ephemeral:
        hint += (
            " This client has a temporary key, which no such directory holds: give client_secret_key= "
            f"(${ENV_CLIENT_KEY} or --client-key) if the server authorizes clients by key."
        )
    return hint


def raise_or_narrow(reply: m.Message, reply_type: type[R]) -> R:
    """Raise the exception of an ``error`` reply, or check the reply's type."""
    if isinstance(reply, m.Error):
        raise error_from_code(reply.code, reply.message)
    if not isinstance(reply, reply_type):
        from wstream.protocol import ProtocolError

        raise ProtocolError(f"expected a {reply_type.__name__} reply, got {type(reply).__name__}")
    return reply


def client_nonce() -> bytes:
    return os.urandom(32)


def challenge(chan: Channel) -> bytes:
    """A fresh single-use nonce from the server (``hello``)."""
    reply, _ = chan.request(m.Hello(), m.Challenge)
    return reply.nonce


def attach_session(chan: Channel, name: str, token: str) -> tuple[m.Attached, SessionSigner]:
    """Attach to job ``name`` by challenge-response (the token is not sent); return the reply and
    the signer of the new session."""
    key = secret_key(token)
    for attempt in (0, 1):
        nonce, mine = challenge(chan), client_nonce()
        try:
            attached, _ = chan.request(
                m.Attach(name=name, nonce=nonce, client_nonce=mine, proof=attach_proof(key, name, nonce, mine)),
                m.Attached,
            )
        except AuthError as exc:
            # a nonce lost in a server restart between 'hello' and 'attach': one more try
            if attempt or "nonce" not in exc.message:
                raise
            continue
        return attached, SessionSigner(attached.session, session_key(key, nonce, mine))
    raise AssertionError("unreachable")


def admin_session(chan: Channel, secret: str) -> SessionSigner:
    """Open an admin session with the server's admin secret (not sent); return its signer."""
    key = secret_key(secret)
    nonce, mine = challenge(chan), client_nonce()
    reply, _ = chan.request(
        m.AdminAttach(nonce=nonce, client_nonce=mine, proof=admin_proof(key, nonce, mine)), m.AdminAttached
    )
    return SessionSigner(reply.session, session_key(key, nonce, mine))


class SharedChannel(Channel):
    """A channel several threads may use (a ``Client``'s, which its ``Job`` handles share): one
    request at a time, each waiting for its own reply."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()

    def request(
        self, msg: m.Message, reply_type: type[R], frames: Sequence[object] = (), **kwargs: Any
    ) -> tuple[R, list[zmq.Frame]]:
        with self._lock:
            return super().request(msg, reply_type, frames, **kwargs)

    CLOSE_WAIT_S = 1.0
    """How long :meth:`close` waits for a request under way to see the close (it does within one
    poll slice) before it closes the socket all the same."""

    def close(self, why: str = "this connection to the server is closed") -> None:
        """Close, from any thread: a request under way in another thread ends with a
        :class:`StateError` saying ``why`` (within a poll slice), and the socket is closed once it has
        let go of it (ZeroMQ sockets must not be closed under a thread using them)."""
        self._closed = why
        got = self._lock.acquire(timeout=self.CLOSE_WAIT_S)
        try:
            self._sock.close(linger=0)
        finally:
            if got:
                self._lock.release()
