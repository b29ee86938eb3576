"""Per-stage overhead: deep chains of small stages through wstream vs plain PyTorch (issue 17).

Each chain is ``n`` stages of ``Linear(W, W) + GELU``. Plain PyTorch keeps only stage boundaries
(``torch.utils.checkpoint`` on every stage, so each stage is recomputed once in backward) and steps
``torch.optim.AdamW(fused=True)``; wstream streams every stage from a server subprocess on the same
machine (shared memory) with its default settings and the ``store_all`` plan (the same
recomputation: keep every stage input, recompute each stage once in backward; torch's checkpoint
stops each recomputation early by default, where wstream tapes only stages of 4 Mi elements or
more, so on these chains plain PyTorch recomputes a little less). Both train the same
batches; the sides alternate after a warm-up step each, in blocks of ``--block`` steps (1: step by
step), and each wstream block is timed until its updates are done: with blocks of one step every
step pays its whole update after its backward; with longer blocks a step's updates overlap the
next step's forward, as in a training run (steady state). Printed per chain: the median times per
step, their ratio, and the overhead per stage, ``(wstream - plain) / n``.

Two baselines, both in the alternation: plain PyTorch on the worker's torch threads (the cores the
server leaves it: 1 of 2 here; the same compute as the worker, so the ratio isolates what wstream
adds), and plain PyTorch on every core (what a CPU-only user would run instead: ``vs all cores``;
wstream's worker and server share those cores). ``handoff floor``: plain PyTorch on every core
plus the gradient handoff alone (each stage's gradient copied into a flat slot and its norm taken,
timed inside those steps), over plain PyTorch: what a worker that hands its gradients to the
server's memory pays at least against every core, before any message or update.

    python bench/stage_overhead.py [--chains 100x48,1000x48,10000x48,60x256,30x1024] [--batch 16] [--steps 3] [--block 1]
        [--unit-bytes auto|none|N]   # transfer units (client/units.py): the default, none, or N bytes
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from common import machine, parse_args, server, unit_bytes_arg
from wstream.client import AdamW, Client, Trainer
from wstream.protocol.grad_norm import squared_norm
from wstream.protocol.host import host_cores


def chain(n: int, width: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(n)]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def measure(
    client: Client, n: int, width: int, batch: int, steps: int, cpu_threads: int | None, unit_bytes: str = "auto",
    block: int = 1, grad_slots: int = 2, step_ring: bool | None = None,
) -> tuple[float, float, float]:
    """Median seconds per step of plain PyTorch (on the worker's threads), of wstream and of plain
    PyTorch on every core, on the chain ``n x width``, over blocks of ``block`` steps."""
    stages = chain(n, width)
    ref = nn.Sequential(*copy.deepcopy(stages))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, fused=True)
    data = [(torch.randn(batch, width), torch.randn(batch, width)) for _ in range(steps * block + 1)]

    handoff = GradientHandoff(ref)

    def plain_step(x: torch.Tensor, y: torch.Tensor) -> None:
        h = x
        for stage in ref:
            h = checkpoint(stage, h, use_reentrant=False)
        loss_fn(h, y).backward()
        handoff.after_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    job = client.create_job(
        f"chain-{n}x{width}", stages, optimizer=AdamW(lr=1e-4), token="b", progress=False,
        unit_bytes=unit_bytes_arg(unit_bytes),
    )
    with job.trainer(schedule="store_all", cpu_threads=cpu_threads, grad_slots=grad_slots, step_ring=step_ring) as trainer:
        plain_step(*data[0])
        trainer.step(*data[0], loss_fn)
        trainer.wait_updates()  # the warm-up's updates are not in plain's first timed block
        plain, streamed, everywhere = alternate(plain_step, trainer, data[1:], block, all_cores=True, handoff=handoff)
    job.drop()
    return statistics.median(plain), statistics.median(streamed), statistics.median(everywhere), statistics.median(handoff.seconds)


class GradientHandoff:
    """What any design that hands a step's gradients to another process's memory pays at least: each
    parameter's gradient copied into a flat fp32 slot and its squared norm taken (what a CPU
    worker does per push, ``client/gradient_write.py``). Timed inside plain PyTorch's all-core
    steps, between backward and AdamW (and not counted in their time), while ``armed``."""

    def __init__(self, model: nn.Module) -> None:
        self.stages = [list(stage.parameters()) for stage in model]
        self.slots = [torch.empty(sum(p.numel() for p in params)) for params in self.stages]
        self.armed = False
        self.seconds: list[float] = []

    def after_backward(self) -> None:
        if not self.armed:
            return
        t0 = time.perf_counter()
        for params, slot in zip(self.stages, self.slots):
            at = 0
            for p in params:
                assert p.grad is not None
                slot[at : at + p.numel()].copy_(p.grad.view(-1))
                at += p.numel()
            squared_norm(slot)
        self.seconds.append(time.perf_counter() - t0)


def alternate(
    plain_step: Callable[[torch.Tensor, torch.Tensor], None], trainer: Trainer,
    data: list[tuple[torch.Tensor, torch.Tensor]], block: int = 1, all_cores: bool = False,
    handoff: GradientHandoff | None = None,
) -> tuple[list[float], list[float], list[float]]:
    """Seconds per step of plain PyTorch (this thread's torch threads: the worker's), of wstream
    and (``all_cores``) of plain PyTorch on every core, alternating in blocks of ``block`` batches;
    a wstream block is timed until its updates are done."""
    plain, streamed, everywhere = [], [], []
    worker_threads = torch.get_num_threads()
    if all_cores:  # plain PyTorch's warm-up at its other thread count (the callers warmed up the rest)
        torch.set_num_threads(host_cores())
        plain_step(*data[0])
        torch.set_num_threads(worker_threads)

    def time_plain(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        t0 = time.perf_counter()
        for x, y in batches:
            plain_step(x, y)
        return (time.perf_counter() - t0) / len(batches)

    for start in range(0, len(data), block):
        batches = data[start : start + block]
        plain.append(time_plain(batches))
        if all_cores:
            torch.set_num_threads(host_cores())
            if handoff is not None:
                handoff.armed, timed = True, len(handoff.seconds)
            everywhere.append(time_plain(batches))
            if handoff is not None:  # the handoff's time is its own column, not plain PyTorch's
                handoff.armed = False
                handoff.seconds[timed:] = [sum(handoff.seconds[timed:]) / len(batches)]
                everywhere[-1] -= handoff.seconds[-1]
            torch.set_num_threads(worker_threads)
        t0 = time.perf_counter()
        for x, y in batches:
            trainer.step(x, y, loss_fn)
        trainer.wait_updates()  # every update of the block applied (await_step: no weights move)
        streamed.append((time.perf_counter() - t0) / len(batches))
    return plain, streamed, everywhere


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--chains", default="100x48,1000x48,10000x48,60x256,30x1024", help="N x WIDTH, comma-separated")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=3, help="timed blocks of each side (after one warm-up step)")
    p.add_argument("--block", type=int, default=1, help="steps per timed block (1: each step waits for its updates)")
    p.add_argument("--grad-slots", type=int, default=2, help="the worker's gradient ring (Transport.grad_slots)")
    p.add_argument(
        "--step-ring", choices=["auto", "on", "off"], default="auto",
        help="Transport.step_ring: auto (the default: a CPU worker asks), on, off (a ring of --grad-slots)",
    )
    p.add_argument("--server-arg", action="append", default=[], help="an extra wstream-server argument (repeat)")
    p.add_argument("--cpu-threads", type=int, default=None, help="the worker's torch threads (default: the cores the server leaves)")
    p.add_argument(
        "--unit-bytes", default="auto",
        help="create_job(unit_bytes=): 'auto' (the default, 1 MiB units), 'none' (a server stage per stage), or bytes",
    )
    args = parse_args(p, smoke=dict(chains="4x16", steps=1))
    chains = [tuple(int(v) for v in c.split("x")) for c in args.chains.split(",")]
    print(f"machine: {machine()}")
    print(
        f"wstream-server arguments: {args.server_arg or 'defaults'}; worker threads: "
        f"{args.cpu_threads or 'the cores the server leaves'}; batch {args.batch}; {args.steps} timed blocks of {args.block} step(s); "
        f"unit_bytes {args.unit_bytes}"
    )
    print(
        f"{'chain':>12} {'plain ms/step':>14} {'wstream ms/step':>16} {'ratio':>7} {'overhead/stage':>15} "
        f"{f'plain, {host_cores()} cores':>16} {'vs all cores':>13} {'handoff floor':>14}"
    )
    with server("--memory-limit", "16GiB", *args.server_arg) as address, Client(address, timeout=120) as client:
        for n, width in chains:
            t_plain, t_ws, t_all, t_handoff = measure(client, n, width, args.batch, args.steps, args.cpu_threads, args.unit_bytes, args.block, args.grad_slots,
                {"auto": None, "on": True, "off": False}[args.step_ring],
            )
            per_stage_us = (t_ws - t_plain) / n * 1e6
            print(
                f"{f'{n}x{width}':>12} {t_plain * 1e3:14.1f} {t_ws * 1e3:16.1f} {t_ws / t_plain:7.2f} "
                f"{per_stage_us:12.0f} us {t_all * 1e3:16.1f} {t_ws / t_all:13.2f} {(t_all + t_handoff) / t_all:14.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
