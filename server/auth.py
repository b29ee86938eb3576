"""Server-side state of authentication: outstanding nonces, per-session replay windows, and the
CURVE client keys the transport lets in.

All are bounded whatever clients send: a flood of ``hello`` evicts the oldest nonces, a replay
window is a fixed-size bitmap, and refused keys are remembered (to rate-limit the log) up to a cap.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from wstream.protocol import AuthError
from wstream.protocol.curve import public_keys_in

log = logging.getLogger(__name__)

NONCE_BYTES = 32


class NonceStore:
    """Single-use nonces that live ``ttl_s`` seconds; at most ``capacity`` kept (oldest evicted)."""

    def __init__(self, ttl_s: float, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._clock = clock
        self._expiry: OrderedDict[bytes, float] = OrderedDict()  # insertion order = expiry order
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._expiry)

    def issue(self) -> bytes:
        now = self._clock()
        while self._expiry and next(iter(self._expiry.values())) <= now:
            self._expiry.popitem(last=False)
        while len(self._expiry) >= self.capacity:
            self._expiry.popitem(last=False)
            self.evicted += 1
        nonce = secrets.token_bytes(NONCE_BYTES)
        self._expiry[nonce] = now + self.ttl_s
        return nonce

    def take(self, nonce: bytes) -> None:
        """Consume ``nonce``; raise :class:`AuthError` saying why it is not usable."""
        expiry = self._expiry.pop(nonce, None)
        if expiry is None:
            raise AuthError(
                "unknown, expired or already used nonce: ask for a fresh one with 'hello' (nonces are "
                "single-use, expire, and the oldest are dropped when many are outstanding)"
            )
        if expiry <= self._clock():
            raise AuthError(f"expired nonce: it was older than {self.ttl_s:g} s; ask for a fresh one with 'hello'")


class ReplayWindow:
    """Which ``seq`` values a session has used, over the last ``size`` below the highest seen.

    A seq is accepted once; one ``size`` or more below the highest seen is refused as too old (the
    client's counter is shared by its sockets, so seqs arrive nearly in order)."""

    __slots__ = ("_bits", "highest", "size")

    def __init__(self, size: int = 65_536) -> None:
        if size <= 0 or size % 8:
            raise ValueError(f"ReplayWindow size must be a positive multiple of 8, got {size}")
        self.size = size
        self.highest = 0
        self._bits = bytearray(size // 8)

    def _flip(self, seq: int, on: bool) -> bool:
        i = seq % self.size
        byte, bit = divmod(i, 8)
        was = bool(self._bits[byte] >> bit & 1)
        if on:
            self._bits[byte] |= 1 << bit
        else:
            self._bits[byte] &= ~(1 << bit) & 0xFF
        return was

    def _clear(self, lo: int, hi: int) -> None:
        """Clear the slots of seqs ``lo .. hi - 1`` (fewer than ``size`` of them), whole bytes at
        once: a session that skips far ahead must not cost the loop a Python step per seq."""
        if hi <= lo:
            return
        start = lo % self.size
        end = start + (hi - lo)
        if end <= self.size:
            self._clear_bits(start, end)
        else:  # the range wraps around the window
            self._clear_bits(start, self.size)
            self._clear_bits(0, end - self.size)

    def _clear_bits(self, a: int, b: int) -> None:
        while a < b and a % 8:
            self._bits[a // 8] &= ~(1 << a % 8) & 0xFF
            a += 1
        while b > a and b % 8:
            b -= 1
            self._bits[b // 8] &= ~(1 << b % 8) & 0xFF
        if a < b:
            self._bits[a // 8 : b // 8] = bytes((b - a) // 8)

    def check(self, seq: int) -> None:
        """Record ``seq``; raise :class:`AuthError` for a replayed or too old one."""
        if seq <= 0:
            raise AuthError("seq must be > 0 in a signed request")
        if seq <= self.highest - self.size:
            raise AuthError(
                f"seq {seq} is too old: more than {self.size} below the highest seen ({self.highest}); "
                "a replayed message?"
            )
        if seq > self.highest:
            self._clear(max(self.highest + 1, seq - self.size + 1), seq)  # slots reused by seqs not seen yet
            self.highest = seq
            self._flip(seq, True)
            return
        if self._flip(seq, True):
            raise AuthError(f"replayed message: seq {seq} was already used in this session")


class AuthorizedKeys:
    """The CURVE client keys a server lets in (the ``*.key`` certificates of a directory, read
    once), as a ``zmq.auth`` credentials provider.

    pyzmq's own directory check (``configure_curve(location=DIR)``) logs refusals at DEBUG only;
    this provider, plugged in with ``configure_curve_callback``, logs each refused key at WARNING,
    at most once a minute per key (a refused client reconnects by itself)."""

    def __init__(self, directory: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = directory
        self.keys = public_keys_in(directory)
        self._clock = clock
        self._last_warned: OrderedDict[bytes, float] = OrderedDict()
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: may the client with z85 public key ``key`` connect? (On the authenticator thread.)"""
        if key in self.keys:
            return True
        self.refused += 1
        now = self._clock()
        last = self._last_warned.get(key)
        if last is None or now - last >= 60.0:
            log.warning(
                "refused a CURVE connection: client key %s is not in %s", key.decode(errors="replace"), self.directory
            )
            self._last_warned[key] = now
            self._last_warned.move_to_end(key)
            while len(self._last_warned) > 1024:
                self._last_warned.popitem(last=False)
        return False


def start_authenticator(ctx: zmq.Context[Any], directory: str) -> ThreadAuthenticator:
    """A ZAP handler on ``ctx`` that admits only the CURVE clients whose public certificates are in
    ``directory``. Start it before binding; stop it (``.stop()``) before terminating ``ctx``."""
    authorized = AuthorizedKeys(directory)
    auth = ThreadAuthenticator(ctx, log=logging.getLogger(f"{__name__}.zap"))
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=authorized)
    log.info("CURVE clients authorized: %d keys from %s", len(authorized.keys), directory)
    return auth
