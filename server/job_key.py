"""What the server keeps of a secret (a job's token, the admin secret) and the checks made with it:
attach, base, admin and creation proofs, and the session keys they open (NOTE [Signed requests] in
``protocol/auth.py``). The server keeps only the secret's *verifier*, from which the key that
proofs are made with cannot be computed: in memory and in snapshots, a verifier opens nothing."""

from __future__ import annotations

from wstream.protocol import AuthError
from wstream.protocol.auth import admin_message, attach_message, base_message, create_message, recover_key
from wstream.protocol.auth import secret_key, session_key, verifier


def token_verifier(token: str) -> bytes:
    """What the server keeps of a job's token (in memory and in snapshots)."""
    return verifier(secret_key(token))


class Verifier:
    """A secret's verifier; each check returns the session key the proof opens, or raises
    :class:`AuthError` (the expected value is never revealed)."""

    __slots__ = ("vk",)

    def __init__(self, vk: bytes) -> None:
        self.vk = vk

    def _open(self, message: bytes, nonce: bytes, client_nonce: bytes, proof: bytes | None, refusal: str) -> bytes:
        key = None if proof is None else recover_key(self.vk, message, proof)
        if key is None:
            raise AuthError(refusal)
        return session_key(key, nonce, client_nonce)

    def check_admin(self, nonce: bytes, client_nonce: bytes, proof: bytes) -> bytes:
        """Check an ``admin_attach`` proof; the admin session's key."""
        refusal = "wrong admin secret: the admin_attach proof does not match"
        return self._open(admin_message(nonce, client_nonce), nonce, client_nonce, proof, refusal)

    def check_create(self, name: str, nonce: bytes, client_nonce: bytes, proof: bytes | None) -> None:
        """Check the proof of the admin secret that a ``create_job`` on a server with one carries."""
        if proof is None:
            raise AuthError(
                f"this server has an admin secret: creating job {name!r} needs it (Client(address, "
                "admin_secret=...) or $WSTREAM_ADMIN_SECRET_FILE); the job's token alone does not create jobs"
            )
        self._open(create_message(name, nonce, client_nonce), nonce, client_nonce, proof,
                   f"wrong admin secret: the admin proof of create_job {name!r} does not match")


class JobKey(Verifier):
    """The verifier of job ``name``'s token."""

    __slots__ = ("name",)

    def __init__(self, name: str, vk: bytes) -> None:
        super().__init__(vk)
        self.name = name

    def check_proof(self, nonce: bytes, client_nonce: bytes, proof: bytes) -> bytes:
        """Check an attach proof; the new session's key."""
        refusal = f"wrong token for job {self.name!r}: the attach proof does not match"
        return self._open(attach_message(self.name, nonce, client_nonce), nonce, client_nonce, proof, refusal)

    def check_base_proof(self, nonce: bytes, client_nonce: bytes, proof: bytes | None) -> None:
        """Check the proof a new job gives of this (frozen) job's token, to train on top of it."""
        refusal = f"wrong token for the base {self.name!r}: the base proof does not match"
        self._open(base_message(self.name, nonce, client_nonce), nonce, client_nonce, proof, refusal)
