"""The wire protocol by hand: plain pyzmq and msgpack, no wstream code on this side of the socket.

A job is created with the wstream client (the only use of the library here); then a DEALER socket
speaks protocol 11 directly (``protocol/README.md``): ``status``; ``hello`` for a nonce; ``attach``
with a proof of the job's token, computed with ``hmac``/``hashlib``; and a bad message, which gets
an ``error`` reply while the server goes on.

    python examples/raw_protocol.py
"""

from __future__ import annotations

import hashlib
import hmac
import os
import tempfile

import msgpack
import zmq
from torch import nn

from wstream.client import Client, local_server

VERSION = 11
ATTACH_LABEL = b"wstream/attach/5\0"  # the labels of the keys and proofs date from protocol 5


def client_key(token: str) -> bytes:
    """HKDF-SHA256 (RFC 5869) of SHA-256(token): the key proofs are made with. The server keeps only
    SHA-256 of it, the verifier, from which this key cannot be computed."""
    prk = hmac.new(b"wstream/key/5", hashlib.sha256(token.encode()).digest(), hashlib.sha256).digest()
    return hmac.new(prk, b"wstream/client-key/5" + b"\x01", hashlib.sha256).digest()


def attach_proof(key: bytes, name: str, nonce: bytes, client_nonce: bytes) -> bytes:
    """key XOR HMAC(verifier, label + name + 0 + nonces): the server, which has the verifier, takes
    the HMAC off and checks that the SHA-256 of what is left is the verifier."""
    mask = hmac.new(hashlib.sha256(key).digest(), ATTACH_LABEL + name.encode() + b"\0" + nonce + client_nonce,
                    hashlib.sha256).digest()
    return bytes(a ^ b for a, b in zip(key, mask))


def request(sock: zmq.Socket, op: str, request_id: int, **fields: object) -> dict:
    """Send one header (a msgpack map: v, op, id and the op's fields) and read the reply's header."""
    sock.send(msgpack.packb({"v": VERSION, "op": op, "id": request_id, **fields}))
    return msgpack.unpackb(sock.recv_multipart()[0])  # data frames, if any, would follow the header


def main() -> None:
    token = "raw-secret"
    with tempfile.TemporaryDirectory() as tmp, local_server(f"ipc://{tmp}/raw.sock", reuse=False) as address:
        with Client(address) as client:
            client.create_job("raw", [nn.Linear(4, 4), nn.Linear(4, 2)], token=token)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(address)
        sock.rcvtimeo = 10_000
        try:
            status = request(sock, "status", 1)
            print(f"status -> {status['op']}: protocol {status['protocol']}, jobs {[j['name'] for j in status['jobs']]}")
            challenge = request(sock, "hello", 2)
            nonce, client_nonce = challenge["nonce"], os.urandom(16)
            proof = attach_proof(client_key(token), "raw", nonce, client_nonce)
            attached = request(sock, "attach", 3, name="raw", nonce=nonce, client_nonce=client_nonce, proof=proof)
            # the server's stages; the job's two small stages are one transfer unit (its options' "units"
            # says how many of the model's stages each holds), parameters named "<stage>.<name>"
            print(
                f"attach -> {attached['op']}: session {attached['session'].hex()[:12]}..., "
                f"stages {[[(name, shape) for name, shape, *_rest in s['params']] for s in attached['stages']]} "
                f"(units {attached['options']['units']}), step {attached['step']}"
            )
            nonce2 = request(sock, "hello", 4)["nonce"]
            wrong = attach_proof(client_key("guess"), "raw", nonce2, client_nonce)
            refused = request(sock, "attach", 5, name="raw", nonce=nonce2, client_nonce=client_nonce, proof=wrong)
            print(f"attach with a wrong proof -> {refused['op']} {refused['code']}: {refused['message']}")
            bad = request(sock, "fetch", 6, session=b"x" * 16, stage=0, step=-1)
            print(f"a malformed fetch -> {bad['op']} {bad['code']}: {bad['message']}")
            print(f"status again -> {request(sock, 'status', 7)['op']} (the server is still serving)")
        finally:
            sock.close(linger=0)
            ctx.term()


if __name__ == "__main__":
    main()
