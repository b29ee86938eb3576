"""Server lifecycle: clean exit on signals, no shared memory left behind, stale segments reaped,
and the ``wstream status`` command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import models
from conftest import start_server
from wstream.client import AdamW, Client
from wstream.protocol.shm import PREFIX, SHM_DIR, reap_stale_segments, segment_paths, segment_stamp, segment_stamps


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_signal_exits_cleanly_and_removes_every_segment(tmp_path: Path, sig: int) -> None:
    """SIGHUP too (a server started from a terminal or an ssh session that closes): defect seen, it
    killed the server at once, its segments left in /dev/shm and no final snapshot taken."""
    srv = start_server(tmp_path)
    with Client(srv.address, timeout=30) as c:
        job = c.create_job("j", models.mixed(), optimizer=AdamW(), token="t")
        trainer = job.trainer()
        trainer.step(*models.batch("mixed", 0), models.loss_fn)
        made = segment_paths(srv.proc.pid)
        assert len(made) == 2  # published weights + this worker's gradient ring
        for path in made:
            assert os.stat(path).st_mode & 0o777 == 0o600
        assert srv.stop(sig) == 0, srv.log()
        trainer.connection.heartbeat.close()  # the server is gone: don't wait for a lease to notice
    assert not segment_paths(srv.proc.pid)
    assert "all shared-memory segments removed" in srv.log()


def test_stale_segments_of_a_dead_server_are_reaped(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    name = f"{PREFIX}{int(dead.stdout)}-{'ab' * 16}"
    # the rule, in a directory of its own (other tests' servers, starting in parallel, reap /dev/shm too)
    (tmp_path / "shm").mkdir()
    alone, alive = tmp_path / "shm" / name, tmp_path / "shm" / f"{PREFIX}{os.getpid()}-{'cd' * 16}"
    alone.write_bytes(b"x" * 4096)
    alive.write_bytes(b"x")
    # a segment of an earlier process that had this very pid (a server restarted in a container is
    # pid 1 again): named with its creator's start time, which is not this process's (defect seen:
    # a segment of this pid was never reaped, one more copy of every job per restart)
    wall = segment_stamps().split("-")[0]
    same_pid = tmp_path / "shm" / f"{PREFIX}{os.getpid()}-{wall}-{segment_stamp() - 100}-{'ef' * 16}"
    same_pid.write_bytes(b"x")
    mine = tmp_path / "shm" / f"{PREFIX}{os.getpid()}-{segment_stamps()}-{'12' * 16}"  # named as this process names its own
    mine.write_bytes(b"x")
    assert sorted(reap_stale_segments([str(tmp_path / "shm")])) == sorted([str(alone), str(same_pid)])
    assert alive.exists() and mine.exists()  # this (live) process's segments are kept
    # and a server does it at start: the segment is gone once it serves (this server's log says so,
    # unless a server of a test running beside this one reaped it first)
    stale = Path(SHM_DIR) / name
    stale.write_bytes(b"x" * 4096)
    srv = start_server(tmp_path)
    try:
        assert not stale.exists()
    finally:
        assert srv.stop() == 0


def test_found_by_review_a_clock_step_does_not_make_a_live_servers_segments_look_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A segment's name carried its creator's start as wall-clock time (psutil: boot time plus
    ticks), and another server read it again after a clock step (NTP, a VM's resync) as a different
    number: a live server's segments were reaped. The stamp is now the start in ticks after boot."""
    import psutil

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "shm").mkdir()
        ours = tmp_path / "shm" / f"{PREFIX}{live.pid}-{segment_stamps(live.pid)}-{'ab' * 16}"
        ours.write_bytes(b"x")
        # a server of the version before reads the field after the pid as the start in wall-clock
        # time: it finds the creator's there, so it does not reap a newer server's live segments
        assert int(ours.name[len(PREFIX):].split("-")[1]) == int(psutil.Process(live.pid).create_time() * 100)
        # an older server's name, stamped with its start as wall-clock time: still told alive
        older = tmp_path / "shm" / f"{PREFIX}{live.pid}-{int(psutil.Process(live.pid).create_time() * 100)}-{'cd' * 16}"
        older.write_bytes(b"x")
        assert reap_stale_segments([str(tmp_path / "shm")]) == []  # both told alive
        import psutil._pslinux as linux

        real_boot_time = linux.boot_time
        monkeypatch.setattr(linux, "boot_time", lambda: real_boot_time() + 1.0)  # the clock stepped by 1 s
        reap_stale_segments([str(tmp_path / "shm")])  # (an older server's name may go: its stamp moved)
        assert ours.exists()
    finally:
        live.kill()
        live.wait()
    left = sorted(str(p) for p in (tmp_path / "shm").iterdir())
    assert sorted(reap_stale_segments([str(tmp_path / "shm")])) == left and str(ours) in left  # its creator gone: reaped


def test_status_command_prints_jobs_workers_steps_and_memory(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--memory-limit", "1GiB")
    try:
        with Client(srv.address, timeout=30) as c:
            job = c.create_job("status-demo", models.mixed(), optimizer=AdamW(), token="t")
            with job.trainer() as tr:
                for s in range(3):
                    tr.step(*models.batch("mixed", s), models.loss_fn)
                out = subprocess.run(
                    [sys.executable, "-m", "wstream.client.admin", "status", "--server", srv.address],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert "of 1.00 GiB" in lines[0]
        assert lines[1].split() == [
            "job", "state", "step", "steps/s", "workers", "memory", "snapshot", "stages", "params", "optimizer", "lr",
            "grad-norm", "opt-time",
        ]
        row = next(line for line in lines if line.startswith("status-demo"))
        fields = row.split()  # the memory cell is two words ("12.34 KiB")
        params = sum(p.numel() for m in models.mixed() for p in m.parameters())
        assert fields[1:3] == ["ready", "3"] and float(fields[3]) > 0 and fields[4] == "1"  # state, step, steps/s, workers
        # no snapshot (no store); the chain's 5 small stages, held in one transfer unit; params
        assert fields[-9:-3] == ["-", "5", "(1", "unit)", f"{params:,}", "AdamW"]
        assert float(fields[-3]) == 1e-3 and float(fields[-2]) > 0  # the lr and gradient norm of the last step
    finally:
        assert srv.stop() == 0


def test_status_of_a_server_that_is_not_there_fails_clearly(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "wstream.client.admin", "status", "--server", f"ipc://{tmp_path}/none", "--timeout", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert "did not answer within 1 s" in out.stderr


def test_server_refuses_a_bad_bind_address(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "wstream.server", "--bind", "nonsense"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert "not a ZeroMQ endpoint" in out.stderr


def test_server_refuses_an_address_it_cannot_listen_on(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "wstream.server", "--bind", f"ipc://{tmp_path}/no-such-dir/s.sock"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "cannot listen on ipc://" in out.stderr


def test_worker_lease_expiry_lets_the_other_worker_go_on(tmp_path: Path) -> None:
    """A worker that stops talking is detached after its lease; the job goes on without it."""
    srv = start_server(tmp_path, "--lease", "1.0")
    try:
        with Client(srv.address, timeout=30) as c:
            job = c.create_job("lease", models.mixed(), optimizer=AdamW(), token="t")
            silent = job.trainer(world_size=2)
            silent.connection.heartbeat.close()  # stops heart-beating, as a hung process would
            with job.trainer(world_size=2) as alive:
                loss = alive.step(*models.batch("mixed", 0), models.loss_fn)  # waits for the lease
            assert torch.isfinite(torch.tensor(loss))
            job.state_dict()  # a pull waits for its stage's update: the step is applied everywhere
            st = c.status().jobs[0]
            assert st.step == 1 and st.workers == []
            assert "silent for more than its 1 s lease" in srv.log()
            silent.connection.closed = True  # its session is gone already
            silent.connection.prefetcher.close()
            silent.connection.pusher.close()
            silent.connection.chan.close()
    finally:
        assert srv.stop() == 0


def test_an_in_process_server_removes_the_socket_files_it_named_itself() -> None:
    """Found by review: every ``InProcessServer()`` without ``bind`` left its random
    ``/tmp/wstream-inprocess-*.sock`` and ``.sock.lock`` behind (1,224 of them on this machine)."""
    import os

    from wstream.server.inprocess import InProcessServer

    with InProcessServer(memory_limit=2**20) as srv:
        path = srv.address.removeprefix("ipc://")
        assert os.path.exists(path)
    assert not os.path.exists(path) and not os.path.exists(path + ".lock")


def test_a_dropped_job_is_freed_at_once_not_by_a_later_garbage_collection(server: Any, client: Any) -> None:
    """Found by review: the job's parts pointed back at it (a reference cycle), so a dropped job's
    tensors and mappings lived on until Python's cyclic collector ran, while the memory account
    had already released them: create/drop cycles took the server past its limit (566 MiB held
    with a 160 MiB limit). Without any collection, the job must be gone when the drop returns."""
    import gc
    import weakref

    from torch import nn

    job = client.create_job("freed", [nn.Linear(8, 8), nn.Linear(8, 8)], optimizer=AdamW(), token="t")
    with job.trainer() as trainer:
        trainer.step(torch.randn(2, 8), torch.randn(2, 8), torch.nn.functional.mse_loss)
    on_server = weakref.ref(server.inprocess.server.jobs["freed"])
    gc.disable()
    try:
        client.drop_job("freed", token="t")
        assert on_server() is None
    finally:
        gc.enable()


@pytest.mark.server_process  # the worker's mappings are told apart from the server's by process
@pytest.mark.parametrize("transport", [{}, {"zero_copy": False}, {"step_ring": True}])
def test_found_by_review_a_closed_trainer_unmaps_the_jobs_segments_at_once(server: Any, transport: dict[str, bool]) -> None:
    """A closed trainer kept the published segment and its gradient ring mapped until Python's
    cyclic collector ran (a loop of create, train, drop held 6 jobs' segments, 200 MB of /dev/shm
    the server's account had released). Without any collection, closing unmaps them."""
    import gc

    from torch import nn

    def mapped() -> set[str]:
        with open("/proc/self/maps") as f:
            return {parts[5] for parts in (line.split() for line in f) if len(parts) > 5 and f"{SHM_DIR}/{PREFIX}" in parts[5]}

    before = mapped()
    gc.disable()
    try:
        with Client(server.address, timeout=30) as c:
            job = c.create_job("unmapped", [nn.Linear(64, 64) for _ in range(3)], optimizer=AdamW(), token="t", unit_bytes=None)
            with job.trainer(**transport) as trainer:
                trainer.step(torch.randn(4, 64), torch.randn(4, 64), torch.nn.functional.mse_loss)
                assert mapped() - before, "the worker maps nothing: the test would prove nothing"
            assert mapped() == before  # the trainer is still referenced, and no collection ran
            job.drop()
    finally:
        gc.enable()


def test_a_worker_of_a_dropped_job_does_not_train_the_job_created_again_under_its_name(client: Client) -> None:
    """Found by review: a worker whose job was dropped and created again (same name, token and
    layout) reconnected to the new job and trained it with its own step's gradients (the new
    job's weights were 0.2 off a run of its own). ``Attached.incarnation`` now tells the two apart."""
    from torch import nn

    from wstream.client import UnknownJobError

    def stages() -> list[nn.Module]:
        torch.manual_seed(0)
        return [nn.Linear(4, 4), nn.Linear(4, 4)]

    old = client.create_job("again", stages(), optimizer=AdamW(), token="t")
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    with old.trainer(reconnect_s=30) as trainer:
        trainer.step(x, y, torch.nn.functional.mse_loss)
        client.drop_job("again", token="t")
        new = client.create_job("again", stages(), optimizer=AdamW(), token="t")
        before = new.state_dict()
        with pytest.raises(UnknownJobError, match="dropped and created again"):
            trainer.step(x, y, torch.nn.functional.mse_loss)
    after = new.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert {j.name: j.step for j in client.status().jobs} == {"again": 0}
