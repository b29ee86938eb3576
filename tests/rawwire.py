"""Talk to a server below the client library: hand-made frames, encoded with ``msgpack``.

Using a second msgpack implementation here also checks that the wire really is plain msgpack.
:class:`RawSession` does the protocol-2 handshake and signs requests by hand, so raw tests stay
readable; the mac is computed over the library's canonical encoding of the decoded header (what
the server recomputes), which is what NOTE [Signed requests] in ``wstream.protocol.auth`` specifies.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
from wstream.protocol import PROTOCOL_VERSION, decode_request, encode
from wstream.protocol.auth import admin_proof, attach_proof, secret_key, session_key


class RawPeer:
    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(address)
        self.sent: list[bytes] = []  # every frame sent and received, for tests that inspect the wire
        self.received: list[bytes] = []

    def send_frames(self, frames: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        self.sent.extend(frames)
        self.sock.send_multipart(frames)
        if not self.sock.poll(20_000):
            raise AssertionError("the server did not answer within 20 s")
        reply = self.sock.recv_multipart()
        self.received.extend(reply)
        return msgpack.unpackb(reply[0]), reply[1:]

    def request(self, op: str, *frames: bytes, **fields: Any) -> tuple[dict[str, Any], list[bytes]]:
        header = {"v": PROTOCOL_VERSION, "op": op, "id": 7, **fields}
        return self.send_frames([msgpack.packb(header), *frames])

    def nonce(self) -> bytes:
        reply, _ = self.request("hello")
        assert reply["op"] == "challenge", reply
        return reply["nonce"]

    def attach(self, job: str, token: str) -> RawSession:
        """hello + attach with ``token``'s proof; the reply must be ``attached``."""
        reply, session = self.try_attach(job, token)
        assert reply["op"] == "attached", reply
        assert session is not None
        return session

    def try_attach(
        self,
        job: str,
        token: str | None = None,
        *,
        nonce: bytes | None = None,
        key: bytes | None = None,
        proof: Callable[[bytes, bytes], bytes] | None = None,
    ) -> tuple[dict[str, Any], RawSession | None]:
        """An attach with ``token``'s proof, or with the proof made from a raw ``key`` (as the
        library derives it from a token), or with ``proof(nonce, client_nonce)`` made by hand."""
        if key is None:
            assert token is not None or proof is not None, "give a token, a key or a proof"
            key = secret_key(token or "")
        nonce = self.nonce() if nonce is None else nonce
        mine = os.urandom(32)
        made = attach_proof(key, job, nonce, mine) if proof is None else proof(nonce, mine)
        reply, _ = self.request("attach", name=job, nonce=nonce, client_nonce=mine, proof=made)
        if reply["op"] != "attached":
            return reply, None
        return reply, RawSession(self, reply["session"], session_key(key, nonce, mine))

    def admin_attach(self, secret: str) -> tuple[dict[str, Any], RawSession | None]:
        key = secret_key(secret)
        nonce, mine = self.nonce(), os.urandom(32)
        reply, _ = self.request("admin_attach", nonce=nonce, client_nonce=mine, proof=admin_proof(key, nonce, mine))
        if reply["op"] != "admin_attached":
            return reply, None
        return reply, RawSession(self, reply["session"], session_key(key, nonce, mine))

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


class RawSession:
    """A session opened by hand: ``request`` signs like the client library does."""

    def __init__(self, peer: RawPeer, session: bytes, key: bytes) -> None:
        self.peer = peer
        self.session = session
        self.key = key
        self.seq = 0

    def header(self, op: str, *, nframes: int | None = None, key: bytes | None = None, **fields: Any) -> bytes:
        """A signed header (``seq`` the next one unless given; ``key`` overrides the session's)."""
        if "seq" not in fields:
            self.seq += 1
            fields["seq"] = self.seq
        plain: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": op, "id": 7, "session": self.session, **fields}
        if nframes is not None:
            plain["nframes"] = nframes
        canonical = encode(decode_request(msgpack.packb({**plain, "mac": b""})))
        plain["mac"] = hmac.new(key or self.key, canonical, hashlib.sha256).digest()
        return msgpack.packb(plain)

    def request(self, op: str, *frames: bytes, **fields: Any) -> tuple[dict[str, Any], list[bytes]]:
        nframes = len(frames) if op in ("push", "add_stage") else None
        return self.peer.send_frames([self.header(op, nframes=nframes, **fields), *frames])
