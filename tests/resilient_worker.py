"""A worker that rides out server restarts and detaches: ``Trainer.fit`` over deterministic data.

Usage: python resilient_worker.py ADDRESS JOB TOKEN MODEL STEPS RANK OUT.json [--world-size W]
       [--same-data]   (every rank trains on rank 0's batches: the mean over any subset of
                        workers is then the single-worker gradient)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

import models  # noqa: E402

from wstream.client import Client  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("address", "job", "token", "model"):
        p.add_argument(name)
    p.add_argument("steps", type=int)
    p.add_argument("rank", type=int)
    p.add_argument("out")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--same-data", action="store_true")
    p.add_argument("--pace", type=float, default=0.0, help="seconds to spend on each step at least")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s worker %(process)d %(levelname)s %(message)s")
    with torch.device("meta"):
        stages = models.BUILDERS[args.model]()
    data_rank = 0 if args.same_data else args.rank
    with Client(args.address, timeout=5) as client:
        job = client.attach_job(args.job, token=args.token, stages=stages)
        with job.trainer(world_size=args.world_size, reconnect_s=120) as trainer:
            def batch_of(t: int) -> tuple[torch.Tensor, torch.Tensor]:
                if args.pace:  # a slower job, so that a test's faults land while it still runs
                    time.sleep(args.pace)
                return models.batch(args.model, t, data_rank)

            losses = trainer.fit(batch_of, models.loss_fn, steps=args.steps)
            report = {"losses": {str(k): v for k, v in losses.items()}, "reconnects": trainer.reconnects,
                      "step": trainer.step_index}
    with open(args.out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
