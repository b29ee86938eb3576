"""A very long chain of tiny stages under a checkpoint plan: wstream vs plain PyTorch running the
same plan (issue 17: 250,000 stages, per-stage overhead <= 20 us).

The chain is ``n`` stages of ``Linear(W, W) + GELU``. Both sides run the same checkpoint plan
(``revolve`` with ``--slots`` kept inputs by default, or ``dnc``/``sqrt``): plain PyTorch through
:func:`run_plan_plainly` (the plan's actions on ordinary modules, ``.grad`` accumulated by autograd,
then ``torch.optim.AdamW(fused=True)``), wstream through a trainer with the same schedule and
default job settings against a server subprocess on the same machine. Both train the same batches;
after a warm-up step each, the sides alternate step by step, each wstream step timed until its
updates are done. Printed per chain: the plan's recomputation, the median step times, their ratio
and the overhead per stage, ``(wstream - plain) / n``, the process's resident memory (both sides:
the plain side's model, gradients and AdamW state included) and the trainer's peak of live stage
inputs (the plan's activation memory, bounded by its slots whatever ``n``); the means of both
sides' timed steps and Python's full collections during them (:class:`FullCollections`).

    python bench/long_chain.py [--chains 10000x16,250000x16] [--schedule revolve] [--slots 2000]
        [--batch 16] [--steps 1] [--unit-bytes auto|none|N]
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time
from collections.abc import Callable, Sequence

import psutil
import torch
from torch import nn

from common import machine, parse_args, server, unit_bytes_arg
from stage_overhead import alternate, chain, loss_fn
from wstream.client import AdamW, Client
from wstream.client.plans import Op, Plan, divide_and_conquer, revolve, sqrt_segments


def run_plan_plainly(
    plan: Plan, stages: Sequence[nn.Module], x: torch.Tensor, y: torch.Tensor, loss: Callable[..., torch.Tensor]
) -> float:
    """One step's forward and backward of ``stages`` by ``plan``'s actions, in plain PyTorch:
    ADVANCE runs a stage without autograd, BACKWARD reruns it with autograd from its kept input
    and backpropagates into the stage's ``.grad`` and the input's gradient. Returns the loss."""
    kept: dict[int, torch.Tensor] = {}
    current: torch.Tensor | None = x
    grad: torch.Tensor | None = None
    value = float("nan")
    last = plan.n - 1
    for op, i in plan.actions:
        if op == Op.ADVANCE:
            with torch.no_grad():
                current = stages[i](current)
        elif op == Op.SNAPSHOT:
            assert current is not None
            kept[i] = current
        elif op == Op.RESTORE:
            current = kept[i]
        elif op == Op.FREE:
            del kept[i]
        elif op == Op.BACKWARD:
            assert current is not None
            inp = current.detach().requires_grad_(i > 0)
            out = stages[i](inp)
            if i == last:
                lv = loss(out, y)
                value = float(lv.detach())
                lv.backward()
            else:
                out.backward(grad)
            grad, current = inp.grad, None
        else:
            raise ValueError(f"{op.name}: not in the plans this bench runs")
    return value


class FullCollections:
    """Counts Python's full (generation 2) collections and their seconds while it is entered: at
    this depth one costs seconds and falls in whichever side's step it falls (the process holds
    both sides' modules), so the medians may leave it out and the means count it."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._started

    def __enter__(self) -> FullCollections:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def make_plan(schedule: str, n: int, slots: int) -> Plan:
    if schedule == "revolve":
        return revolve(n, slots)
    if schedule == "dnc":
        return divide_and_conquer(n)
    if schedule == "sqrt":
        return sqrt_segments(n)
    raise ValueError(f"unknown schedule {schedule!r}")


def measure(client: Client, n: int, width: int, args: argparse.Namespace) -> dict[str, float]:
    stages = chain(n, width)
    plain_stages = copy.deepcopy(stages)
    opt = torch.optim.AdamW([p for s in plain_stages for p in s.parameters()], lr=1e-4, fused=True)
    data = [(torch.randn(args.batch, width), torch.randn(args.batch, width)) for _ in range(args.steps + 1)]
    t0 = time.perf_counter()
    plan = make_plan(args.schedule, n, args.slots)
    plan_s = time.perf_counter() - t0

    def plain_step(x: torch.Tensor, y: torch.Tensor) -> None:
        run_plan_plainly(plan, plain_stages, x, y, loss_fn)
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    job = client.create_job(
        f"long-{n}x{width}", stages, optimizer=AdamW(lr=1e-4), token="b", progress=False,
        unit_bytes=unit_bytes_arg(args.unit_bytes),
    )
    create_s = time.perf_counter() - t0
    del stages
    gc.collect()
    options = {"slots": args.slots} if args.schedule == "revolve" else {}
    with job.trainer(schedule=args.schedule, **options) as trainer:
        plain_step(*data[0])
        t0 = time.perf_counter()
        trainer.step(*data[0], loss_fn)
        first_s = time.perf_counter() - t0
        summary = trainer.plan_summary()
        assert summary["recomputed_forwards"] == plan.advances, (summary, plan.advances)
        with FullCollections() as full:
            plain, streamed, _ = alternate(plain_step, trainer, data[1:])
        stats = trainer.stats()
    job.drop()
    return {
        "plain": statistics.median(plain),
        "wstream": statistics.median(streamed),
        "plain_mean": statistics.fmean(plain),
        "wstream_mean": statistics.fmean(streamed),
        "full_gcs": full.count,
        "full_gc_s": full.seconds,
        "advances": plan.advances,
        "plan_s": plan_s,
        "create_s": create_s,
        "first_s": first_s,
        "rss_gib": psutil.Process().memory_info().rss / 2**30,
        "inputs_mib": stats.peak_boundary_bytes / 2**20,
        "units": stats.ring_capacity,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--chains", default="10000x16,250000x16", help="N x WIDTH, comma-separated")
    p.add_argument("--schedule", default="revolve", choices=["revolve", "dnc", "sqrt"])
    p.add_argument("--slots", type=int, default=2000, help="revolve's kept inputs")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=1, help="timed steps of each side (after one warm-up step)")
    p.add_argument("--unit-bytes", default="auto", help="create_job(unit_bytes=): 'auto' (the default), 'none', or bytes")
    args = parse_args(p, smoke=dict(chains="40x8", slots=4))
    chains = [tuple(int(v) for v in c.split("x")) for c in args.chains.split(",")]
    print(f"machine: {machine()}")
    print(f"schedule {args.schedule}" + (f" with {args.slots} slots" if args.schedule == "revolve" else "")
          + f"; batch {args.batch}; {args.steps} timed steps; default job settings")
    print(f"{'chain':>12} {'recomputed':>11} {'plain s/step':>13} {'wstream s/step':>15} {'ratio':>6} "
          f"{'overhead/stage':>15} {'plan s':>7} {'create s':>9} {'1st step s':>10} {'RSS GiB':>8} {'inputs MiB':>10} "
          f"{'means plain/wstream s':>22} {'full GCs (s)':>13}")
    with server("--memory-limit", "16GiB") as address, Client(address, timeout=600) as client:
        for n, width in chains:
            r = measure(client, n, width, args)
            per_stage_us = (r["wstream"] - r["plain"]) / n * 1e6
            print(
                f"{f'{n}x{width}':>12} {r['advances']:>11,} {r['plain']:13.2f} {r['wstream']:15.2f} "
                f"{r['wstream'] / r['plain']:6.2f} {per_stage_us:12.1f} us {r['plan_s']:7.1f} {r['create_s']:9.1f} "
                f"{r['first_s']:10.1f} {r['rss_gib']:8.1f} {r['inputs_mib']:10.2f} "
                f"{r['plain_mean']:>11.2f}/{r['wstream_mean']:<10.2f} {r['full_gcs']:>5} ({r['full_gc_s']:.1f})",
                flush=True,
            )


if __name__ == "__main__":
    main()
