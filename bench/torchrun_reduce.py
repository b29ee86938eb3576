"""Data-parallel ranks under torchrun: server-side averaging vs all-reduce among the ranks (gloo).

Launches ``torchrun --standalone --nproc-per-node N`` twice on one job shape, once per mode, and
prints each mode's median step time (the slowest rank's), the gradient bytes that reached the
server per step, and the ratio. Every rank runs with OMP_NUM_THREADS = cores / N.

    python bench/torchrun_reduce.py [--ranks 2] [--stages 8] [--width 512] [--batch 64] [--steps 8]

(A worker of this script is the same file run by torchrun, with RANK set.)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import machine, parse_args, server
from train_step import Block, loss_fn
from wstream.client import AdamW, Client
from wstream.client.distributed import from_torchrun


def worker(args: argparse.Namespace) -> None:
    launch = from_torchrun()
    with torch.device("meta"):
        skeleton = [Block(args.width) for _ in range(args.stages)]
    with Client(args.address, timeout=60) as client:
        job = client.attach_job(args.job, token="b", stages=skeleton)
        world = launch.world_size if args.reduce == "server" else 1
        with job.trainer(world_size=world, reduce=args.reduce) as trainer:
            g = torch.Generator().manual_seed(launch.rank)
            data = [(torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, args.width, generator=g))
                    for _ in range(args.steps + 1)]
            trainer.step(*data[0], loss_fn)  # warm-up
            times = []
            for x, y in data[1:]:
                t0 = time.perf_counter()
                trainer.step(x, y, loss_fn)
                times.append(time.perf_counter() - t0)
            stats = trainer.stats()
    Path(args.out.format(rank=launch.rank)).write_text(
        json.dumps({"step_s": times, "bytes_pushed": stats.bytes_pushed, "steps": stats.steps})
    )


def launch(args: argparse.Namespace, address: str, reduce: str, tmp: str) -> dict:
    threads = max(1, (os.cpu_count() or 1) // args.ranks)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}", __file__,
        "--worker", "--address", address, "--job", reduce, "--reduce", reduce, "--out", f"{tmp}/{reduce}-{{rank}}.json",
        "--stages", str(args.stages), "--width", str(args.width), "--batch", str(args.batch), "--steps", str(args.steps),
    ]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)}, timeout=900)
    reports = [json.loads(Path(f"{tmp}/{reduce}-{r}.json").read_text()) for r in range(args.ranks)]
    slowest = [max(step) for step in zip(*(r["step_s"] for r in reports))]
    pushed = sum(r["bytes_pushed"] for r in reports) / reports[0]["steps"]
    return {"median_s": statistics.median(slowest), "pushed_per_step": pushed}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--stages", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--address")
    p.add_argument("--job")
    p.add_argument("--reduce", default="server")
    p.add_argument("--out")
    args = parse_args(p, smoke=dict(stages=2, width=32, batch=8, steps=1))
    if args.worker:
        worker(args)
        return
    print(f"machine: {machine()}")
    torch.manual_seed(0)
    stages = [Block(args.width) for _ in range(args.stages)]
    params = sum(q.numel() for s in stages for q in s.parameters())
    print(f"{args.ranks} ranks, {args.stages} stages, {params / 1e6:.1f} M parameters, batch {args.batch} per rank")
    results = {}
    with server("--memory-limit", "8GiB") as address, Client(address) as client, tempfile.TemporaryDirectory() as tmp:
        for reduce in ("server", "allreduce"):
            client.create_job(reduce, copy.deepcopy(stages), optimizer=AdamW(lr=1e-4), token="b")
            results[reduce] = launch(args, address, reduce, tmp)
            r = results[reduce]
            print(
                f"reduce={reduce:9s}: {r['median_s'] * 1e3:7.1f} ms/step (slowest rank, median), "
                f"{r['pushed_per_step'] / 2**20:6.1f} MiB of gradients to the server per step",
                flush=True,
            )
    ratio = results["allreduce"]["median_s"] / results["server"]["median_s"]
    print(f"allreduce / server step time: {ratio:.2f}")


if __name__ == "__main__":
    main()
