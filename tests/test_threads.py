"""The defaults do not oversubscribe: a ``wstream-server`` and a worker on its host ask for no
more threads than there are cores (NOTE [Threads of a co-located server] in server/threads.py), and
a worker's helper threads compute alone (NOTE [Helper threads compute alone] in client/threads.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import start_server
from wstream.client import AdamW, Client, gradient_write
from wstream.client.device import CopyEngine
from wstream.protocol.host import host_cores
from wstream.server.inprocess import InProcessServer
from wstream.server.threads import default_compute_threads


@pytest.fixture
def all_threads() -> object:
    """This process asks torch for every core, as a script without OMP_NUM_THREADS does."""
    before = torch.get_num_threads()
    torch.set_num_threads(host_cores())
    yield
    torch.set_num_threads(before)


def test_a_default_server_and_a_colocated_worker_fit_the_cores(tmp_path: Path, monkeypatch, all_threads) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the server's own defaults, not the suite's
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    srv = start_server(tmp_path, "--memory-limit", "1GiB")
    try:
        with Client(srv.address, timeout=30) as client:
            job = client.create_job("threads", [nn.Linear(4, 4), nn.Linear(4, 2)], token="t", optimizer=AdamW(lr=1e-2))
            with job.trainer(prefetch=0) as trainer:
                server_threads = trainer.connection.server_threads
                worker_threads = torch.get_num_threads()
                trainer.step(torch.randn(3, 4), torch.randn(3, 2), nn.functional.mse_loss)
    finally:
        assert srv.stop() == 0, srv.log()
    cores = host_cores()
    assert server_threads == default_compute_threads(cores), (server_threads, cores)
    assert server_threads + worker_threads <= max(cores, 2), (server_threads, worker_threads, cores)
    assert worker_threads >= 1
    # the server process's OpenMP threads sleep between updates instead of spinning
    assert f"updates on {server_threads} torch threads of {cores} cores; OpenMP waits PASSIVE" in srv.log(), srv.log()


def test_a_wait_policy_the_environment_sets_is_kept(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    srv = start_server(tmp_path, "--memory-limit", "1GiB", "--torch-threads", "1")
    assert srv.stop() == 0
    assert f"updates on 1 torch threads of {host_cores()} cores; OpenMP waits ACTIVE" in srv.log(), srv.log()


def test_helper_threads_compute_alone_and_leave_the_process_default(tmp_path: Path, monkeypatch) -> None:
    """NOTE [Helper threads compute alone] in client/threads.py: the gradient sender's writes and
    the prefetcher's copies run with one torch thread (a second OpenMP team would make libgomp stop
    spinning in the compute thread's), while the compute thread keeps its two and a thread started
    afterwards still gets the process's default."""
    seen: dict[str, set[int]] = {}

    def recording(fn):  # noqa: ANN001, ANN202 - wraps the function whatever its signature
        def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            seen.setdefault(threading.current_thread().name, set()).add(torch.get_num_threads())
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(gradient_write, "_write_and_measure", recording(gradient_write._write_and_measure))
    monkeypatch.setattr(CopyEngine, "copy", recording(CopyEngine.copy))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with InProcessServer(bind=[f"ipc://{tmp_path / 's.sock'}"]) as srv, Client(srv.address, timeout=30) as client:
            stages = [nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)]
            job = client.create_job("alone", stages, token="t", optimizer=AdamW(lr=1e-2), unit_bytes=None)
            with job.trainer(cpu_threads=2, zero_copy=False, step_ring=False) as trainer:
                for _ in range(2):
                    trainer.step(torch.randn(8, 64), torch.randn(8, 64), nn.functional.mse_loss)
                on_main = torch.get_num_threads()
                later: list[int] = []
                probe = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
                probe.start()
                probe.join()
    finally:
        torch.set_num_threads(before)
    assert seen.get("wstream-push") == {1} and seen.get("wstream-prefetch") == {1}, seen
    assert on_main == 2 and later == [2], (on_main, later)
