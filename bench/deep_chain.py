"""A residual MLP of up to 10,000 streamed stages: peak worker memory against depth, per plan.

Each (schedule, depth) runs in a fresh worker process against one server. The worker trains one
warm-up step, then measures the peak of its resident memory over the next steps above its resting
memory just before them (``VmHWM`` after resetting it through ``/proc/self/clear_refs``), next to
the trainer's own count of live stage inputs. glibc is told to serve every allocation of 32 KiB
and more with ``mmap`` (``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave the resident set at
once and the measured peak is the live peak, not the allocator's high-water mark.

One stage's footprint = its weights + its input + its autograd tape (what a backward holds).
store_all's peak grows as n; revolve's stays at a few footprints at any depth.

    python bench/deep_chain.py [--depths 100,1000,10000] [--width 128] [--batch 128] [--steps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import torch
from torch import nn

from common import machine, parse_args, server

CASES = [("store_all", None), ("revolve", 8), ("dnc", None)]


class Residual(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        with torch.no_grad():  # small residual branches keep a 10,000-deep chain stable
            self.lin.weight.mul_(1.0 / depth**0.5)
            self.lin.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(address: str, schedule: str, slots: int | None, n: int, width: int, batch: int, steps: int) -> dict:
    from wstream.client import SGD, Client

    torch.manual_seed(0)

    def stages() -> Iterator[nn.Module]:
        for _ in range(n):
            yield Residual(width, n)

    x, y = torch.randn(batch, width), torch.randn(batch, width)
    with Client(address, timeout=600) as client:
        job = client.create_job(f"{schedule}-{n}", stages(), optimizer=SGD(lr=0.05), token="t")
        kw = {"slots": slots} if slots is not None else {}
        with job.trainer(schedule=schedule, **kw) as tr:
            losses = [tr.step(x, y, nn.functional.mse_loss)]  # warm-up: every lazy allocation happens here
            rest = _rss("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current resident set
            t0 = time.perf_counter()
            for _ in range(steps):
                losses.append(tr.step(x, y, nn.functional.mse_loss))
            step_s = (time.perf_counter() - t0) / steps
            peak = _rss("VmHWM") - rest
            summary = tr.plan_summary()
        job.drop()
    return {
        "schedule": schedule + (f"({slots})" if slots else ""),
        "n": n,
        "recomputed": summary["recomputed_forwards"],
        "peak_states": summary["peak_live_states"],
        "trainer_peak_bytes": summary["peak_activation_bytes_measured"],
        "rss_peak_over_rest": peak,
        "rest_rss": rest,
        "step_s": step_s,
        "losses": losses,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--depths", default="100,1000,10000")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--worker", nargs=3, metavar=("ADDRESS", "SCHEDULE", "N"), help=argparse.SUPPRESS)
    p.add_argument("--slots", type=int, default=None, help=argparse.SUPPRESS)
    args = parse_args(p, smoke=dict(depths="10", steps=1, width=16, batch=8))
    if args.worker:
        address, schedule, n = args.worker
        print(json.dumps(worker(address, schedule, args.slots, int(n), args.width, args.batch, args.steps)))
        return

    w, b = args.width, args.batch
    state = b * w * 4
    footprint = (w * w + w) * 4 + state + 3 * state  # weights + input + tape (linear out, tanh out, output)
    print(f"machine: {machine()}")
    print(f"stage: Linear({w}, {w}) + tanh residual, batch {b}: footprint {footprint / 2**10:.0f} KiB "
          f"(weights {(w * w + w) * 4 / 2**10:.0f} KiB, input {state / 2**10:.0f} KiB, tape {3 * state / 2**10:.0f} KiB)")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="32768", MALLOC_TRIM_THRESHOLD_="65536")
    header = f"{'plan':<12} {'n':>7} {'recomputed':>10} {'live inputs':>11} {'trainer MiB':>11} " \
             f"{'RSS peak MiB':>12} {'/ footprint':>11} {'s/step':>7}  loss first -> last"
    print(header)
    with server("--memory-limit", "20GiB", "--lease", "600") as address:
        for n in (int(d) for d in args.depths.split(",")):
            for schedule, slots in CASES:
                cmd = [sys.executable, __file__, "--worker", address, schedule, str(n), "--width", str(w),
                       "--batch", str(b), "--steps", str(args.steps)]
                if slots is not None:
                    cmd += ["--slots", str(slots)]
                out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
                r = json.loads(out.strip().splitlines()[-1])
                print(
                    f"{r['schedule']:<12} {n:>7,} {r['recomputed']:>10,} {r['peak_states']:>11,} "
                    f"{r['trainer_peak_bytes'] / 2**20:>11.2f} {r['rss_peak_over_rest'] / 2**20:>12.2f} "
                    f"{r['rss_peak_over_rest'] / footprint:>11.1f} {r['step_s']:>7.2f}  "
                    f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
