"""A job dropped in any state answers every request that waits on it, at once, and leaves no shared
memory behind; the server serves its other jobs on.

The in-process server (the very same handlers) runs with a store. Its slow parts are held at will
by gates: a gradient's gather, a stage's update, a snapshot's write. Each test brings the victim
job into one state with requests of every kind it can have outstanding there (sent on a raw
socket, not waited for), drops it, and asserts:

* every outstanding request is answered ``unknown_job`` before the drop's own ``ok`` is followed
  by anything else, within the deadline;
* once the gates open and the held work ends, no request gets a second answer;
* the job's shared-memory segments are gone (the server's segments are those of before it);
* a job beside it trains on to exactly plain PyTorch's weights.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq
from torch import nn

from wstream.client import AdamW, Client
from wstream.client.job_handle import Job as ClientJob
from wstream.client.trainer import Trainer
from wstream.protocol import decode_reply, encode
from wstream.protocol import messages as m
from wstream.client.channel import client_nonce
from wstream.client.stages import flatten, spec_of
from wstream.protocol.auth import SessionSigner, secret_key, session_key
from wstream.protocol.frames import tensor_frames
from wstream.protocol.shm import segment_paths
from wstream.server.inprocess import InProcessServer
from wstream.server.snapshot import SnapshotStore
from wstream.server.pool_tasks import GatherTask, UpdateTask

DEADLINE_S = 20.0
"""Time a reply may take on a loaded 2-core machine; a reply that never comes fails the test."""

OPTIMIZER = AdamW(lr=1e-2)


def victim_model() -> list[nn.Module]:
    torch.manual_seed(3)
    return [nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 2)]


class Gate:
    """Holds every call of ``owner.name`` (on whatever thread) while shut; ``entered`` is set by
    the first held call, ``idle`` when no call is inside."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, owner: type, name: str) -> None:
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Event()
        self.inside = 0
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        original = getattr(owner, name)
        gate = self

        def held(*args: Any, **kwargs: Any) -> Any:
            with gate.lock:
                gate.inside += 1
            try:
                if not gate.open.is_set():
                    gate.entered.set()
                    assert gate.open.wait(120), "a gate was never opened"
                return original(*args, **kwargs)
            finally:
                with gate.lock:
                    gate.inside -= 1
                    gate.idle.notify_all()

        monkeypatch.setattr(owner, name, held)

    def shut(self) -> None:
        self.entered.clear()
        self.open.clear()

    def wait_entered(self) -> None:
        assert self.entered.wait(DEADLINE_S), "the held work never started"

    def release(self) -> None:
        """Open the gate and wait until every held call has returned."""
        self.open.set()
        with self.lock:
            assert self.idle.wait_for(lambda: self.inside == 0, DEADLINE_S), "held work did not end"


class Wire:
    """Requests on one DEALER socket, sent without waiting; replies collected by request id."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(address)
        self.next_id = 0
        self.replies: dict[int, list[m.Message]] = {}
        self.sent: dict[int, str] = {}

    def send(self, msg: m.Message, frames: list[Any] | None = None, signer: SessionSigner | None = None) -> int:
        self.next_id += 1
        frames = list(frames or [])
        msg = msgspec.structs.replace(msg, id=self.next_id)
        if "nframes" in msg.__struct_fields__:
            msg = msgspec.structs.replace(msg, nframes=len(frames))  # type: ignore[call-arg]
        if signer is not None:
            msg = signer.sign(msg)
        self.sock.send_multipart([encode(msg), *frames])
        self.sent[self.next_id] = m.op_of(type(msg))
        return self.next_id

    def collect(self, until: Callable[[], bool], deadline_s: float = DEADLINE_S) -> None:
        deadline = time.monotonic() + deadline_s
        while not until():
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                missing = {i: op for i, op in self.sent.items() if i not in self.replies}
                raise AssertionError(f"no answer within {deadline_s:g} s to {missing}")
            reply = decode_reply(self.sock.recv_multipart()[0])
            self.replies.setdefault(reply.id, []).append(reply)

    def call(self, msg: m.Message, frames: list[Any] | None = None, signer: SessionSigner | None = None) -> m.Message:
        rid = self.send(msg, frames, signer)
        self.collect(lambda: rid in self.replies)
        return self.replies[rid][0]

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


class Scene:
    """The server, its gates, a job trained beside the victim, and the wire the victim's requests go on."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gather = Gate(monkeypatch, GatherTask, "run")
        self.update = Gate(monkeypatch, UpdateTask, "run")
        self.write = Gate(monkeypatch, SnapshotStore, "write")
        self.srv = InProcessServer(bind=[f"ipc://{tmp_path / 's.sock'}"], memory_limit=2**30, store=str(tmp_path / "store"))
        self.client = Client(self.srv.address, timeout=30)
        torch.manual_seed(7)
        self.bystander_model = [nn.Linear(5, 7), nn.Linear(7, 3)]
        self.bystander_reference = copy.deepcopy(self.bystander_model)
        self.bystander = self.client.create_job("bystander", self.bystander_model, token="b", optimizer=OPTIMIZER)
        self.segments_before = set(segment_paths(os.getpid()))
        self.wire = Wire(self.srv.address)
        self.trainers: list[Trainer] = []

    def victim(self, **options: Any) -> ClientJob:
        # unit_bytes=None: the test sends its pushes, fetches and pulls by hand, one per chain stage
        return self.client.create_job("victim", victim_model(), token="v", optimizer=OPTIMIZER, unit_bytes=None, **options)

    def worker(self, job: ClientJob) -> tuple[Trainer, SessionSigner]:
        """An idle worker of ``job`` whose requests the test sends by hand (as the fuzzer does)."""
        trainer = job.trainer(shm=True, prefetch=0, step_ring=False)  # its pushes go to slots the test picks
        self.trainers.append(trainer)
        return trainer, trainer.connection.sc.signer

    def drop(self, session: bytes, signer: SessionSigner, waiting: list[int]) -> None:
        """Drop the victim; every request of ``waiting`` must be answered ``unknown_job``, and none
        before the drop (they were waiting)."""
        for rid in waiting:
            assert rid not in self.wire.replies, f"{self.wire.sent[rid]} answered before the drop: {self.wire.replies[rid]}"
        dropped = self.wire.send(m.DropJob(session=session), signer=signer)
        self.wire.collect(lambda: all(i in self.wire.replies for i in [*waiting, dropped]))
        assert isinstance(self.wire.replies[dropped][0], m.Ok), self.wire.replies[dropped]
        for rid in waiting:
            (reply,) = self.wire.replies[rid]
            what = self.wire.sent[rid]
            assert isinstance(reply, m.Error) and reply.code == "unknown_job", f"{what}: {reply!r}"
            assert "'victim' was dropped" in reply.message, f"{what}: {reply.message}"

    def after(self) -> None:
        """Release the held work; then no second answer, no segment of the victim, and the bystander
        trains to plain PyTorch's weights."""
        for gate in (self.gather, self.update, self.write):
            gate.release()
        barrier = self.wire.send(m.Status())
        self.wire.collect(lambda: barrier in self.wire.replies)
        doubled = {self.wire.sent[i]: r for i, r in self.wire.replies.items() if len(r) > 1}
        assert not doubled, f"requests answered twice: {doubled}"
        assert set(segment_paths(os.getpid())) == self.segments_before, "the dropped job left shared memory behind"
        assert "victim" not in {j.name for j in self.client.status().jobs}
        self.train_bystander()

    def train_bystander(self) -> None:
        torch.manual_seed(11)
        x, y = torch.randn(4, 5), torch.randn(4, 3)
        reference = nn.Sequential(*self.bystander_reference)
        opt = torch.optim.AdamW(reference.parameters(), lr=OPTIMIZER.lr)
        with self.bystander.trainer(shm=True) as tr:
            for _ in range(2):
                tr.step(x, y, nn.functional.mse_loss)
                opt.zero_grad()
                nn.functional.mse_loss(reference(x), y).backward()
                opt.step()
        for i in range(len(reference)):
            got = self.bystander.pull_stage(i)
            for name, want in reference[i].state_dict().items():
                torch.testing.assert_close(got[name], want, rtol=1e-6, atol=1e-6)

    def close(self) -> None:
        quiet = logging.getLogger("wstream.client")
        level = quiet.level
        quiet.setLevel(logging.CRITICAL)  # the victim's trainers cannot leave a dropped job
        try:
            for tr in self.trainers:
                tr.close()
        finally:
            quiet.setLevel(level)
        for gate in (self.gather, self.update, self.write):
            gate.open.set()
        self.wire.close()
        self.client.close()
        self.srv.stop()


@pytest.fixture
def scene(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Scene]:
    s = Scene(tmp_path, monkeypatch)
    try:
        yield s
    finally:
        s.close()


def push(scene: Scene, trainer: Trainer, signer: SessionSigner, job: ClientJob, stage: int, step: int) -> int:
    """Send the worker's gradient of ``stage`` (whatever its ring slot 0 holds); not waited for."""
    return scene.wire.send(
        m.Push(session=trainer.session, stage=stage, step=step, slot=0, numel=job.specs[stage].numel), signer=signer
    )


def push_all(
    scene: Scene, trainer: Trainer, signer: SessionSigner, job: ClientJob, step: int, *, hold_updates: bool = False
) -> None:
    """Push every stage of ``step``, last stage first, each answered ``pushed`` before the next
    (the last one's gather commits the step). ``hold_updates``: the updates wait at their gate."""
    for stage in reversed(range(len(job.specs))):
        if stage == 0 and hold_updates:
            scene.update.shut()
        rid = push(scene, trainer, signer, job, stage, step)
        scene.wire.collect(lambda: rid in scene.wire.replies)
        assert isinstance(scene.wire.replies[rid][0], m.Pushed), scene.wire.replies[rid]


def commit_with_updates_held(scene: Scene, trainer: Trainer, signer: SessionSigner, job: ClientJob) -> None:
    """Step 0 pushed and committed by hand, its updates held at the gate (one has entered it)."""
    push_all(scene, trainer, signer, job, 0, hold_updates=True)
    committed = scene.wire.call(m.Commit(session=trainer.session, step=0), signer=signer)
    assert isinstance(committed, m.Committed), committed
    scene.update.wait_entered()


def train_one_step(scene: Scene, trainer: Trainer, signer: SessionSigner, job: ClientJob) -> None:
    """Step 0 pushed and committed by hand, and every stage's update to step 1 ended (its weights
    fetched)."""
    push_all(scene, trainer, signer, job, 0)
    committed = scene.wire.call(m.Commit(session=trainer.session, step=0), signer=signer)
    assert isinstance(committed, m.Committed), committed
    for stage in range(len(job.specs)):
        fetched = scene.wire.call(m.Fetch(session=trainer.session, stage=stage, step=1), signer=signer)
        assert isinstance(fetched, m.Weights), fetched


def create_by_hand(scene: Scene, stages: list[nn.Module]) -> tuple[bytes, SessionSigner]:
    """``create_job`` of the victim and its stages, not sealed: its session and signer."""
    wire = scene.wire
    challenge = wire.call(m.Hello())
    assert isinstance(challenge, m.Challenge)
    mine = client_nonce()
    options = m.JobOptions(optimizer=OPTIMIZER)
    created = wire.call(m.CreateJob(name="victim", token="v", nonce=challenge.nonce, client_nonce=mine, options=options))
    assert isinstance(created, m.Attached), created
    signer = SessionSigner(created.session, session_key(secret_key("v"), challenge.nonce, mine))
    for i, module in enumerate(stages):
        spec = spec_of(i, module)
        ok = wire.call(m.AddStage(session=created.session, index=i, spec=spec), tensor_frames(flatten(module, spec)), signer)
        assert isinstance(ok, m.Ok), ok
    return created.session, signer


def test_drop_while_its_creation_is_being_written_answers_the_seal(scene: Scene) -> None:
    """Sealed, its creation snapshot being written: the ``seal`` waits for it to be durable."""
    session, signer = create_by_hand(scene, victim_model())
    scene.write.shut()
    sealing = scene.wire.send(m.Seal(session=session), signer=signer)
    scene.write.wait_entered()
    scene.drop(session, signer, [sealing])
    scene.after()


def test_drop_while_a_save_is_being_written_answers_every_save(scene: Scene) -> None:
    """A snapshot being written with its ``save`` waiting, and a second ``save`` queued behind it."""
    job = scene.victim()
    a, sign_a = scene.worker(job)
    train_one_step(scene, a, sign_a, job)  # a step newer than the creation snapshot
    scene.write.shut()
    first = scene.wire.send(m.Save(session=job.session), signer=job._signer)
    scene.write.wait_entered()
    second = scene.wire.send(m.Save(session=job.session), signer=job._signer)
    scene.drop(job.session, job._signer, [first, second])
    scene.after()


def test_drop_mid_step_answers_pushes_fetches_and_commits(scene: Scene) -> None:
    """Two workers; pushes being gathered, a held commit, fetches of the next step deferred."""
    job = scene.victim()
    a, sign_a = scene.worker(job)
    b, sign_b = scene.worker(job)
    scene.gather.shut()
    pushes = [push(scene, a, sign_a, job, 2, 0), push(scene, b, sign_b, job, 2, 0)]
    scene.gather.wait_entered()
    commit = scene.wire.send(m.Commit(session=b.session, step=0), signer=sign_b)
    fetches = [scene.wire.send(m.Fetch(session=w.session, stage=0, step=1), signer=s) for w, s in ((a, sign_a), (b, sign_b))]
    scene.drop(job.session, job._signer, [*pushes, commit, *fetches])
    scene.after()


def test_drop_while_updates_run_answers_fetches_pulls_saves_and_step_waits(scene: Scene) -> None:
    """A step committed, its updates running: fetches of the next step, a pull, a save and an
    ``await_step`` of the step wait."""
    job = scene.victim()
    a, sign_a = scene.worker(job)
    commit_with_updates_held(scene, a, sign_a, job)
    fetch = scene.wire.send(m.Fetch(session=a.session, stage=0, step=1), signer=sign_a)
    pull = scene.wire.send(m.Pull(session=job.session, stage=0), signer=job._signer)
    save = scene.wire.send(m.Save(session=job.session), signer=job._signer)
    reached = scene.wire.send(m.AwaitStep(session=job.session, step=1), signer=job._signer)
    scene.drop(job.session, job._signer, [fetch, pull, save, reached])
    scene.after()


def test_drop_with_early_pushes_held_by_a_delayed_job_answers_them(scene: Scene) -> None:
    """A delayed-update job holds a push that comes for the step after the open one."""
    job = scene.victim(delayed_update=True)
    a, sign_a = scene.worker(job)
    commit_with_updates_held(scene, a, sign_a, job)
    early = push(scene, a, sign_a, job, 2, 1)
    commit = scene.wire.send(m.Commit(session=a.session, step=1), signer=sign_a)
    scene.drop(job.session, job._signer, [early, commit])
    scene.after()


def test_drop_of_a_job_being_created_frees_its_memory(scene: Scene) -> None:
    """Not sealed yet (stages uploaded): nothing waits, and its room and segment go."""
    session, signer = create_by_hand(scene, victim_model()[:1])
    scene.drop(session, signer, [])
    scene.after()
