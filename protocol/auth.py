"""Challenge-response attach and signed requests (protocol version 2).

# NOTE [Signed requests]
# 1. A job's secret (its token) is known to the server only as ``key = SHA-256(token)``; the same
#    digest is all a snapshot stores. The admin secret is used the same way.
# 2. Attach: the server's ``challenge`` gives a single-use 32-byte ``nonce``; the client picks a
#    ``client_nonce`` and sends ``proof = HMAC-SHA256(key, ATTACH_LABEL + name + 0 + nonce +
#    client_nonce)``. The token itself never travels (except once, in ``create_job``).
# 3. Both ends then derive ``session key = HMAC-SHA256(key, SESSION_LABEL + nonce + client_nonce)``;
#    it is never sent.
# 4. Every request with a ``session`` carries ``seq`` (> 0, unique per session across all of that
#    session's sockets) and ``mac = HMAC-SHA256(session key, encode(message with mac=b""))``, where
#    ``encode`` is msgspec's msgpack encoding of the decoded record (deterministic: fields in
#    declaration order), with ``id``, ``seq`` and ``nframes`` as sent. The server recomputes it
#    from the record it decoded, so a sender's own msgpack field order does not matter.
# 5. Data frames are not covered; their count (``nframes``) is.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import threading

import msgspec

from . import messages as m
from .codec import encode
from .errors import InternalError

ATTACH_LABEL = b"wstream/attach/2\0"
ADMIN_LABEL = b"wstream/admin/2\0"
SESSION_LABEL = b"wstream/session/2\0"
BASE_LABEL = b"wstream/base/2\0"
MAC_BYTES = 32


def secret_key(secret: str) -> bytes:
    """The HMAC key of a job token or admin secret: its SHA-256 (what the server stores)."""
    return hashlib.sha256(secret.encode()).digest()


def _hmac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def attach_proof(key: bytes, name: str, nonce: bytes, client_nonce: bytes) -> bytes:
    """The ``proof`` of an ``attach`` to job ``name`` (NOTE [Signed requests], 2)."""
    return _hmac(key, ATTACH_LABEL + name.encode() + b"\0" + nonce + client_nonce)


def base_proof(key: bytes, base: str, nonce: bytes, client_nonce: bytes) -> bytes:
    """The ``base_proof`` of a ``create_job`` on top of frozen job ``base`` (its token's key)."""
    return _hmac(key, BASE_LABEL + base.encode() + b"\0" + nonce + client_nonce)


def admin_proof(key: bytes, nonce: bytes, client_nonce: bytes) -> bytes:
    """The ``proof`` of an ``admin_attach``."""
    return _hmac(key, ADMIN_LABEL + nonce + client_nonce)


def session_key(key: bytes, nonce: bytes, client_nonce: bytes) -> bytes:
    """The key a session's requests are signed with (NOTE [Signed requests], 3)."""
    return _hmac(key, SESSION_LABEL + nonce + client_nonce)


def request_mac(key: bytes, message: m.SessionMessage) -> bytes:
    """The ``mac`` of ``message`` under session key ``key`` (its own ``mac`` field is ignored)."""
    return _hmac(key, encode(msgspec.structs.replace(message, mac=b"")))


def mac_matches(key: bytes, message: m.SessionMessage) -> bool:
    """Constant-time check of ``message.mac``."""
    return len(message.mac) == MAC_BYTES and hmac.compare_digest(message.mac, request_mac(key, message))


class SessionSigner:
    """Signs the requests of one session; shared by every channel (thread) of that session.

    ``seq`` comes from one counter under a lock, so it is unique across the session's sockets."""

    def __init__(self, session: bytes, key: bytes) -> None:
        self.session = session
        self._key = key
        self._seq = itertools.count(1)
        self._lock = threading.Lock()

    def next_seq(self) -> int:
        with self._lock:
            return next(self._seq)

    def sign(self, message: m.Message) -> m.Message:
        """``message`` with ``seq`` and ``mac`` set; messages without a session pass unchanged."""
        if not isinstance(message, m.SessionMessage):
            return message
        if message.session != self.session:
            raise InternalError("a session signer was given another session's message (a bug in wstream)")
        unsigned = msgspec.structs.replace(message, seq=self.next_seq(), mac=b"")
        return msgspec.structs.replace(unsigned, mac=_hmac(self._key, encode(unsigned)))
