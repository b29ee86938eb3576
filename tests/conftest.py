"""Fixtures: a ``wstream-server`` (in this process, or a real subprocess) and worker subprocesses.

The ``server`` fixture is an in-process server (``wstream.server.inprocess``): the very same
server code on a thread of the test process, on an ipc endpoint, without the second or two a
server process takes to start and stop. A test of transport, signals, crashes or shared memory
across processes is marked ``@pytest.mark.server_process`` and gets a real ``wstream-server``
process from the same fixture (tests that restart or kill servers call ``start_server``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from wstream.client import Client, ServerUnavailable, wait_for_server
from wstream.protocol.shm import segment_paths
from wstream.server.inprocess import InProcessServer

HERE = Path(__file__).parent


@dataclass
class ServerProcess:
    address: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    client_options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments a ``Client`` of this server needs (its CURVE keys)."""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"server did not exit within {timeout} s of signal {sig}\n{self.log()}") from None


def start_server(
    tmp_path: Path,
    *extra: str,
    name: str = "server",
    address: str | None = None,
    client_options: dict[str, Any] | None = None,
) -> ServerProcess:
    """A server subprocess; ``address`` (default: an ipc socket named after ``name``) lets a
    restarted server listen where its clients look for it. ``client_options`` are the ``Client``
    keyword arguments it takes to reach the server (CURVE keys), used to wait for it."""
    address = address or f"ipc://{tmp_path / f'{name}.sock'}"
    client_options = client_options or {}
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "wstream.server", "--bind", address, *extra],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    srv = ServerProcess(address, proc, log_path, client_options)
    try:  # ready when it answers a status request
        wait_for_server(address, timeout=60, alive=lambda: proc.poll() is None, **client_options)
    except ServerUnavailable:
        srv.stop(signal.SIGKILL)
        raise AssertionError(f"server did not come up (exit code {proc.returncode})\n{srv.log()}") from None
    return srv


def free_tcp_address() -> str:
    """A loopback tcp endpoint on a port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@dataclass
class ServerThread:
    """The in-process server as the tests see it: where it listens and how to reach it."""

    address: str
    inprocess: InProcessServer
    client_options: dict[str, Any] = field(default_factory=dict)


@pytest.fixture
def server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ServerProcess | ServerThread]:
    """A server with a 4 GiB memory limit: in this process, or a real process for a test marked
    ``server_process``. Either must stop cleanly and leave no shared-memory segment behind."""
    if request.node.get_closest_marker("server_process") is not None:
        srv = start_server(tmp_path, "--memory-limit", "4GiB")
        yield srv
        rc = srv.stop()
        assert rc == 0, f"server exited with {rc}\n{srv.log()}"
        assert not segment_paths(srv.proc.pid), f"server left shared-memory segments\n{srv.log()}"
        return
    inprocess = InProcessServer(bind=[f"ipc://{tmp_path / 'server.sock'}"], memory_limit=4 * 2**30)
    yield ServerThread(inprocess.address, inprocess)
    inprocess.stop()
    assert not segment_paths(os.getpid()), "the in-process server left shared-memory segments"


@pytest.fixture
def client(server: ServerProcess | ServerThread) -> Iterator[Client]:
    with Client(server.address, timeout=30) as c:
        yield c


def run_workers(
    address: str,
    job: str,
    token: str,
    model: str,
    steps: int,
    ranks: int,
    tmp_path: Path,
    *extra: str,
    env: dict[str, str] | None = None,
) -> list[dict]:
    """Run ``ranks`` worker processes to completion; return their JSON reports."""
    procs = []
    full_env = {**os.environ, **(env or {})}
    for rank in range(ranks):
        out = tmp_path / f"worker{rank}.json"
        log = open(tmp_path / f"worker{rank}.log", "wb")
        cmd = [
            sys.executable,
            str(HERE / "worker_main.py"),
            *(address, job, token, model, str(steps), str(rank), str(out)),
            *("--world-size", str(ranks)),
            *extra,
        ]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env), out, log))
    reports = []
    for proc, out, log in procs:
        log.close()
        reports.append(wait_worker(proc, out, Path(log.name)))
    return reports


def wait_worker(proc: subprocess.Popen[bytes], out: Path, log_path: Path, timeout: float = 240.0) -> dict:
    """Wait for a worker subprocess (killed after ``timeout``); it must exit 0. Returns its JSON
    report ``out``; a failure message carries its log."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    assert rc == 0, f"worker exited with {rc}:\n{log_path.read_text(errors='replace')}"
    return json.loads(out.read_text())


os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``@pytest.mark.cuda`` tests run only where a CUDA device is (tests/test_cuda.py)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """tests/test_drop.py's ``Scene``: the in-process server with its slow parts (gathers,
    updates, snapshot writes) held at gates the test opens."""
    from test_drop import Scene

    s = Scene(tmp_path, monkeypatch)
    try:
        yield s
    finally:
        s.close()


ADMIN_SECRET = "admin-s3cret"
"""The admin secret of :func:`admin_server`."""


@pytest.fixture
def admin_server(tmp_path: Path) -> Iterator[InProcessServer]:
    """An in-process server with an admin secret (``ADMIN_SECRET``, from a 0600 file)."""
    secret = tmp_path / "admin-secret"
    secret.write_text(ADMIN_SECRET + "\n")
    secret.chmod(0o600)
    srv = InProcessServer(bind=[f"ipc://{tmp_path / 'admin.sock'}"], admin_secret_file=str(secret))
    try:
        yield srv
    finally:
        srv.stop()
