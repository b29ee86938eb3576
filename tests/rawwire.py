"""Talk to a server below the client library: hand-made frames, encoded with ``msgpack``.

Using a second msgpack implementation here also checks that the wire really is plain msgpack.
"""

from __future__ import annotations

from typing import Any

import msgpack
import zmq

from wstream.protocol import PROTOCOL_VERSION


class RawPeer:
    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(address)

    def send_frames(self, frames: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        self.sock.send_multipart(frames)
        if not self.sock.poll(20_000):
            raise AssertionError("the server did not answer within 20 s")
        reply = self.sock.recv_multipart()
        return msgpack.unpackb(reply[0]), reply[1:]

    def request(self, op: str, *frames: bytes, **fields: Any) -> tuple[dict[str, Any], list[bytes]]:
        header = {"v": PROTOCOL_VERSION, "op": op, "id": 7, **fields}
        return self.send_frames([msgpack.packb(header), *frames])

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()
