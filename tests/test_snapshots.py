"""Snapshots: consistent steps written atomically while training goes on, verified on load."""

from __future__ import annotations

import copy
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

import models
from conftest import start_server
from test_equivalence import assert_weights_equal, reference_train
from wstream.client import AdamW, Client, UnknownJobError

LR, WD = 3e-3, 0.05


def adamw(p):  # noqa: ANN001, ANN201
    return torch.optim.AdamW(p, lr=LR, weight_decay=WD)


def snapshot_weights(path: Path) -> tuple[int, dict[str, torch.Tensor]]:
    """(step, {"<stage>.<param>": tensor}) read straight from a snapshot directory: server stage
    i's parameter ``name`` is chain stage i's, or with transfer units (the job's options list them)
    already named ``"<chain stage>.<name>"``."""
    manifest = json.loads((path / "manifest.json").read_text())
    masters: dict[int, torch.Tensor] = {}
    for f in manifest["files"]:
        for key, t in load_file(path / f["name"]).items():
            stage, _, name = key.partition(".")
            if name == "master":
                masters[int(stage)] = t
    units = manifest["job"]["options"].get("units") is not None
    out = {}
    for i, spec in enumerate(manifest["job"]["stages"]):
        for name, shape, offset, *_ in spec["params"]:  # (group and frozen follow, since protocol 3's groups)
            n = int(torch.tensor(shape).prod().item()) if shape else 1
            out[name if units else f"{i}.{name}"] = masters[i][offset : offset + n].view(shape)
    return manifest["step"], out


def train(address: str, name: str, steps: int) -> None:
    with Client(address, timeout=30) as c:
        with torch.device("meta"):
            skeleton = models.mixed()
        job = c.attach_job(name, token="t", stages=skeleton)
        with job.trainer() as tr:
            for s in range(steps):
                tr.step(*models.batch("mixed", s), models.loss_fn)


def test_every_snapshot_holds_exactly_one_step_while_training_goes_on(tmp_path: Path) -> None:
    store = tmp_path / "store"
    srv = start_server(tmp_path, "--store", str(store), "--snapshot-every", "1", "--keep-snapshots", "100")
    stages = models.mixed()
    start = copy.deepcopy(stages)
    with Client(srv.address, timeout=30) as c:
        c.create_job("snap", stages, optimizer=AdamW(lr=LR, weight_decay=WD), token="t")
    train(srv.address, "snap", 8)
    assert srv.stop() == 0
    snaps = sorted((store / "job-snap").glob("step-*"))
    assert len(snaps) >= 4, snaps  # at creation, at shutdown, and some every-step ones between
    for path in snaps:
        step, got = snapshot_weights(path)
        want = reference_train(copy.deepcopy(start), adamw, "mixed", step)
        assert_weights_equal(got, want, atol=1e-6)
        opt_steps = {k: t for f in json.loads((path / "manifest.json").read_text())["files"]
                     for k, t in load_file(path / f["name"]).items() if k.endswith(".opt.step")}
        assert all(int(t.item()) == step for t in opt_steps.values()), (step, opt_steps)
        for f in path.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert json.loads((snaps[-1] / "manifest.json").read_text())["step"] == 8  # the shutdown snapshot


def test_save_keep_restart_and_a_damaged_snapshot_falls_back_to_an_older_one(tmp_path: Path) -> None:
    store = tmp_path / "store"
    args = ("--store", str(store), "--keep-snapshots", "2")
    srv = start_server(tmp_path, *args, name="a")
    stages = models.mixed()
    start = copy.deepcopy(stages)
    with Client(srv.address, timeout=30) as c:
        job = c.create_job("keep", stages, optimizer=AdamW(lr=LR, weight_decay=WD), token="t")
        train(srv.address, "keep", 3)
        assert job.save() == (3, str(store / "job-keep" / "step-000000000003"))
        assert job.save()[0] == 3  # nothing changed: the same snapshot
    train(srv.address, "keep", 2)  # steps 3, 4 (a new trainer starts at the job's step)
    with Client(srv.address, timeout=30) as c:
        assert c.attach_job("keep", token="t").save()[0] == 5
    assert [p.name for p in sorted((store / "job-keep").glob("step-*"))] == ["step-000000000003", "step-000000000005"]
    srv.stop(signal.SIGKILL)
    newest = store / "job-keep" / "step-000000000005"
    shard = next(newest.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # one flipped bit in the weights
    shard.write_bytes(bytes(data))
    srv = start_server(tmp_path, *args, name="b", address=srv.address)
    with Client(srv.address, timeout=30) as c:
        assert {j.name: j.step for j in c.status().jobs} == {"keep": 3}
        with torch.device("meta"):
            skeleton = models.mixed()
        resumed = c.attach_job("keep", token="t", stages=skeleton)
        got = resumed.state_dict()
        # nothing changed since the resume: the snapshot it resumed from, not the damaged newer one
        assert resumed.save() == (3, str(store / "job-keep" / "step-000000000003"))
    assert_weights_equal(got, reference_train(copy.deepcopy(start), adamw, "mixed", 3), atol=1e-6)
    assert srv.stop() == 0
    assert "is damaged" in srv.log() and "does not match" in srv.log()


def test_export_and_the_admin_commands(tmp_path: Path) -> None:
    store = tmp_path / "store"
    srv = start_server(tmp_path, "--store", str(store))
    with Client(srv.address, timeout=30) as c:
        job = c.create_job("exp", models.mixed(), optimizer=AdamW(lr=LR), token="t")
        train(srv.address, "exp", 2)
        want = job.state_dict()
    token_file = tmp_path / "token"
    token_file.write_text("t\n")
    os.chmod(token_file, 0o600)
    out = tmp_path / "model.safetensors"
    base = [sys.executable, "-m", "wstream.client.admin"]
    common = ["--server", srv.address, "--token-file", str(token_file)]
    r = subprocess.run([*base, "export", "exp", *common, "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = load_file(out)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    r = subprocess.run([*base, "save", "exp", *common], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "snapshot of step 2" in r.stdout, r.stdout + r.stderr
    bad = tmp_path / "bad"
    bad.write_text("wrong")
    r = subprocess.run([*base, "save", "exp", "--server", srv.address, "--token-file", str(bad)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "wrong token" in r.stderr
    assert srv.stop() == 0


def test_a_dropped_job_stays_dropped_after_a_restart(tmp_path: Path) -> None:
    store = tmp_path / "store"
    srv = start_server(tmp_path, "--store", str(store), name="a")
    with Client(srv.address, timeout=30) as c:
        c.create_job("gone", models.mixed(), optimizer=AdamW(lr=LR), token="t").drop()
        c.create_job("kept", models.mixed(), optimizer=AdamW(lr=LR), token="t")
    srv.stop(signal.SIGKILL)
    srv = start_server(tmp_path, "--store", str(store), name="b", address=srv.address)
    with Client(srv.address, timeout=30) as c:
        assert [j.name for j in c.status().jobs] == ["kept"]
        try:
            c.attach_job("gone", token="t")
            raise AssertionError("a dropped job came back")
        except UnknownJobError:
            pass
    assert srv.stop() == 0


def test_a_job_not_resumed_keeps_its_snapshots_and_its_name(tmp_path: Path, monkeypatch) -> None:
    """A job the server cannot resume at start (here its shared memory does not fit) leaves its
    files in place, and the server starts and serves the other jobs (defect seen: the error, an
    ``OSError``, stopped the whole server). A new job of that name is refused, naming why (defect
    seen: it was created in the same directory and the pruning of old snapshots deleted the new
    job's first one: it was gone after the next restart)."""
    import pytest

    from wstream.client import JobExistsError
    from wstream.protocol.shm import SegmentSpaceError
    from wstream.server.inprocess import InProcessServer
    from wstream.server.job import Job

    store = tmp_path / "store"
    fields = dict(bind=[f"ipc://{tmp_path / 's.sock'}"], memory_limit=2**30, store=str(store), keep_snapshots=1)
    srv = InProcessServer(**fields)
    with Client(srv.address, timeout=30) as c:
        for name in ("stuck", "fine"):
            c.create_job(name, models.mixed(), optimizer=AdamW(lr=LR), token="t")
        train(srv.address, "stuck", 2)
    srv.stop()
    kept = sorted(p.name for p in (store / "job-stuck").glob("step-*"))
    restore = Job.restore.__func__  # type: ignore[attr-defined]

    def no_room_for_stuck(cls: type[Job], record, *args, **kw):  # type: ignore[no-untyped-def]
        if record.name == "stuck":
            raise SegmentSpaceError(28, "/dev/shm full (injected)")
        return restore(cls, record, *args, **kw)

    monkeypatch.setattr(Job, "restore", classmethod(no_room_for_stuck))
    srv = InProcessServer(**fields)
    try:
        with Client(srv.address, timeout=30) as c:
            assert [j.name for j in c.status().jobs] == ["fine"]
            with pytest.raises(JobExistsError, match=r"'stuck' has snapshots in the store that were not resumed.*/dev/shm full"):
                c.create_job("stuck", models.mixed(), optimizer=AdamW(lr=LR), token="t2")
        assert sorted(p.name for p in (store / "job-stuck").glob("step-*")) == kept
    finally:
        srv.stop()


def test_a_schedule_change_is_in_the_next_snapshot_at_the_same_step(tmp_path: Path) -> None:
    """``set_schedule`` changes the job's record, not its step: a ``save`` after it writes a new
    snapshot, and so does the shutdown; a restart resumes with the new lr (defect seen: "nothing
    changed since", the old snapshot stood, and the restarted job trained at the old lr)."""
    store = tmp_path / "store"
    servers = [start_server(tmp_path, "--store", str(store), name="a")]
    try:
        with Client(servers[-1].address, timeout=30) as c:
            job = c.create_job("sched", models.mixed(), optimizer=AdamW(lr=1e-3), token="t")
            assert job.save()[0] == 0
            job.set_schedule(lr=0.5)
            assert job.save()[0] == 0
        servers[-1].stop(signal.SIGKILL)  # no shutdown snapshot: what the save wrote is what resumes
        servers.append(start_server(tmp_path, "--store", str(store), name="b", address=servers[-1].address))
        with Client(servers[-1].address, timeout=30) as c:
            job = c.attach_job("sched", token="t")
            assert job.options.optimizer.lr == 0.5
            job.set_schedule(lr=0.25)
        assert servers[-1].stop() == 0  # a clean stop: its shutdown snapshot holds the change
        servers.append(start_server(tmp_path, "--store", str(store), name="c", address=servers[-1].address))
        with Client(servers[-1].address, timeout=30) as c:
            assert c.attach_job("sched", token="t").options.optimizer.lr == 0.25
        assert servers[-1].stop() == 0
    finally:
        for srv in servers:  # (each stop is a no-op once it has exited)
            srv.stop()


def test_a_failed_snapshot_is_not_tried_again_until_the_job_moves_on(tmp_path: Path, monkeypatch) -> None:
    """A periodic snapshot that fails (here the disk is full) is tried again at the job's next
    step, not at once: the job trains on (defect seen: an idle job's failed snapshot was written
    again and again, tens of thousands of times a second, each logging an error). A ``save`` still
    tries, and says why it failed."""
    import errno

    import pytest

    from wstream.protocol import InternalError
    from wstream.server.inprocess import InProcessServer
    from wstream.server.snapshot import SnapshotStore

    full = {"on": False, "tries": 0}
    write = SnapshotStore.write

    def disk_full(self: SnapshotStore, snap, stages):  # type: ignore[no-untyped-def]
        if not full["on"]:
            return write(self, snap, stages)
        full["tries"] += 1
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(SnapshotStore, "write", disk_full)
    srv = InProcessServer(bind=[f"ipc://{tmp_path / 's.sock'}"], memory_limit=2**30, store=str(tmp_path / "store"), snapshot_every=1)
    try:
        with Client(srv.address, timeout=30) as c:
            job = c.create_job("full", models.mixed(), optimizer=AdamW(lr=LR), token="t")
            full["on"] = True
            train(srv.address, "full", 2)
            assert job.wait_step(2) == 2
            with pytest.raises(InternalError, match="snapshot failed.*No space left"):
                job.save()
            for _ in range(20):  # the loop turns twenty times more
                c.status()
            tries = full["tries"]
            for _ in range(20):
                c.status()
            assert full["tries"] == tries, "an idle job's failed snapshot is being written again and again"
            assert tries <= 2 + 2, tries  # one per step trained, and the save's
    finally:
        full["on"] = False
        srv.stop()


def test_a_dropped_jobs_files_leave_the_store_before_the_drop_is_answered(tmp_path: Path, monkeypatch) -> None:
    """``drop_job``'s ``ok`` means the job's snapshots are out of the store: a server killed right
    after it does not bring the job back (defect seen: the deletion waited behind the snapshot
    writer, which may write another job's snapshot for minutes; a kill meanwhile resumed the
    dropped job). Its files are deleted in the background, and at start what is left of them."""
    import threading

    from wstream.server.inprocess import InProcessServer
    from wstream.server.snapshot import SnapshotStore

    store = tmp_path / "store"
    gate, entered = threading.Event(), threading.Event()
    write = SnapshotStore.write

    def slow_write(self: SnapshotStore, snap, stages):  # type: ignore[no-untyped-def]
        if snap.record.name == "busy" and snap.step > 0:
            entered.set()
            gate.wait(30)  # another job's long snapshot holds the writer
        return write(self, snap, stages)

    monkeypatch.setattr(SnapshotStore, "write", slow_write)
    srv = InProcessServer(bind=[f"ipc://{tmp_path / 's.sock'}"], memory_limit=2**30, store=str(store))
    try:
        with Client(srv.address, timeout=30) as c:
            c.create_job("gone", models.mixed(), optimizer=AdamW(lr=LR), token="t")
            c.create_job("busy", models.mixed(), optimizer=AdamW(lr=LR), token="t")
            train(srv.address, "busy", 1)

            def save_busy() -> None:  # a client of its own: a client is used from one thread
                with Client(srv.address, timeout=30) as other:
                    other.attach_job("busy", token="t").save()

            saving = threading.Thread(target=save_busy)
            saving.start()
            assert entered.wait(30)
            c.attach_job("gone", token="t").drop()
            assert not (store / "job-gone").exists(), "the dropped job's snapshots are still in the store"
            gate.set()
            saving.join(30)
    finally:
        gate.set()
        srv.stop()
    assert sorted(p.name for p in store.iterdir() if p.name.startswith(("job-", ".dropped"))) == ["job-busy"]


def test_a_start_that_fails_while_resuming_removes_the_memory_of_the_jobs_it_resumed(tmp_path: Path, monkeypatch) -> None:
    """An error while the server resumes its jobs (or a signal then) ends the start through the
    ordinary shutdown: the jobs resumed so far give their shared memory back (defect seen: the
    restore ran before the shutdown's ``finally``, and their segments stayed)."""
    import pytest

    from wstream.protocol.shm import segment_paths
    from wstream.server.inprocess import InProcessServer
    from wstream.server.snapshot_scheduler import SnapshotScheduler

    fields = dict(bind=[f"ipc://{tmp_path / 's.sock'}"], memory_limit=2**30, store=str(tmp_path / "store"))
    srv = InProcessServer(**fields)
    with Client(srv.address, timeout=30) as c:
        for name in ("first", "second"):
            c.create_job(name, models.mixed(), optimizer=AdamW(lr=LR), token="t")
    srv.stop()
    before = set(segment_paths(os.getpid()))
    restore = SnapshotScheduler._restore_job

    def fails_at_the_second(self: SnapshotScheduler, name: str, *args, **kw):  # type: ignore[no-untyped-def]
        if name == "second":
            raise RuntimeError("injected: a bug while resuming")
        return restore(self, name, *args, **kw)

    monkeypatch.setattr(SnapshotScheduler, "_restore_job", fails_at_the_second)
    failed = InProcessServer(**fields)
    failed._thread.join(30)  # it ends by itself (a stop now would end the restore before the error)
    with pytest.raises(RuntimeError, match="injected"):
        failed.stop()
    assert set(segment_paths(os.getpid())) == before, "the resumed job's shared memory was left behind"


def test_a_crash_while_a_steps_snapshot_is_replaced_keeps_the_old_one(tmp_path: Path, monkeypatch) -> None:
    """A ``save`` at a step that has a snapshot already (after a schedule change) replaces it: a crash
    between taking the old one away and putting the new one in place must leave the old one
    (defect seen: it was deleted first; with ``--keep-snapshots 1`` the job then had no snapshot
    and was not resumed)."""
    import pytest

    import wstream.server.snapshot as snapshot_module
    from wstream.protocol import InternalError
    from wstream.server.inprocess import InProcessServer

    fields = dict(bind=[f"ipc://{tmp_path / 's.sock'}"], memory_limit=2**30, store=str(tmp_path / "store"), keep_snapshots=1)
    rename = os.rename

    def crash_at_the_new_one(src, dst):  # type: ignore[no-untyped-def]
        if ".tmp-step-" in str(src):
            raise OSError("injected: the process died here")
        return rename(src, dst)

    srv = InProcessServer(**fields)
    try:
        with Client(srv.address, timeout=30) as c:
            job = c.create_job("replace", models.mixed(), optimizer=AdamW(lr=1e-3), token="t")
            job.set_schedule(lr=0.5)
            monkeypatch.setattr(snapshot_module.os, "rename", crash_at_the_new_one)
            with pytest.raises(InternalError, match="injected"):
                job.save()
    finally:
        srv.stop()  # (its shutdown snapshot fails the same way)
    monkeypatch.setattr(snapshot_module.os, "rename", rename)
    srv = InProcessServer(**fields)
    try:
        with Client(srv.address, timeout=30) as c:
            assert [(j.name, j.step) for j in c.status().jobs] == [("replace", 0)]
            # the old snapshot is put back, and the change comes from the schedule log (it was answered)
            assert c.attach_job("replace", token="t").options.optimizer.lr == 0.5
    finally:
        srv.stop()


def _save_then_stop_during_an_update(held):  # type: ignore[no-untyped-def]
    """Commit the victim's step 0 with its updates held (no consistent step), send a ``save`` of
    it, and begin stopping the server: (the save's request id, the stopping thread)."""
    import threading

    from test_drop import commit_with_updates_held
    from wstream.protocol import messages as m

    job = held.victim()
    a, sign_a = held.worker(job)
    commit_with_updates_held(held, a, sign_a, job)
    waiting = held.wire.send(m.Save(session=job.session), signer=job._signer)
    barrier = held.wire.send(m.Status())
    held.wire.collect(lambda: barrier in held.wire.replies)
    assert waiting not in held.wire.replies, held.wire.replies[waiting]
    stopping = threading.Thread(target=held.srv.stop)
    stopping.start()
    return waiting, stopping


def test_a_stop_during_a_committed_steps_updates_lets_them_finish_and_snapshots_the_step(held, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Found by review: a SIGTERM while a worker trained often wrote no final snapshot ("in the
    middle of a step"): the pool was shut down with updates of a committed step queued, or done
    with their completions unread, so the job restarted from its last snapshot, losing every step
    since. The stopping server now lets them finish, answers the save waiting for the step with
    its snapshot, and snapshots the job at it."""
    import threading

    from wstream.protocol import messages as m
    from wstream.server.service import Server

    shutting_down = threading.Event()
    shutdown = Server._shutdown

    def noted(self: Server) -> None:
        shutting_down.set()
        shutdown(self)

    monkeypatch.setattr(Server, "_shutdown", noted)
    waiting, stopping = _save_then_stop_during_an_update(held)
    assert shutting_down.wait(30)  # the loop has stopped serving: what finishes now, the shutdown must finish
    held.update.release()
    held.write.release()
    held.wire.collect(lambda: waiting in held.wire.replies)
    stopping.join(30)
    assert not stopping.is_alive()
    (reply,) = held.wire.replies[waiting]
    assert isinstance(reply, m.Saved) and reply.step == 1, reply
    victim = held.srv.server.config.store + "/job-victim"
    assert [p.name for p in sorted(Path(victim).glob("step-*"))][-1] == "step-000000000001"


def test_a_save_waiting_for_a_consistent_step_is_answered_at_shutdown(held, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A ``save`` of a job in the middle of a step waits for its next consistent step; the server
    stops first, and the step's updates do not finish within the time it gives them: the save is
    answered (an error saying so), not left without a reply (defect seen)."""
    from wstream.protocol import messages as m
    from wstream.server import service

    monkeypatch.setattr(service, "SHUTDOWN_UPDATES_S", 0.2)
    waiting, stopping = _save_then_stop_during_an_update(held)
    # released only once the loop has left serving and given up on the updates (its pool shuts
    # down, waiting for the running update): released earlier, the update would finish the step
    pool = held.srv.server._updates._pool
    deadline = time.monotonic() + 30
    while not pool._shutdown and time.monotonic() < deadline:
        time.sleep(0.005)
    assert pool._shutdown, "the server's loop did not begin its shutdown"
    held.update.release()  # the shutdown waits for the running update
    held.wire.collect(lambda: waiting in held.wire.replies)
    stopping.join(30)
    (reply,) = held.wire.replies[waiting]
    assert isinstance(reply, m.Error) and "shutting down" in reply.message, reply


def test_a_jobs_incarnation_is_kept_in_its_snapshot_record() -> None:
    """``Attached.incarnation`` survives a restart (a worker reconnecting after one is not taken for
    a worker of a dropped job), and a manifest from before protocol 9 gets one of its own."""
    from wstream.protocol import messages as m
    from wstream.server.snapshot import JobRecord

    record = JobRecord("j", b"v" * 32, m.JobOptions(), [])
    again = JobRecord.from_json(record.to_json())
    assert again.incarnation == record.incarnation and len(record.incarnation) == 32
    assert JobRecord("j", b"v" * 32, m.JobOptions(), []).incarnation != record.incarnation
    old = record.to_json()
    del old["incarnation"]
    assert len(JobRecord.from_json(old).incarnation) == 32


def test_a_drop_the_store_refuses_leaves_the_job_as_it_was(tmp_path: Path, monkeypatch: "pytest.MonkeyPatch") -> None:
    """Found by review: a drop whose rename in the store failed (a store remounted read-only) had
    already taken the job out of the table and ended its sessions, and never freed its memory or
    segment; the name could be created again while the old job's files would come back at the
    next restart. The store goes first now: refused, the job is untouched and still trains."""
    import pytest
    from torch import nn

    from wstream.client import SGD, StateError
    from wstream.server.inprocess import InProcessServer
    from wstream.server.snapshot import SnapshotStore

    def refuse(self: SnapshotStore, name: str) -> None:
        raise PermissionError(1, "Operation not permitted")

    with InProcessServer(bind=[f"ipc://{tmp_path}/s.sock"], store=str(tmp_path / "store"), memory_limit=2**28) as srv:
        with Client(srv.address, timeout=30) as client:
            job = client.create_job("kept", [nn.Linear(4, 4)], optimizer=SGD(), token="t")
            used = client.status().memory_used
            monkeypatch.setattr(SnapshotStore, "take_out", refuse)
            with pytest.raises(StateError, match="was not dropped.*as it was"):
                client.drop_job("kept", token="t")
            assert [j.name for j in client.status().jobs] == ["kept"] and client.status().memory_used == used
            with job.trainer() as trainer:
                trainer.step(torch.randn(2, 4), torch.randn(2, 4), torch.nn.functional.mse_loss)
            monkeypatch.undo()
            client.drop_job("kept", token="t")
            assert client.status().jobs == [] and client.status().memory_used == 0


def test_one_jobs_snapshot_backpressure_does_not_stall_another_jobs_updates(tmp_path: Path, monkeypatch) -> None:
    """Found by review: an update that had to capture its stage for a snapshot whose buffer was
    full waited on the optimizer pool's thread (one by default) until the writer made room, so a
    slow disk under one job stopped every other job's updates (1.8 s stalls measured). The update
    now steps aside until there is room, and the pool runs the other jobs' tasks meanwhile."""
    import threading

    from wstream.server.inprocess import InProcessServer
    from wstream.server.snapshot import SnapshotStore

    gate, entered = threading.Event(), threading.Event()
    write = SnapshotStore.write

    def slow_write(self: SnapshotStore, snap, stages):  # type: ignore[no-untyped-def]
        if snap.record.name == "busy" and snap.step == 1:
            entered.set()
            gate.wait(60)  # a disk that cannot keep up: nothing captured is written yet
        return write(self, snap, stages)

    monkeypatch.setattr(SnapshotStore, "write", slow_write)
    # a one-byte buffer: one update's capture fills it, the next update of the step has to wait for room
    srv = InProcessServer(bind=[f"ipc://{tmp_path / 's.sock'}"], memory_limit=2**30, store=str(tmp_path / "store"),
                          snapshot_buffer=1, optimizer_workers=1)
    errors: list[BaseException] = []

    def run(target, *args) -> threading.Thread:  # type: ignore[no-untyped-def]
        def body() -> None:
            try:
                target(*args)
            except BaseException as exc:  # noqa: BLE001 (reported below)
                errors.append(exc)
        thread = threading.Thread(target=body, daemon=True)
        thread.start()
        return thread

    def save(name: str) -> None:
        with Client(srv.address, timeout=60) as other:
            other.attach_job(name, token="t").save()

    try:
        with Client(srv.address, timeout=60) as c:
            stages = models.mixed()
            start = copy.deepcopy(stages)
            c.create_job("busy", stages, optimizer=AdamW(lr=LR, weight_decay=WD), token="t", unit_bytes=None)
            c.create_job("other", models.mixed(), optimizer=AdamW(lr=LR), token="t", unit_bytes=None)
            train(srv.address, "busy", 1)
            saving = run(save, "busy")
            assert entered.wait(60)
            busy = run(train, srv.address, "busy", 2)  # its first updates fill the buffer; the next ones wait
            deadline = time.monotonic() + 60
            while srv.server.jobs["busy"].stages[0].version < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            other = run(train, srv.address, "other", 3)
            other.join(60)
            assert not other.is_alive(), "another job's snapshot buffer stalled this job's updates"
            assert not errors, errors
            busy_versions = [st.version for st in srv.server.jobs["busy"].stages]
            assert busy_versions[-1] == 1, f"the busy job's update did not wait for room: {busy_versions}"
            gate.set()
            busy.join(60)
            saving.join(60)
            assert not busy.is_alive() and not saving.is_alive() and not errors, errors
            assert [st.version for st in srv.server.jobs["busy"].stages] == [3] * len(busy_versions)
    finally:
        gate.set()
        srv.stop()
    step, weights = snapshot_weights(tmp_path / "store" / "job-busy" / "step-000000000001")  # the saved one
    assert step == 1
    assert_weights_equal(weights, reference_train(start, adamw, "mixed", 1), atol=1e-6)


def test_a_parked_update_is_resumed_by_every_way_room_is_made() -> None:
    """NOTE [Consistent snapshots] rule 3: an update parked for room goes on when the writer
    releases a clone, captures the stage itself, ends the write (even a failed one) or is cancelled;
    never twice, and never while the buffer is still full."""
    import threading

    from wstream.protocol import messages as m
    from wstream.server.snapshot import JobRecord, Snapshot

    def snapshot() -> Snapshot:
        return Snapshot(JobRecord("j", b"v" * 32, m.JobOptions(), []), step=0, buffer_bytes=8, reason="test")

    lock = threading.Lock()
    resumed: list[int] = []

    def capture(previous: bool = False) -> dict[str, torch.Tensor]:
        return {"w": torch.zeros(4)}  # 16 bytes: one fills the 8-byte buffer

    snap = snapshot()
    assert snap.capture_before_update(0, lock, capture, 16, lambda: resumed.append(0))  # an empty buffer takes any one
    assert not snap.capture_before_update(1, lock, capture, 16, lambda: resumed.append(1))
    assert not snap.capture_before_update(2, lock, capture, 16, lambda: resumed.append(2))
    assert resumed == []
    taken, from_update = snap.take(0, lock, capture)
    assert from_update
    snap.release(taken, from_update)  # the buffer empties: the oldest goes on
    assert resumed == [1]
    assert snap.capture_before_update(1, lock, capture, 16, lambda: resumed.append(1))
    assert not snap.take(2, lock, capture)[1]  # the writer captures stage 2 itself: its update has nothing to wait for
    assert resumed == [1, 2] and snap.capture_before_update(2, lock, capture, 16, lambda: resumed.append(-1))

    for end in (Snapshot.close, Snapshot.cancel):
        snap, resumed = snapshot(), []
        assert snap.capture_before_update(0, lock, capture, 16, lambda: resumed.append(0))
        assert not snap.capture_before_update(1, lock, capture, 16, lambda: resumed.append(1))
        end(snap)  # a write that ended (written or failed) or was cancelled parks no one
        assert resumed == [1] and snap.capture_before_update(1, lock, capture, 16, lambda: resumed.append(-1))
        assert 1 not in snap.captured


def test_a_parked_update_resumed_before_its_first_run_returns_completes_once() -> None:
    """Found by review: whether a run had parked was a flag on the task, so with two optimizer
    threads the resumed run could clear it before the first run's completion was read: the update
    was reported done twice (a version flipped before its update ran; the job's count of
    updating stages went to -1, and no snapshot was ever taken again), or never. Each run's own
    result says so now."""
    import threading

    from wstream.server.pool_tasks import PARKED
    from wstream.server.update_pool import UpdatePool

    pool = UpdatePool(2)
    resumed_done = threading.Event()

    class Task:
        runs = 0

        def run(self):  # type: ignore[no-untyped-def]
            Task.runs += 1
            if Task.runs == 1:  # parks, and is resumed at once, on the other thread
                pool.submit(self)  # type: ignore[arg-type]
                assert resumed_done.wait(10)
                return PARKED
            resumed_done.set()
            return self

    pool.submit(Task())  # type: ignore[arg-type]
    assert resumed_done.wait(10)
    pool.shutdown()  # joins both threads: every completion there will be is posted
    done = pool.drain()
    assert Task.runs == 2 and len(done) == 1 and done[0][1] is None, done


def test_a_failed_periodic_snapshot_is_tried_again_when_the_next_one_is_due(tmp_path: Path, monkeypatch) -> None:
    """Found by review: with ``--snapshot-every 10`` and a full disk, a snapshot was tried at every
    step after the first failure (32 tries, each cloning the whole state and logging an error, in
    30 steps where 3 were due). It is tried again when the next one is due."""
    import errno

    from wstream.server.inprocess import InProcessServer
    from wstream.server.snapshot import SnapshotStore

    tried: list[int] = []

    def disk_full(self: SnapshotStore, snap, stages):  # type: ignore[no-untyped-def]
        tried.append(snap.step)
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    srv = InProcessServer(bind=[f"ipc://{tmp_path / 's.sock'}"], memory_limit=2**30, store=str(tmp_path / "store"), snapshot_every=3)
    try:
        with Client(srv.address, timeout=30) as c:
            job = c.create_job("full", models.mixed(), optimizer=AdamW(lr=LR), token="t")
            monkeypatch.setattr(SnapshotStore, "write", disk_full)
            train(srv.address, "full", 10)
            assert job.wait_step(10) == 10
    finally:
        monkeypatch.undo()
        srv.stop()
    # at the first consistent step from each due one (3, 6, 9; a step later where a trainer ran ahead)
    assert 2 <= len(tried) <= 3 and all(b - a >= 3 for a, b in zip(tried, tried[1:])), tried


def test_an_empty_job_directory_that_cannot_be_removed_does_not_stop_the_start(tmp_path: Path, monkeypatch) -> None:
    """Found by review: an empty ``job-*`` directory whose removal failed (a mount point: EBUSY)
    stopped the server at start; the other leftovers' removal errors were already ignored."""
    import errno

    from wstream.server.snapshot import SnapshotStore

    store = SnapshotStore(tmp_path / "store", keep=1)
    (tmp_path / "store" / "job-x").mkdir()

    def busy(self: Path) -> None:
        raise OSError(errno.EBUSY, "Device or resource busy")

    monkeypatch.setattr(Path, "rmdir", busy)
    try:
        store.remove_partial()
    finally:
        store.close()
    assert (tmp_path / "store" / "job-x").is_dir()


def test_one_snapshot_is_under_way_at_a_time_so_one_buffer_bounds_the_clones(tmp_path: Path, monkeypatch) -> None:
    """Found by review: each job whose snapshot waited for the one writer held a buffer of clones
    of its own (6 jobs held 4x ``--snapshot-buffer``, outside the memory limit). A job's snapshot
    now starts when the writer is free, at the job's next consistent step; every save is answered."""
    import threading

    from wstream.server.inprocess import InProcessServer
    from wstream.server.snapshot import SnapshotStore

    gate, entered = threading.Event(), threading.Event()
    write = SnapshotStore.write

    def slow_write(self: SnapshotStore, snap, stages):  # type: ignore[no-untyped-def]
        if snap.record.name == "a" and snap.step == 1:
            entered.set()
            gate.wait(60)
        return write(self, snap, stages)

    monkeypatch.setattr(SnapshotStore, "write", slow_write)
    srv = InProcessServer(bind=[f"ipc://{tmp_path / 's.sock'}"], memory_limit=2**30, store=str(tmp_path / "store"))
    saved: dict[str, tuple[int, str]] = {}

    def save(name: str) -> None:
        with Client(srv.address, timeout=60) as other:
            saved[name] = other.attach_job(name, token="t").save()

    try:
        with Client(srv.address, timeout=60) as c:
            for name in ("a", "b"):
                c.create_job(name, models.mixed(), optimizer=AdamW(lr=LR), token="t")
                train(srv.address, name, 1)
            threads = [threading.Thread(target=save, args=("a",))]
            threads[0].start()
            assert entered.wait(60)
            threads.append(threading.Thread(target=save, args=("b",)))
            threads[1].start()
            train(srv.address, "b", 1)  # b trains on, its updates asking for its snapshot at each
            jobs = srv.server.jobs
            assert jobs["a"].snapshot is not None and jobs["b"].snapshot is None, "a second snapshot began during a write"
            gate.set()
            for t in threads:
                t.join(60)
            assert saved["a"][0] == 1 and saved["b"][0] == 2, saved
    finally:
        gate.set()
        srv.stop()


class _StubJob:
    """What the snapshot scheduler reads of a job, trained by hand (``step``; ``None``: mid-step)."""

    def __init__(self, name: str) -> None:
        import types

        self.name, self.snapshot, self.at = name, None, 0
        self.last_snapshot_step = self.last_snapshot_path = self.snapshot_failed_step = None
        self.record_changed = False
        self.schedule = types.SimpleNamespace(snapshot_seq=0)
        self.counters = types.SimpleNamespace(
            snapshots=types.SimpleNamespace(observe=lambda s: None), snapshot_bytes=0, snapshot_failures=0
        )

    def consistent_step(self) -> int | None:
        return self.at

    def record(self):  # type: ignore[no-untyped-def]
        import types

        return types.SimpleNamespace(name=self.name, schedule_seq=0)

    def snapshot_sources(self) -> list:
        return []

    def reads_previous(self, step: int) -> bool:
        return False


def _scheduler(tmp_path: Path, names: str):  # type: ignore[no-untyped-def]
    """A real ``SnapshotScheduler`` over stub jobs, whose writer is run by hand (``write()``)."""
    import types

    from wstream.server.config import ServerConfig
    from wstream.server.snapshot_scheduler import SnapshotScheduler

    jobs = {n: _StubJob(n) for n in names}
    outbox = types.SimpleNamespace(send=lambda *a: None, error=lambda *a: None)
    sched = SnapshotScheduler(None, ServerConfig(snapshot_every=1, store=str(tmp_path / "unused")), jobs, outbox)
    queue: list = []
    sched.store = types.SimpleNamespace(write=lambda snap, stages: f"/store/{snap.record.name}/{snap.step}", take_out=lambda name: None)
    sched._writer = types.SimpleNamespace(submit=lambda fn, *a: queue.append((fn, a)))

    def write() -> str:
        fn, args = queue.pop(0)
        fn(*args)
        sched.drain()
        return args[1].record.name

    return sched, jobs, write


def test_jobs_due_while_a_snapshot_is_written_take_turns(tmp_path: Path) -> None:
    """Found by review: with one snapshot at a time, the free writer went to the jobs in table
    order, so two jobs due at every write took it in alternation and a third (its saves, and a new
    job's creation snapshot that ``create_job`` waits for) never had it. Jobs take turns now."""
    from collections import Counter

    sched, jobs, write = _scheduler(tmp_path, "ABC")
    taken: Counter[str] = Counter()
    for _ in range(30):
        for j in jobs.values():  # each trains a step while the write runs, and asks at its end
            j.at += 1
            sched.maybe_snapshot(j)
        taken[write()] += 1
    assert taken == {"A": 10, "B": 10, "C": 10}, taken


def test_the_writer_waits_for_the_first_turns_job_in_the_middle_of_a_step(tmp_path: Path) -> None:
    """NOTE [One snapshot at a time] rule 3: the job whose turn it is may be mid-step when the
    writer frees; no other job starts meanwhile, and it starts at its next consistent step. A job
    dropped while its turn is first hands the turn on."""
    sched, jobs, write = _scheduler(tmp_path, "ABC")
    for j in jobs.values():
        j.at = 1
        sched.maybe_snapshot(j)  # A starts; B, then C, take turns
    assert sched._turns == ["B", "C"]
    jobs["B"].at = None  # B is mid-step when A's write ends
    assert write() == "A"
    assert all(j.snapshot is None for j in jobs.values()) and sched._turns == ["B", "C"]
    jobs["C"].at = 2
    sched.maybe_snapshot(jobs["C"])  # C asks at the end of its step: B's turn is first
    assert jobs["C"].snapshot is None
    jobs["B"].at = 2
    sched.maybe_snapshot(jobs["B"])  # B's updates end: its turn
    assert jobs["B"].snapshot is not None
    assert write() == "B" and jobs["C"].snapshot is not None  # then C's
    assert write() == "C"
    jobs["A"].at, jobs["C"].at = 3, 3
    sched.maybe_snapshot(jobs["A"])
    jobs["B"].at = None
    sched.maybe_snapshot(jobs["C"])
    assert sched._turns == ["C"]
    sched._turns.insert(0, "B")  # B's turn first, B mid-step, and then B is dropped
    write()
    assert jobs["C"].snapshot is None
    sched.forget(jobs.pop("B"), UnknownJobError("dropped"))  # type: ignore[arg-type]
    sched.job_left()
    assert jobs["C"].snapshot is not None
