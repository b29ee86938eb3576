"""Several jobs, each with several data-parallel workers, at once on one server.

Every job must end exactly where plain PyTorch training on the mean gradient of its workers ends
(no update lost, doubled or mixed up with another job's), and the server's step counter of each job
must equal the steps trained. The workers report each weight fetch's round trip (p50/p99 under
this load is what ``bench/load.py`` prints; here only that the samples exist is checked).
"""

from __future__ import annotations

import copy
import math
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

import models
from conftest import HERE, ServerProcess, wait_worker
from wstream.client import SGD, AdamW, Client
from wstream.protocol import messages as m

JOBS = 4
WORKERS = 3  # per job
STEPS = 5
MODEL = "mixed"


@dataclass(frozen=True)
class JobCase:
    name: str
    seed: int  # initial weights
    data_offset: int  # the job's workers train on ranks data_offset .. data_offset + WORKERS - 1
    optimizer: m.OptimizerSpec
    torch_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    worker_args: tuple[str, ...]  # data path: zero-copy (default), --copy, --frames


CASES = [
    JobCase("load0", 20, 0, AdamW(lr=2e-3), lambda p: torch.optim.AdamW(p, lr=2e-3), ()),
    JobCase(
        "load1",
        21,
        100,
        AdamW(lr=3e-3, weight_decay=0.05),
        lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.05),
        ("--copy",),
    ),
    JobCase("load2", 22, 200, AdamW(lr=1e-3), lambda p: torch.optim.AdamW(p, lr=1e-3), ("--frames",)),
    JobCase(
        "load3",
        23,
        300,
        SGD(lr=0.05, momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        ("--prefetch", "1"),
    ),
]
assert len(CASES) == JOBS


def reference(case: JobCase, stages: list[nn.Module]) -> tuple[dict[str, torch.Tensor], list[list[float]]]:
    """Plain PyTorch, serially: each step on the mean loss (so the mean gradient) of the job's
    workers' batches. Returns the final weights and, per worker, its loss at every step."""
    ref = nn.Sequential(*stages)
    opt = case.torch_optimizer(ref.parameters())
    losses: list[list[float]] = [[] for _ in range(WORKERS)]
    for step in range(STEPS):
        opt.zero_grad()
        batches = [models.batch(MODEL, step, case.data_offset + r) for r in range(WORKERS)]
        per_rank = [models.loss_fn(ref(x), y) for x, y in batches]
        for r, loss in enumerate(per_rank):
            losses[r].append(loss.item())
        (sum(per_rank) / WORKERS).backward()
        opt.step()
    return ref.state_dict(), losses


def start_workers(
    address: str, case: JobCase, tmp_path: Path, barrier: Path
) -> list[tuple[subprocess.Popen[bytes], Path, Path]]:
    procs = []
    for rank in range(WORKERS):
        out = tmp_path / f"{case.name}-worker{rank}.json"
        log_path = tmp_path / f"{case.name}-worker{rank}.log"
        cmd = [
            sys.executable,
            str(HERE / "worker_main.py"),
            *(address, case.name, f"token-{case.name}", MODEL, str(STEPS), str(rank), str(out)),
            *("--world-size", str(WORKERS), "--data-offset", str(case.data_offset), "--barrier", str(barrier)),
            *case.worker_args,
        ]
        with open(log_path, "wb") as log:
            procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), out, log_path))
    return procs


def open_barrier(barrier: Path, procs: list[tuple[subprocess.Popen[bytes], Path, Path]]) -> None:
    """Wait until every worker has joined its job, then let them all train at once."""
    deadline = time.monotonic() + 240
    while len(list(barrier.glob("ready-*"))) < len(procs):
        for proc, _, log_path in procs:
            assert proc.poll() is None, f"worker exited with {proc.returncode}:\n{log_path.read_text(errors='replace')}"
        assert time.monotonic() < deadline, f"only {len(list(barrier.glob('ready-*')))} of {len(procs)} workers joined"
        time.sleep(0.05)
    (barrier / "go").touch()


@pytest.mark.server_process  # workers in other processes, the server's log
def test_jobs_times_workers_at_once_match_their_serial_references(server: ServerProcess, tmp_path: Path) -> None:
    starts = {case.name: models.mixed(seed=case.seed) for case in CASES}
    wants = {case.name: reference(case, copy.deepcopy(starts[case.name])) for case in CASES}
    with Client(server.address, timeout=30) as client:
        jobs = {  # unit_bytes=None: the server's updates are counted once per chain stage and step
            c.name: client.create_job(c.name, starts[c.name], optimizer=c.optimizer, token=f"token-{c.name}", unit_bytes=None)
            for c in CASES
        }
        barrier = tmp_path / "barrier"
        barrier.mkdir()
        running = {case.name: start_workers(server.address, case, tmp_path, barrier) for case in CASES}
        try:
            open_barrier(barrier, [p for procs in running.values() for p in procs])  # all 12 train at once
            reports = {name: [wait_worker(*p) for p in procs] for name, procs in running.items()}
        finally:  # a failure leaves no worker waiting at the barrier
            for procs in running.values():
                for proc, _, _ in procs:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()
        got = {name: job.state_dict() for name, job in jobs.items()}
        info = {j.name: j for j in client.status().jobs}

    n_stages = len(models.mixed())
    for case in CASES:
        want_weights, want_losses = wants[case.name]
        weights = got[case.name]
        assert weights.keys() == want_weights.keys()
        worst = max((weights[k] - want_weights[k]).abs().max().item() for k in want_weights)
        assert worst <= 2e-6, f"{case.name}: largest difference from the serial reference {worst:.3g}"
        # each worker computed every step on the weights the reference had at that step
        for r, rep in enumerate(reports[case.name]):
            assert rep["losses"] == pytest.approx(want_losses[r], rel=1e-5), f"{case.name} worker {r}"
        # the server counted each step once for every stage: nothing lost, nothing doubled
        assert info[case.name].step == STEPS
        assert info[case.name].updates == STEPS * n_stages
        assert info[case.name].workers == []  # every worker left
    # the weights moved, and differently per job: a mix-up between jobs would show
    names = [c.name for c in CASES]
    for a, b in zip(names, names[1:]):
        assert max((got[a][k] - got[b][k]).abs().max().item() for k in got[a]) > 1e-3

    for name, reps in reports.items():
        for rep in reps:
            assert rep["fetches"] > 0
            samples = rep["fetch_latency_s"]
            assert samples, f"{name}: a worker recorded no fetch round trip"
            assert len(samples) + rep["fetch_latency_skipped"] == rep["fetches"]
            assert all(s > 0 for s in samples)
    assert "Traceback" not in server.log(), server.log()



def test_latency_window_is_bounded_and_gives_nearest_rank_percentiles() -> None:
    from wstream.client.streaming import LatencyWindow

    w = LatencyWindow(capacity=100)
    assert math.isnan(w.quantile(0.5))
    for i in range(1, 251):  # 1..250 ms; the window keeps the last 100: 151..250
        w.record(i / 1000)
    assert w.count == 250
    assert len(w.samples()) == 100
    assert w.quantile(0.5) == 0.200
    assert w.quantile(0.99) == 0.249
    assert w.quantile(1.0) == 0.250
    with pytest.raises(ValueError):
        w.quantile(0.0)
