"""A worker process for tests: attach to a job, train some steps, report what happened as JSON.

Usage: python worker_main.py ADDRESS JOB TOKEN MODEL STEPS RANK OUT.json [--frames] [--prefetch K]
       [--data-offset D]  (batches of ``models.batch(model, step, D + RANK)``)
       [--barrier DIR]  (after joining, touch DIR/ready-JOB-RANK and wait for DIR/go before training)
       RANK -1: launched by torchrun (rank and world size from its environment; OUT may hold
       "{rank}"), combining gradients by --reduce server|allreduce
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))

import models  # noqa: E402

from wstream.client import Client  # noqa: E402
from wstream.client.distributed import from_torchrun  # noqa: E402


def rss_anon() -> int:
    """Private anonymous memory of this process (bytes): what it allocated itself. Unlike RSS it
    leaves out pages of shared memory that are mapped from the server."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakSampler:
    """Samples RssAnon every 2 ms in a thread, so peaks inside a step are seen."""

    def __init__(self) -> None:
        self.peak = rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_anon())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, rss_anon())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("job")
    p.add_argument("token")
    p.add_argument("model")
    p.add_argument("steps", type=int)
    p.add_argument("rank", type=int)
    p.add_argument("out")
    p.add_argument("--frames", action="store_true")
    p.add_argument("--copy", action="store_true", help="copy weights into the ring (no zero-copy)")
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--data-offset", type=int, default=0, help="train on the batches of rank D + RANK")
    p.add_argument("--barrier", help="directory: announce the join there and wait for its 'go' file")
    p.add_argument("--warmup-width", type=int, default=0, help="initialize torch's kernels before measuring")
    p.add_argument("--reduce", default="server", choices=["server", "allreduce"])
    p.add_argument("--micro-batches", default="1", help="micro-batches per step, or one per rank: '2,1'")
    args = p.parse_args()
    if args.rank < 0:  # torchrun
        launch = from_torchrun()
        args.rank = launch.rank
        args.world_size = launch.world_size if args.reduce == "server" else 1
        args.out = args.out.format(rank=launch.rank)
    torch.manual_seed(1234 + args.rank)
    with torch.device("meta"):
        stages = models.BUILDERS[args.model]()
    with Client(args.address, timeout=30) as client:
        job = client.attach_job(args.job, token=args.token, stages=stages)
        if args.warmup_width:  # torch's one-time runtime buffers are not the worker's memory
            lin = torch.nn.Linear(args.warmup_width, args.warmup_width)
            x0 = torch.randn(16, args.warmup_width, requires_grad=True)
            torch.autograd.grad(torch.tanh(lin(x0)).sum(), [x0, *lin.parameters()])
            del lin, x0
        anon0 = rss_anon()
        sampler = PeakSampler()
        trainer = job.trainer(
            prefetch=args.prefetch,
            shm=False if args.frames else None,
            world_size=args.world_size,
            zero_copy=False if args.copy else None,
            reduce=args.reduce,
        )
        if args.barrier:  # lets a test start many jobs' workers training at the same moment
            (Path(args.barrier) / f"ready-{args.job}-{args.rank}").touch()
            while not (Path(args.barrier) / "go").exists():
                time.sleep(0.01)
        losses = []
        step_s = []
        for _ in range(args.steps):
            x, y = models.batch(args.model, trainer.step_index, args.data_offset + args.rank)
            t0 = time.perf_counter()
            k = [int(v) for v in args.micro_batches.split(",")]
            losses.append(trainer.step(x, y, models.loss_fn, micro_batches=k[args.rank % len(k)]))
            step_s.append(time.perf_counter() - t0)
        peak_anon = sampler.stop()
        stats = trainer.stats()
        trainer.close()
    with open(args.out, "w") as f:
        json.dump(
            {
                "losses": losses,
                "step_s": step_s,
                "anon_before": anon0,
                "peak_anon": peak_anon,
                "peak_resident_stages": stats.peak_resident_stages,
                "ring_bytes": stats.ring_bytes,
                "shm": trainer.shm,
                "zero_copy": trainer.zero_copy,
                "fetches": stats.fetches,
                "bytes_fetched": stats.bytes_fetched,
                "pushes": stats.pushes,
                "fetch_latency_s": stats.fetch_latency.samples(),
                "fetch_latency_skipped": stats.fetch_latency_skipped,
            },
            f,
        )


if __name__ == "__main__":
    main()
