"""Challenge-response attach and signed requests (protocol version 5).

# NOTE [Signed requests]
# 1. Keys. A job's token (or the admin secret) gives the *client key*
#    ``ck = HKDF-SHA256(ikm=SHA-256(secret), salt=KEY_SALT, info=CLIENT_KEY_INFO)`` (RFC 5869),
#    known only to whoever knows the secret, and the *verifier* ``vk = SHA-256(ck)``. The server
#    keeps only ``vk`` (in memory and in snapshots): ``ck`` cannot be computed from it, so a copy
#    of a store opens no job. (SCRAM's StoredKey, RFC 5802; the inner SHA-256 lets a protocol-4
#    manifest, which held ``SHA-256(token)``, be migrated to ``vk`` without the token.)
# 2. Attach: the server's ``challenge`` gives a single-use 32-byte ``nonce``; the client picks a
#    ``client_nonce`` and sends ``proof = ck XOR HMAC-SHA256(vk, ATTACH_LABEL + name + 0 + nonce +
#    client_nonce)``. The server recomputes the HMAC from ``vk``, XORs it off to recover ``ck`` and
#    accepts when ``SHA-256(ck) == vk`` (SCRAM's ClientProof). The token never travels (except
#    once, in ``create_job``); ``vk`` alone cannot make a proof, and a proof without ``vk`` reveals
#    nothing of ``ck``. Base proofs (``create_job`` on a frozen base), admin proofs and the proof
#    with which ``create_job`` shows the admin secret are the same with their own labels.
# 3. Both ends then derive ``session key = HMAC-SHA256(ck, SESSION_LABEL + nonce + client_nonce)``;
#    it is never sent. The server holds ``ck`` only while it derives that key.
# 4. Every request with a ``session`` carries ``seq`` (> 0, unique per session across all of that
#    session's sockets) and ``mac = HMAC-SHA256(session key, encode(message with mac=b""))``, where
#    ``encode`` is msgspec's msgpack encoding of the decoded record (deterministic: fields in
#    declaration order), with ``id``, ``seq`` and ``nframes`` as sent. The server recomputes it
#    from the record it decoded, so a sender's own msgpack field order does not matter.
# 5. Data frames are not covered; their count (``nframes``) is.
# 6. What ``vk`` still allows (as in SCRAM): whoever holds ``vk`` *and* has recorded one attach
#    (its nonces and proof) can recover ``ck``. Use ipc or CURVE where the wire can be read. A
#    weak token can be guessed offline from ``vk``: make tokens random (``secrets.token_urlsafe``).
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

KEY_SALT = b"wstream/key/5"
CLIENT_KEY_INFO = b"wstream/client-key/5"
ATTACH_LABEL = b"wstream/attach/5\0"
ADMIN_LABEL = b"wstream/admin/5\0"
CREATE_LABEL = b"wstream/create/5\0"
SESSION_LABEL = b"wstream/session/5\0"
BASE_LABEL = b"wstream/base/5\0"
MAC_BYTES = 32


def hkdf_sha256(ikm: bytes, *, salt: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF with SHA-256 (RFC 5869): extract with ``salt``, expand with ``info`` to ``length`` bytes."""
    if not 0 < length <= 255 * 32:
        raise ValueError(f"HKDF-SHA256 gives 1 to {255 * 32} bytes, not {length}")
    prk = hmac.new(salt or bytes(32), ikm, hashlib.sha256).digest()
    out, block = b"", b""
    for i in range(1, -(-length // 32) + 1):
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        out += block
    return out[:length]


def legacy_digest(secret: str) -> bytes:
    """``SHA-256(secret)``: what protocol 4 used as the key and stored (``token_sha256``)."""
    return hashlib.sha256(secret.encode()).digest()


def client_key_of_digest(digest: bytes) -> bytes:
    """The client key of a secret whose :func:`legacy_digest` is ``digest`` (NOTE rule 1)."""
    return hkdf_sha256(digest, salt=KEY_SALT, info=CLIENT_KEY_INFO)


def secret_key(secret: str) -> bytes:
    """The client key ``ck`` of a job token or admin secret (NOTE [Signed requests], 1): what
    proofs are made with. Never sent, never stored by the server."""
    return client_key_of_digest(legacy_digest(secret))


def verifier(key: bytes) -> bytes:
    """``vk = SHA-256(ck)``: what the server keeps of a secret, from which ``ck`` cannot be had."""
    return hashlib.sha256(key).digest()


def _hmac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b, strict=True))


def _prove(key: bytes, message: bytes) -> bytes:
    return _xor(key, _hmac(verifier(key), message))


def recover_key(vk: bytes, message: bytes, proof: bytes) -> bytes | None:
    """The client key a ``proof`` of ``message`` carries when it was made with the key whose
    verifier is ``vk``; None for any other proof (checked in constant time)."""
    if len(proof) != len(vk):
        return None
    key = _xor(proof, _hmac(vk, message))
    return key if hmac.compare_digest(verifier(key), vk) else None


def attach_message(name: str, nonce: bytes, client_nonce: bytes) -> bytes:
    return ATTACH_LABEL + name.encode() + b"\0" + nonce + client_nonce


def base_message(base: str, nonce: bytes, client_nonce: bytes) -> bytes:
    return BASE_LABEL + base.encode() + b"\0" + nonce + client_nonce


def admin_message(nonce: bytes, client_nonce: bytes) -> bytes:
    return ADMIN_LABEL + nonce + client_nonce


def create_message(name: str, nonce: bytes, client_nonce: bytes) -> bytes:
    return CREATE_LABEL + name.encode() + b"\0" + nonce + client_nonce


def attach_proof(key: bytes, name: str, nonce: bytes, client_nonce: bytes) -> bytes:
    """The ``proof`` of an ``attach`` to job ``name`` (NOTE [Signed requests], 2)."""
    return _prove(key, attach_message(name, nonce, client_nonce))


def base_proof(key: bytes, base: str, nonce: bytes, client_nonce: bytes) -> bytes:
    """The ``base_proof`` of a ``create_job`` on top of frozen job ``base`` (its token's key)."""
    return _prove(key, base_message(base, nonce, client_nonce))


def admin_proof(key: bytes, nonce: bytes, client_nonce: bytes) -> bytes:
    """The ``proof`` of an ``admin_attach`` (``key``: the admin secret's client key)."""
    return _prove(key, admin_message(nonce, client_nonce))


def create_proof(key: bytes, name: str, nonce: bytes, client_nonce: bytes) -> bytes:
    """The ``admin_proof`` of a ``create_job`` of job ``name`` on a server with an admin secret."""
    return _prove(key, create_message(name, nonce, client_nonce))


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
