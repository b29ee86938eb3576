"""A worker process for tests: attach to a job, train some steps, report what happened as JSON.

Usage: python worker_main.py ADDRESS JOB TOKEN MODEL STEPS RANK OUT.json [--frames] [--prefetch K]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import psutil
import torch

sys.path.insert(0, os.path.dirname(__file__))

import models  # noqa: E402

from wstream.client import Client  # noqa: E402


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
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--world-size", type=int, default=1)
    args = p.parse_args()
    torch.manual_seed(1234 + args.rank)
    rss0 = psutil.Process().memory_info().rss
    with torch.device("meta"):
        stages = models.BUILDERS[args.model]()
    with Client(args.address, timeout=30) as client:
        job = client.attach_job(args.job, token=args.token, stages=stages)
        trainer = job.trainer(
            prefetch=args.prefetch, shm=False if args.frames else None, world_size=args.world_size
        )
        losses = []
        peak_rss = rss0
        for _ in range(args.steps):
            x, y = models.batch(args.model, trainer.step_index, args.rank)
            losses.append(trainer.step(x, y, models.loss_fn))
            peak_rss = max(peak_rss, psutil.Process().memory_info().rss)
        stats = trainer.stats()
        trainer.close()
    with open(args.out, "w") as f:
        json.dump(
            {
                "losses": losses,
                "rss_before": rss0,
                "peak_rss": peak_rss,
                "peak_resident_stages": stats.peak_resident_stages,
                "ring_bytes": stats.ring_bytes,
                "shm": trainer.shm,
            },
            f,
        )


if __name__ == "__main__":
    main()
