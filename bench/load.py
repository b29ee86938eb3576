"""N jobs x M data-parallel workers at once on one server: correctness and fetch latency under load.

    python bench/load.py [--jobs 4] [--workers 3] [--steps 30] [--stages 8] [--width 256] [--batch 32]

One ``wstream-server``; every worker is its own process (one torch thread). Phases, in this order,
on the same server:

1. baseline: one job with one worker, alone (the unloaded fetch latency);
2. load: N jobs x M workers; all N*M join first, then start together (a file barrier), so every
   job trains while all the others do;
3. baseline again (the machine may be shared: two baselines show its drift).

Each job starts from its own seed and trains on its own data; afterwards its weights are compared
with plain PyTorch trained serially on the mean gradient of its M workers' batches (max abs
difference <= --atol), and the server's step counter of the job must equal --steps.
Fetch latency = one ``fetch`` request's round trip as the worker's prefetch thread sees it
(request sent -> weights reply received; fetches during which compute held the whole weight ring
are left out, see ``StreamStats.fetch_latency``). p50/p99 are nearest-rank over all samples of
the phase's workers. Aggregate steps/s = N * steps / (last worker's finish - start signal) (job
steps: one is M workers' forward+backward and one update); w-steps/s counts each worker's step.
"wait ms/st": time compute waited for weights, per worker step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from common import machine, parse_args
from wstream.client import AdamW, Client, wait_for_server

LR = 1e-3


def stages(n: int, width: int, seed: int) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n)]


def batch(job_seed: int, step: int, rank: int, size: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(job_seed * 1_000_003 + step * 1009 + rank)
    return torch.randn(size, width, generator=g), torch.randn(size, width, generator=g)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def quantile(samples: list[float], q: float) -> float:
    """Nearest-rank quantile (as ``LatencyWindow.quantile``)."""
    data = sorted(samples)
    return data[max(0, math.ceil(q * len(data)) - 1)] if data else math.nan


# ---- worker process -------------------------------------------------------------------------------
def worker(spec: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    with torch.device("meta"):
        skeleton = stages(spec["stages"], spec["width"], 0)
    barrier = Path(spec["barrier"])
    with Client(spec["address"], timeout=60) as client:
        job = client.attach_job(spec["job"], token="load", stages=skeleton)
        with job.trainer(world_size=spec["world"], prefetch=spec["prefetch"]) as tr:
            (barrier / f"ready-{spec['job']}-{spec['rank']}").touch()
            while not (barrier / "go").exists():
                time.sleep(0.01)
            ends = []
            for s in range(spec["steps"]):
                tr.step(*batch(spec["seed"], s, spec["rank"], spec["batch"], spec["width"]), loss_fn)
                ends.append(time.time())
            fetch = tr.stats()
            result = {
                "ends": ends,
                "fetches": tr.stats().fetches,
                "fetch_wait_s": tr.stats().fetch_wait_s,
                "latency_s": fetch.fetch_latency.samples(),
                "skipped": fetch.fetch_latency_skipped,
            }
    Path(spec["out"]).write_text(json.dumps(result))


# ---- driver -----------------------------------------------------------------------------------------
@contextlib.contextmanager
def server(log_path: Path, *extra: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    address = f"ipc://{log_path.parent}/load.sock"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "wstream.server", "--bind", address, *extra], stdout=log, stderr=subprocess.STDOUT
        )
    try:
        wait_for_server(address, timeout=60, alive=lambda: proc.poll() is None)
        yield address, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def reference(n: int, width: int, seed: int, steps: int, ranks: int, size: int) -> dict[str, torch.Tensor]:
    ref = nn.Sequential(*stages(n, width, seed))
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for s in range(steps):
        opt.zero_grad()
        losses = [loss_fn(ref(x), y) for x, y in (batch(seed, s, r, size, width) for r in range(ranks))]
        (sum(losses) / ranks).backward()
        opt.step()
    return ref.state_dict()  # "<stage>.<param>" keys, as job.state_dict()


def run_phase(
    client: Client, address: str, tmp: Path, phase: str, n_jobs: int, m: int, args: argparse.Namespace, seed0: int
) -> dict[str, Any]:
    """Create ``n_jobs`` jobs, run ``m`` workers each at once, check every job; return the figures."""
    barrier = tmp / phase
    barrier.mkdir()
    names = [f"{phase}{j}" for j in range(n_jobs)]
    seeds = [seed0 + j for j in range(n_jobs)]
    jobs = [
        client.create_job(name, stages(args.stages, args.width, seed), optimizer=AdamW(lr=LR), token="load")
        for name, seed in zip(names, seeds)
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs: list[tuple[subprocess.Popen[bytes], dict[str, Any]]] = []
    for name, seed in zip(names, seeds):
        for rank in range(m):
            spec = {
                "address": address, "job": name, "rank": rank, "world": m, "seed": seed, "stages": args.stages,
                "width": args.width, "batch": args.batch, "steps": args.steps, "prefetch": args.prefetch,
                "barrier": str(barrier), "out": str(barrier / f"{name}-{rank}.json"),
            }  # fmt: skip
            with open(Path(spec["out"]).with_suffix(".log"), "wb") as log:  # the child keeps its own handle
                cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
                procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), spec))

    def failed(proc: subprocess.Popen[bytes], spec: dict[str, Any]) -> SystemExit:
        log = Path(spec["out"]).with_suffix(".log").read_text(errors="replace")
        return SystemExit(f"worker {spec['job']}/{spec['rank']} exited with {proc.returncode}:\n{log}")

    try:
        while len(list(barrier.glob("ready-*"))) < n_jobs * m:
            for proc, spec in procs:
                if proc.poll() is not None:
                    raise failed(proc, spec)
            time.sleep(0.05)
        go = time.time()
        (barrier / "go").touch()
        for proc, spec in procs:
            if proc.wait(timeout=3600) != 0:
                raise failed(proc, spec)
    finally:  # a failure leaves no worker waiting at the barrier
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    reports = [json.loads(Path(spec["out"]).read_text()) for _, spec in procs]
    end = max(r["ends"][-1] for r in reports)
    info = {j.name: j for j in client.status().jobs}
    worst, steps_ok = 0.0, True
    for job, name, seed in zip(jobs, names, seeds):
        got = job.state_dict()
        want = reference(args.stages, args.width, seed, args.steps, m, args.batch)
        assert got.keys() == want.keys(), (sorted(got)[:4], sorted(want)[:4])
        worst = max(worst, max((got[k] - want[k]).abs().max().item() for k in want))
        server_stages = info[name].stages if info[name].units is None else info[name].units  # updates count units
        steps_ok &= info[name].step == args.steps and info[name].updates == args.steps * server_stages
        job.drop()
    latency = [s for r in reports for s in r["latency_s"]]
    return {
        "jobs": n_jobs,
        "workers": m,
        "steps_per_s": n_jobs * args.steps / (end - go),
        "worker_steps_per_s": n_jobs * m * args.steps / (end - go),
        "wall_s": end - go,
        "latency": latency,
        "skipped": sum(r["skipped"] for r in reports),
        "fetches": sum(r["fetches"] for r in reports),
        "fetch_wait_per_step_ms": 1e3 * sum(r["fetch_wait_s"] for r in reports) / (len(reports) * args.steps),
        "worst": worst,
        "match": worst <= args.atol,
        "steps_ok": steps_ok,
    }


def describe(label: str, r: dict[str, Any]) -> str:
    lat = r["latency"]
    return (
        f"{label:<10} {r['jobs']:>2} x {r['workers']:<2} {r['steps_per_s']:>9.2f} {r['worker_steps_per_s']:>10.2f} "
        f"{1e3 * quantile(lat, 0.5):>8.3f} {1e3 * quantile(lat, 0.99):>8.3f} {len(lat):>7}/{r['fetches']:<7} "
        f"{r['fetch_wait_per_step_ms']:>9.2f}  {'yes' if r['match'] else 'NO'} ({r['worst']:.1e})  "
        f"{'yes' if r['steps_ok'] else 'NO'}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=4, help="N: jobs at once")
    p.add_argument("--workers", type=int, default=3, help="M: data-parallel workers per job")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--stages", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument(
        "--atol",
        type=float,
        default=1e-4,
        help="largest weight difference from the reference (rounding alone reaches ~1e-5 over 30 AdamW steps on "
        "some seeds; one update lost or doubled moves the largest by 4e-3 to 7e-3)",
    )
    p.add_argument("--server-arg", action="append", default=[], help="passed to wstream-server (repeatable)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = parse_args(p, smoke=dict(jobs=1, workers=1, steps=2, stages=2, width=16, batch=4))
    if args.worker:
        worker(json.loads(args.worker))
        return

    print(f"machine: {machine()}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    params = args.stages * (args.width * args.width + args.width)
    print(
        f"N={args.jobs} jobs x M={args.workers} workers ({args.jobs * args.workers} worker processes), "
        f"{args.steps} steps; model {args.stages} stages x Linear({args.width}) ({params / 1e6:.2f} M params), "
        f"batch {args.batch}, prefetch {args.prefetch}, AdamW; server args: {args.server_arg or 'defaults'}"
    )
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        log_path = tmp / "server.log"
        with server(log_path, *args.server_arg) as (address, _), Client(address, timeout=60) as client:
            base1 = run_phase(client, address, tmp, "base-before", 1, 1, args, 1)
            load = run_phase(client, address, tmp, "load", args.jobs, args.workers, args, 100)
            base2 = run_phase(client, address, tmp, "base-after", 1, 1, args, 2)
        log = log_path.read_text(errors="replace")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'phase':<10} {'N x M':<7} {'steps/s':>9} {'w-steps/s':>10} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'samples/fetches':>15} {'wait ms/st':>9}  matches ref (max diff)  step counts")  # fmt: skip
    print(describe("unloaded", base1))
    print(describe("loaded", load))
    print(describe("unloaded", base2))
    base_lat = base1["latency"] + base2["latency"]
    lat = load["latency"]
    p50, p99 = quantile(lat, 0.5), quantile(lat, 0.99)
    b50, b99 = quantile(base_lat, 0.5), quantile(base_lat, 0.99)
    print(
        "fetch latency loaded/unloaded (both baselines pooled): "
        f"p50 {1e3 * p50:.3f}/{1e3 * b50:.3f} ms = {p50 / b50:.1f}x, "
        f"p99 {1e3 * p99:.3f}/{1e3 * b99:.3f} ms = {p99 / b99:.1f}x"
    )
    ok = all(r["match"] and r["steps_ok"] for r in (base1, load, base2))
    print(f"every job matched its serial reference and counted {args.steps} steps: {'yes' if ok else 'NO'}")
    bad = [line for line in log.splitlines() if " WARNING " in line or " ERROR " in line or "Traceback" in line]
    print(f"server log: {len(bad)} warning/error line(s)" + "".join(f"\n  {line}" for line in bad[:20]))
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
