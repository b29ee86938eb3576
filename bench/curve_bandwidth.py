"""What CURVE encryption costs a worker that receives weights as data frames (``shm=False``).

The real fetch path (the prefetch thread: ``fetch`` request, reply with the stage's bytes in 4 MiB
frames, copy into the ring) over loopback tcp, against a plaintext server and a CURVE server.
Workers on the server's host use shared memory and send only small headers, so for them CURVE
costs next to nothing; this is the figure for remote workers.

    python bench/curve_bandwidth.py [--stage-mib 16] [--stages 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import socket
import tempfile
from typing import Any

from common import FlatStage, machine, parse_args, server, time_fetches
from wstream.client import AdamW, Client
from wstream.protocol.curve import write_keypair


def free_tcp_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def fetch_seconds(address: str, args: argparse.Namespace, **keys: Any) -> float:
    numel = args.stage_mib * 2**20 // 4
    with Client(address, **keys) as client:
        job = client.create_job("bw", (FlatStage(numel) for _ in range(args.stages)), optimizer=AdamW(), token="b")
        trainer = job.trainer(prefetch=2, shm=False)
        try:
            return time_fetches(trainer, args.stages, rounds=args.rounds, repeat=args.repeat)
        finally:
            trainer.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stage-mib", type=int, default=16)
    p.add_argument("--stages", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2, help="passes over all stages per measurement")
    p.add_argument("--repeat", type=int, default=3)
    args = parse_args(p, smoke=dict(stage_mib=1, stages=2, rounds=1, repeat=1))
    total = args.stages * args.rounds * args.stage_mib * 2**20
    print(f"machine: {machine()}")
    print(f"{args.stages} stages x {args.stage_mib} MiB as data frames over loopback tcp, {args.rounds} rounds")
    with tempfile.TemporaryDirectory() as keydir:
        public, secret = write_keypair(keydir, "server")
        with server("--memory-limit", "8GiB", address=free_tcp_address()) as address:
            plain = fetch_seconds(address, args)
        keys = {"server_public_key": public}
        with server("--memory-limit", "8GiB", "--curve-secret-key", secret, address=free_tcp_address(), **keys) as address:
            curve = fetch_seconds(address, args, **keys)
    for name, t in (("plaintext", plain), ("CURVE", curve)):
        print(f"fetch over tcp, {name:9}: {total / t / 1e9:6.2f} GB/s")
    print(f"CURVE / plaintext: {plain / curve:.2f}")


if __name__ == "__main__":
    main()
