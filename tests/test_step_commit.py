"""A step is all-or-nothing: a worker that dies or stalls at any point of a step leaves every stage
at the same step, and the job ends with exactly the weights of a crash-free run.

Each fault point gets its own job, created from the same initial weights; a victim process trains
it and signals itself at that point (``tests/fault_worker.py``): SIGKILL (a replacement process
finishes the job) or SIGSTOP past its lease (it is detached, then continued: it re-attaches and
finishes the job itself). A crash-free job trained by the same code is the reference, compared
bit for bit.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import models
from conftest import HERE, ServerProcess, start_server, wait_worker
from wstream.client import AdamW, Client
from wstream.client.plans.schedules import store_all
from wstream.client.units import AUTO_UNIT_BYTES

pytestmark = pytest.mark.server_process

STEPS = 3
TOKEN = "t"
OPTIMIZER = AdamW(lr=1e-2, weight_decay=0.05)
ACTIONS = store_all(len(models.mixed())).actions
COMPUTE = [k for k, (op, _) in enumerate(ACTIONS) if op.name in ("ADVANCE", "BACKWARD")]

# (signal, step, point): every forward and backward action of a middle step, the gaps between
# some of them, each stage's push once sent, the step's commit once sent, and the first and last steps
KILL_POINTS = (
    [("KILL", 1, f"action:{k}") for k in [*COMPUTE, 9, 13]]
    + [("KILL", 1, f"push:{k}") for k in range(5)]
    + [("KILL", 1, "commit:0"), ("KILL", 0, "action:8"), ("KILL", 0, "push:4"), ("KILL", 2, "push:2")]
)
STOP_POINTS = [("STOP", 1, p) for p in ("action:3", "action:11", "push:1", "push:4", "commit:0")]


def spawn(address: str, jobs: str, out: Path, *extra: str) -> subprocess.Popen[bytes]:
    log = open(out.with_suffix(".log"), "wb")
    cmd = [sys.executable, str(HERE / "fault_worker.py"), address, jobs, TOKEN, "mixed", str(STEPS), str(out), *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc


def jobs_status(address: str) -> dict[str, object]:
    with Client(address, timeout=10) as c:
        return {j.name: j for j in c.status().jobs}


def wait_stopped(proc: subprocess.Popen[bytes], deadline_s: float = 120.0) -> None:
    """Wait until ``proc`` has stopped itself (state T in /proc)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        state = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state in ("T", "t"):
            return
        assert proc.poll() is None, f"the victim exited with {proc.returncode} before its fault point"
        time.sleep(0.02)
    raise AssertionError("the victim never reached its fault point")


def wait_detached(address: str, name: str, deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if not jobs_status(address)[name].workers:  # type: ignore[attr-defined]
            return
        time.sleep(0.05)
    raise AssertionError(f"job {name!r}: its stopped or killed worker was never detached")


def weights(address: str, name: str) -> dict[str, torch.Tensor]:
    with Client(address, timeout=30) as c:
        with torch.device("meta"):
            skeleton = models.mixed()
        return c.attach_job(name, token=TOKEN, stages=skeleton).state_dict()


def run_faults(
    tmp_path: Path, srv: ServerProcess, points: list[tuple[str, int, str]], parallel: int = 4, unit_bytes: int | None = None
) -> None:
    """Create one job per point, run its victim (a few at a time), and finish the killed ones.
    ``unit_bytes``: the jobs' (None: one server stage per chain stage, five pushes a step)."""
    address = srv.address
    names = [f"f{k}" for k in range(len(points))]
    with Client(address, timeout=30) as c:
        for name in ["ref", *names]:
            c.create_job(name, models.mixed(), optimizer=OPTIMIZER, token=TOKEN, unit_bytes=unit_bytes)
    running: list[tuple[subprocess.Popen[bytes], str, str, Path]] = []
    killed: list[str] = []

    def settle(entry: tuple[subprocess.Popen[bytes], str, str, Path]) -> None:
        proc, name, sig, out = entry
        if sig == "KILL":
            rc = proc.wait(timeout=120)
            assert rc == -signal.SIGKILL, f"{name}: the victim exited with {rc}:\n{out.with_suffix('.log').read_text()}"
            killed.append(name)
            return
        wait_stopped(proc)
        wait_detached(address, name)  # stopped past its lease
        proc.send_signal(signal.SIGCONT)  # it goes on writing its old ring, which the server no longer reads
        report = wait_worker(proc, out, out.with_suffix(".log"), timeout=120)
        assert report[name]["reconnects"] >= 1 and report[name]["step"] == STEPS
        assert report[name]["step_ring"]  # a lone CPU worker: every push held in its step ring

    for name, (sig, step, at) in zip(names, points):
        out = tmp_path / f"{name}.json"
        running.append((spawn(address, name, out, "--at", at, "--in-step", str(step), "--signal", sig), name, sig, out))
        if len(running) >= parallel:
            settle(running.pop(0))
    for entry in running:
        settle(entry)
    for name in killed:
        wait_detached(address, name)
    out = tmp_path / "finish.json"
    report = wait_worker(spawn(address, ",".join(["ref", *killed]), out), out, out.with_suffix(".log"), timeout=240)
    assert all(r["step"] == STEPS and r["step_ring"] for r in report.values())
    status = jobs_status(address)
    want = weights(address, "ref")
    for name, point in zip(names, points):
        assert status[name].step == STEPS  # type: ignore[attr-defined]
        got = weights(address, name)
        for key, w in want.items():
            assert torch.equal(got[key], w), f"{name} {point}: {key} differs from the crash-free run"


def test_a_lone_worker_killed_anywhere_in_a_step_leaves_the_weights_of_a_crash_free_run(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--memory-limit", "2GiB", "--lease", "1")
    try:
        run_faults(tmp_path, srv, KILL_POINTS)
        log = srv.log()
        assert "discarded on every stage" in log  # the faults after a push threw their step away
        assert "skips step" not in log
    finally:
        assert srv.stop() == 0
        assert "Traceback" not in srv.log(), srv.log()


def test_a_lone_worker_stopped_past_its_lease_anywhere_in_a_step_resumes_exactly(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--memory-limit", "2GiB", "--lease", "1")
    try:
        run_faults(tmp_path, srv, STOP_POINTS)
    finally:
        assert srv.stop() == 0
        assert "Traceback" not in srv.log(), srv.log()


def test_a_lone_worker_of_a_job_of_units_killed_or_stopped_in_a_step_leaves_the_weights_of_a_crash_free_run(
    tmp_path: Path,
) -> None:
    """The default cut: the five stages are one unit, pushed once a step, after the last backward."""
    srv = start_server(tmp_path, "--memory-limit", "2GiB", "--lease", "1")
    points = [("KILL", 1, "action:3"), ("KILL", 1, "push:0"), ("KILL", 1, "commit:0"), ("STOP", 1, "action:11"),
              ("STOP", 1, "push:0")]
    try:
        run_faults(tmp_path, srv, points, unit_bytes=AUTO_UNIT_BYTES)
    finally:
        assert srv.stop() == 0
        assert "Traceback" not in srv.log(), srv.log()


@pytest.mark.parametrize("at", ["action:8", "push:0", "push:3", "commit:0"])
def test_one_of_two_workers_killed_mid_step_leaves_the_weights_of_a_crash_free_run(tmp_path: Path, at: str) -> None:
    """Both workers train on the same batches, so the mean over whichever workers make a step is
    the lone worker's gradient, bit for bit: the job must end exactly as a crash-free lone worker
    leaves it, whether the dead worker's part of the step was thrown away (it had pushed some of
    it: the partner trains the step again) or never mattered."""
    srv = start_server(tmp_path, "--memory-limit", "2GiB", "--lease", "1")
    address = srv.address
    try:
        with Client(address, timeout=30) as c:
            for name in ("ref", "dp"):  # unit_bytes=None: push:3 is the fourth of five pushes
                c.create_job(name, models.mixed(), optimizer=OPTIMIZER, token=TOKEN, unit_bytes=None)
        ws = ("--world-size", "2")
        victim = spawn(address, "dp", tmp_path / "victim.json", "--at", at, "--in-step", "1", *ws)
        partner = spawn(address, "dp", tmp_path / "partner.json", *ws)
        assert victim.wait(timeout=120) == -signal.SIGKILL, (tmp_path / "victim.log").read_text()
        replacement = spawn(address, "dp", tmp_path / "replacement.json", *ws)
        for proc, who in ((partner, "partner"), (replacement, "replacement")):
            report = wait_worker(proc, tmp_path / f"{who}.json", tmp_path / f"{who}.log", timeout=180)
            assert report["dp"]["step"] == STEPS
        ref = spawn(address, "ref", tmp_path / "ref.json")
        wait_worker(ref, tmp_path / "ref.json", tmp_path / "ref.log", timeout=180)
        want, got = weights(address, "ref"), weights(address, "dp")
        for key, w in want.items():
            assert torch.equal(got[key], w), f"{at}: {key} differs from the crash-free run"
        if at.startswith("push"):  # it had pushed part of the step, which cannot have committed
            assert "discarded on every stage" in srv.log()
    finally:
        assert srv.stop() == 0
        assert "Traceback" not in srv.log(), srv.log()
