"""Stage-major micro-batches and the delayed update: weight traffic and step time against k.

A chain of MLP blocks is trained with k micro-batches of a fixed size per step, k = 1, 2, 4, ...
Three runs alternate in blocks of ``--block`` steps in this process (so drift of a shared machine
hits all alike); a wstream block is timed until its server has applied every update of it
(``wait_updates``), so no side's optimizer work runs in another side's timed window:

* plain PyTorch: ordinary gradient accumulation (micro-batch after micro-batch through the whole
  model, `torch.utils.checkpoint` on every stage, so the same recomputation as wstream's
  store_all plan) with resident weights and `torch.optim.AdamW(fused=True)`;
* wstream, stage-major (`trainer.step(..., micro_batches=k)`), weights copied out of shared
  memory into the ring for every use (`zero_copy=False`: the copy a GPU worker makes host->device);
* the same with `delayed_update=True` (the optimizer of step t overlaps step t + 1).

Printed per k: weight bytes the worker copied per step (measured) next to what micro-batch-major
streaming would copy (k times the k = 1 traffic), and the median step times with their ratios.

    python bench/micro_batches.py [--stages 8] [--width 1024] [--micro-batch 16] [--ks 1,2,4,8,16] [--steps 6] [--block 3]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from common import machine, parse_args, server
from train_step import Block, loss_fn
from wstream.client import AdamW, Client


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--ks", default="1,2,4,8,16")
    p.add_argument("--steps", type=int, default=6, help="timed steps of each run (after one warm-up step)")
    p.add_argument("--block", type=int, default=3, help="steps each run takes before the next run's turn")
    args = parse_args(p, smoke=dict(stages=2, width=32, micro_batch=2, ks="1,2", steps=2, block=2))
    ks = [int(k) for k in args.ks.split(",")]
    print(f"machine: {machine()}")
    torch.manual_seed(0)
    stages = [Block(args.width) for _ in range(args.stages)]
    params = sum(q.numel() for s in stages for q in s.parameters())
    print(
        f"{args.stages} stages, {params / 1e6:.1f} M parameters ({params * 4 / 2**20:.0f} MiB fp32), "
        f"micro-batch {args.micro_batch} rows of width {args.width}"
    )
    ref = nn.Sequential(*copy.deepcopy(stages))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, fused=True)

    def plain_step(x: torch.Tensor, y: torch.Tensor, k: int) -> None:
        for xj, yj in zip(torch.tensor_split(x, k), torch.tensor_split(y, k)):
            h = xj
            for stage in ref:
                h = checkpoint(stage, h, use_reentrant=False)
            (loss_fn(h, yj) / k).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    rows = []
    with server("--memory-limit", "16GiB") as address, Client(address) as client:
        sync = client.create_job("sync", copy.deepcopy(stages), optimizer=AdamW(lr=1e-4), token="b")
        dpu = client.create_job("dpu", copy.deepcopy(stages), optimizer=AdamW(lr=1e-4), token="b", delayed_update=True)
        with sync.trainer(zero_copy=False) as t_sync, dpu.trainer(zero_copy=False) as t_dpu:
            for k in ks:
                batch = k * args.micro_batch
                data = [(torch.randn(batch, args.width), torch.randn(batch, args.width)) for _ in range(args.steps + 1)]
                runs = {
                    "plain": lambda x, y: plain_step(x, y, k),
                    "sync": lambda x, y: t_sync.step(x, y, loss_fn, micro_batches=k),
                    "dpu": lambda x, y: t_dpu.step(x, y, loss_fn, micro_batches=k),
                }
                ends = {"plain": lambda: None, "sync": t_sync.wait_updates, "dpu": t_dpu.wait_updates}
                times: dict[str, list[float]] = {name: [] for name in runs}
                for name, run in runs.items():  # warm-up
                    run(*data[0])
                    ends[name]()
                before = t_sync.stats()
                for start in range(1, len(data), args.block):
                    block = data[start : start + args.block]
                    for name, run in runs.items():
                        t0 = time.perf_counter()
                        for x, y in block:
                            run(x, y)
                        ends[name]()  # the block's updates are part of its time
                        times[name].append((time.perf_counter() - t0) / len(block))
                after = t_sync.stats()
                fetched = (after.bytes_fetched - before.bytes_fetched) / (after.steps - before.steps)
                med = {name: statistics.median(v) for name, v in times.items()}
                rows.append((k, batch, fetched, med))
                print(
                    f"k={k:3d} ({batch:4d} rows): fetched {fetched / 2**20:7.1f} MiB/step "
                    f"(micro-batch-major: {k * rows[0][2] / 2**20:7.1f}); "
                    f"plain {med['plain'] * 1e3:7.1f} ms, wstream {med['sync'] * 1e3:7.1f} ms "
                    f"({med['sync'] / med['plain']:.2f}x), delayed {med['dpu'] * 1e3:7.1f} ms "
                    f"({med['dpu'] / med['plain']:.2f}x)",
                    flush=True,
                )
    print("\n| k | rows/step | weights copied per step | micro-batch-major would copy | plain GA ms | wstream ms | ratio | delayed ms | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for k, batch, fetched, med in rows:
        print(
            f"| {k} | {batch} | {fetched / 2**20:.0f} MiB | {k * rows[0][2] / 2**20:.0f} MiB | {med['plain'] * 1e3:.0f} | "
            f"{med['sync'] * 1e3:.0f} | {med['sync'] / med['plain']:.2f} | {med['dpu'] * 1e3:.0f} | "
            f"{med['dpu'] / med['plain']:.2f} |"
        )


if __name__ == "__main__":
    main()
