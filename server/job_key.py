"""What the server keeps of a job's token, and the checks made with it: attach proofs, base
proofs, session keys (NOTE [Signed requests] in ``protocol/auth.py``). The token itself is never
kept, in memory or in snapshots; only its digest."""

from __future__ import annotations

import hmac

from wstream.protocol import AuthError
from wstream.protocol.auth import attach_proof, base_proof, secret_key, session_key


def token_digest(token: str) -> bytes:
    """What the server keeps of a job's token (in memory and in snapshots): the HMAC key of
    NOTE [Signed requests] in ``protocol/auth.py``."""
    return secret_key(token)


class JobKey:
    """The token digest of job ``name``."""

    __slots__ = ("digest", "name")

    def __init__(self, name: str, digest: bytes) -> None:
        self.name = name
        self.digest = digest

    def check_proof(self, nonce: bytes, client_nonce: bytes, proof: bytes) -> None:
        """Check an attach proof (the expected value is never revealed)."""
        if not hmac.compare_digest(proof, attach_proof(self.digest, self.name, nonce, client_nonce)):
            raise AuthError(f"wrong token for job {self.name!r}: the attach proof does not match")

    def check_base_proof(self, nonce: bytes, client_nonce: bytes, proof: bytes | None) -> None:
        """Check the proof a new job gives of this (frozen) job's token, to train on top of it."""
        if proof is None or not hmac.compare_digest(proof, base_proof(self.digest, self.name, nonce, client_nonce)):
            raise AuthError(f"wrong token for the base {self.name!r}: the base proof does not match")

    def session_key(self, nonce: bytes, client_nonce: bytes) -> bytes:
        return session_key(self.digest, nonce, client_nonce)
