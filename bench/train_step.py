"""(3) A training step through wstream vs plain PyTorch doing the same recomputation.

Both train the same chain of MLP blocks (each stage >= 20 ms of forward compute here) on the
same batches. Plain PyTorch keeps only stage boundaries with `torch.utils.checkpoint` on every
stage (so it recomputes each stage once in backward, like wstream's store_all schedule) and steps
`torch.optim.AdamW(fused=True)`. wstream streams every stage from a server process (shared
memory), with the optimizer running there, stage by stage, during backward.

The recomputation is the same on both sides: by default both stop it early, before each stage's
last operation (the block's down-projection), torch's checkpoint by its default and wstream by
its taped forwards (``Checkpointing.early_stop``, on by default for stages this large);
``--early-stop off`` turns it off on both (each stage recomputed whole).
The sides alternate in blocks of a few steps (plain, wstream, plain, ...), each block timed until
its work is done (wstream's updates included), and the medians of the blocks' step times are
compared, so drift of a shared machine hits all alike. Ratio = wstream / plain median step time (target <= 1.15). Each mode of the optimizer (``--modes``:
commit, the default, and delayed) trains a job of its own, alternated with the others.

Plain PyTorch runs on the worker's torch threads (the cores the server leaves it) for the ratio,
and once more on every core in each block: ``vs all cores`` is what a CPU-only user would compare
with (wstream's worker and server share those cores).

    python bench/train_step.py [--stages 8] [--width 1024] [--batch 256] [--steps 12] [--block 3] [--modes commit,delayed]
        [--early-stop on|off]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from contextlib import ExitStack

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from common import machine, parse_args, server
from wstream.client import AdamW, Client
from wstream.protocol.host import host_cores


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--block", type=int, default=3, help="steps each side runs before the next side's turn")
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--server-threads", type=int, default=None, help="torch threads of the server's optimizer")
    p.add_argument(
        "--modes", default="commit,delayed",
        help="where the updates run, each a job of its own, alternated with plain PyTorch: commit (default: "
        "after the step's commit point, overlapping the next forward), delayed (during the whole next step)",
    )
    p.add_argument("--early-stop", choices=["on", "off"], default="on", help="stop recomputations early, on both sides")
    args = parse_args(p, smoke=dict(stages=2, width=64, batch=8, steps=1, block=1))
    early_stop = args.early_stop == "on"
    modes = args.modes.split(",")
    if not modes or not set(modes) <= {"commit", "delayed"}:
        raise SystemExit(f"--modes takes commit and/or delayed, got {args.modes!r}")
    print(f"machine: {machine()}")
    torch.manual_seed(0)
    stages = [Block(args.width) for _ in range(args.stages)]
    params = sum(q.numel() for s in stages for q in s.parameters())
    ref = nn.Sequential(*copy.deepcopy(stages))
    data = [(torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)) for _ in range(args.steps + 1)]
    with torch.no_grad():
        x = data[0][0]
        t0 = time.perf_counter()
        for _ in range(3):
            ref[0](x)
        per_stage_ms = (time.perf_counter() - t0) / 3 * 1e3
    print(
        f"{args.stages} stages x {params // args.stages:,} params (width {args.width}), batch {args.batch}: "
        f"forward of one stage {per_stage_ms:.1f} ms"
    )

    opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, fused=True)

    def plain_step(x: torch.Tensor, y: torch.Tensor) -> float:
        h = x
        for stage in ref:
            h = checkpoint(stage, h, use_reentrant=False, early_stop=early_stop)
        loss = loss_fn(h, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    # Sides run in blocks of --block steps, alternated (plain, commit, delayed, plain, ...). A
    # block ends when its work is done: wstream's updates run after step() returns (overlapping the
    # next step), so each wstream block ends by waiting for its server to finish them
    # (wait_updates), rather than letting them run into the next side's time.
    plain_times: list[float] = []
    all_core_times: list[float] = []
    ws_times: dict[str, list[float]] = {mode: [] for mode in modes}
    extra = ("--torch-threads", str(args.server_threads)) if args.server_threads else ()
    with server("--memory-limit", "16GiB", *extra) as address, Client(address) as client, ExitStack() as trainers:
        by_mode = {}
        for mode in modes:
            job = client.create_job(
                f"step-{mode}", copy.deepcopy(stages), optimizer=AdamW(lr=1e-4), token="b", delayed_update=mode == "delayed"
            )
            trainer = job.trainer(prefetch=args.prefetch, early_stop=early_stop)
            by_mode[mode] = (job, trainers.enter_context(trainer))
        worker_threads = torch.get_num_threads()
        plain_step(*data[0])  # warm-up every side, plain PyTorch at both of its thread counts
        torch.set_num_threads(host_cores())
        plain_step(*data[0])
        torch.set_num_threads(worker_threads)
        for _, trainer in by_mode.values():
            trainer.step(*data[0], loss_fn)
            trainer.wait_updates()
        batches = data[1:]
        for start in range(0, len(batches), args.block):
            block = batches[start : start + args.block]
            for threads, times in ((worker_threads, plain_times), (host_cores(), all_core_times)):
                torch.set_num_threads(threads)
                t0 = time.perf_counter()
                for x, y in block:
                    plain_step(x, y)
                times.append((time.perf_counter() - t0) / len(block))
            torch.set_num_threads(worker_threads)
            for mode, (_, trainer) in by_mode.items():
                t0 = time.perf_counter()
                for x, y in block:
                    trainer.step(x, y, loss_fn)
                trainer.wait_updates()
                ws_times[mode].append((time.perf_counter() - t0) / len(block))
        stats = {mode: trainer.stats() for mode, (_, trainer) in by_mode.items()}
    t_plain, t_all = statistics.median(plain_times), statistics.median(all_core_times)
    print(f"early stop of recomputations: {args.early_stop} (both sides)")
    print(f"plain PyTorch (checkpoint per stage + fused AdamW): {t_plain * 1e3:7.1f} ms/step on {worker_threads} thread(s) "
          f"(the worker's), {t_all * 1e3:7.1f} ms/step on {host_cores()} (every core)")
    for mode in modes:
        t_ws, st = statistics.median(ws_times[mode]), stats[mode]
        print(f"wstream, {mode:7} (streamed weights, server-side AdamW): {t_ws * 1e3:7.1f} ms/step   ratio {t_ws / t_plain:.2f}"
              f"   vs all cores {t_ws / t_all:.2f}")
        print(
            f"  worker waited {st.fetch_wait_s / st.steps * 1e3:.1f} ms/step for weights, "
            f"{st.push_wait_s / st.steps * 1e3:.1f} ms/step for gradient slots and the step's commit"
        )


if __name__ == "__main__":
    main()
