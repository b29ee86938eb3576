"""A lone worker's step ring (``Join.step_ring``; NOTE [Held gradient slots] rule 5 in
server/step_commit.py): a slot per stage, every push held in place until its update, no gradient
copied on the server; granted only where it is safe and fits, else an ordinary ring."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
import zmq

import models
from conftest import ServerThread, run_workers
from test_equivalence import assert_weights_equal
from test_held_gradients import ADAMW, STAGES, STEPS, adamw_reference, counters, finish
from wstream.protocol import AdamW, GradientError
from wstream.protocol import messages as m
from wstream.protocol.layout import build_stage_spec
from wstream.protocol.shm import SegmentSpaceError, create_segment
from wstream.server import workers as workers_module
from wstream.server.job import Job
from wstream.server.memory import MemoryAccount
from wstream.server.pool_tasks import UpdateTask

SIZES = (10, 300, 7)  # stages of different sizes: each slot is its own stage's


def sealed_job(*, delayed: bool = False, sizes: tuple[int, ...] = SIZES) -> Job:
    options = m.JobOptions(optimizer=AdamW(lr=1e-3), delayed_update=delayed)
    created = m.CreateJob(name="ring", token="t", nonce=b"n" * 32, client_nonce=b"c" * 16, options=options)
    job = Job.create(created, MemoryAccount(2**30))
    for i, n in enumerate(sizes):
        spec = build_stage_spec(str(i), [("w", (n,))])
        job.add_stage(m.AddStage(session=b"s" * 16, index=i, spec=spec), [zmq.Frame(torch.zeros(spec.numel).numpy().tobytes())])
    job.seal()
    return job


def join(job: Job, session: bytes, **fields: object) -> object:
    w = job.join(session, m.Join(session=session, **{"shm": True, "step_ring": True, **fields}))  # type: ignore[arg-type]
    job.open_barrier(lambda task: None)
    return w


def test_a_lone_worker_gets_a_slot_per_stage_and_every_push_is_held() -> None:
    job = sealed_job()
    tasks: list[object] = []
    try:
        before = job.memory.used
        w = join(job, b"w" * 16)
        numels = [st.grad.numel() for st in job.stages]  # type: ignore[union-attr]
        assert [s.numel() for s in w.slots] == numels  # type: ignore[attr-defined]
        assert all(at % 64 == 0 for at in w.slot_offsets) and w.slot_offsets == sorted(w.slot_offsets)  # type: ignore[attr-defined]
        assert job.memory.used - before == w.grad_buffer.numel() >= 4 * sum(numels)  # type: ignore[attr-defined]
        for stage in reversed(range(len(SIZES))):  # a backward pass: every push held, nothing gathered
            w.slots[stage].fill_(float(stage + 1))  # type: ignore[attr-defined]
            job.push(m.Push(session=w.session, stage=stage, step=0, slot=stage, numel=numels[stage], sumsq=1.0),  # type: ignore[attr-defined]
                     [], b"id", w, tasks.append)  # type: ignore[arg-type]
            assert job.stages[stage].held is not None
        assert job.counters.held_gradients == len(SIZES) and w.held == {0, 1, 2}  # type: ignore[attr-defined]
        assert len(tasks) == len(SIZES) and all(isinstance(t, UpdateTask) for t in tasks)  # committed; no gather
        replies = finish(job, tasks)  # the commit's updates, read in place from the slots
        assert sorted(r.message.slot for r in replies if isinstance(r.message, m.Pushed)) == [0, 1, 2]  # type: ignore[attr-defined]
        assert job.step == 1 and not w.busy  # type: ignore[attr-defined]
        for stage, st in enumerate(job.stages):  # AdamW's first step moves every weight by lr
            assert torch.allclose(st.master[: SIZES[stage]], torch.full((SIZES[stage],), -1e-3))
    finally:
        job.close()


def test_a_step_ring_push_must_use_its_stage_slot() -> None:
    job = sealed_job()
    try:
        w = join(job, b"w" * 16)
        numel = job.stages[1].grad.numel()  # type: ignore[union-attr]
        with pytest.raises(GradientError, match="slot 0 of a step ring, whose slot 1 is this stage's"):
            job.push(m.Push(session=w.session, stage=1, step=0, slot=0, numel=numel, sumsq=1.0), [], b"id", w, lambda t: None)  # type: ignore[attr-defined]
    finally:
        job.close()


@pytest.mark.parametrize(
    "case", ["no room", "no room in /dev/shm", "two ranks", "not alone", "frames", "reader", "not asked"],
)
def test_an_ordinary_ring_where_a_step_ring_is_not_safe_or_does_not_fit(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = (1000, 1000, 1000)
    job = sealed_job(sizes=sizes)
    before = job.memory.used
    if case == "no room":  # the job and a 2-slot ring fit the limit, a ring of every stage does not
        job.memory.limit = job.memory.used + 10_000  # 2 slots of 4,032 bytes fit, 3 do not
    if case == "no room in /dev/shm":  # the account has room, the file system does not

        def create(nbytes: int) -> str:
            if nbytes > 10_000:
                raise SegmentSpaceError(errno.ENOSPC, f"/dev/shm is full, a segment of {nbytes} bytes does not fit")
            return create_segment(nbytes)

        monkeypatch.setattr(workers_module, "create_segment", create)
    try:
        if case == "not alone":
            join(job, b"a" * 16)
        fields: dict[str, object] = {"grad_slots": 2}
        fields.update({"two ranks": {"world_size": 2}, "frames": {"shm": False}, "reader": {"reader": True},
                       "not asked": {"step_ring": False}}.get(case, {}))
        w = join(job, b"w" * 16, **fields)
        assert w.slot_offsets == []  # type: ignore[attr-defined]
        assert len(w.slots) == (0 if case == "reader" else 2)  # type: ignore[attr-defined]
        if case.startswith("no room"):  # nothing of the refused step ring stays reserved
            assert job.memory.used - before == w.grad_buffer.numel() == 2 * 4032  # type: ignore[attr-defined]
    finally:
        job.close()


def test_a_second_worker_parks_the_step_ring_workers_pushes_and_the_sum_is_theirs() -> None:
    """The first worker keeps its step ring when a second joins (an ordinary ring); their pushes
    of a stage then park and sum (rule 4), read from the step ring's slot of that stage."""
    job = sealed_job()
    tasks: list[object] = []
    try:
        a = join(job, b"a" * 16)
        b = join(job, b"b" * 16, grad_slots=2)
        assert a.slot_offsets and not b.slot_offsets  # type: ignore[attr-defined]
        st = job.stages[1]
        numel = st.grad.numel()  # type: ignore[union-attr]
        a.slots[1][:numel].copy_(torch.arange(numel, dtype=torch.float32))  # type: ignore[attr-defined]
        b.slots[0][:numel].fill_(2.0)  # type: ignore[attr-defined]
        job.push(m.Push(session=a.session, stage=1, step=0, slot=1, numel=numel, sumsq=1.0), [], b"a-id", a, tasks.append)  # type: ignore[attr-defined]
        assert tasks == [] and set(st.parked) == {a.id} and st.held is None  # type: ignore[attr-defined]
        job.push(m.Push(session=b.session, stage=1, step=0, slot=0, numel=numel), [], b"b-id", b, tasks.append)  # type: ignore[attr-defined]
        finish(job, tasks)
        assert torch.equal(st.grad, torch.arange(numel, dtype=torch.float32) + 2.0)
    finally:
        job.close()


def test_a_worker_process_with_a_step_ring_trains_to_pytorch_and_holds_every_push(server: ServerThread, tmp_path: Path) -> None:
    """A real worker process (a CPU worker on the server's shared memory asks for a step ring by
    default): every gradient of every step read in place, the weights plain PyTorch's."""
    from wstream.client import Client

    with Client(server.address, timeout=30) as c:
        job = c.create_job("ring-proc", models.mixed(), optimizer=ADAMW, token="t", unit_bytes=None)
        run_workers(server.address, "ring-proc", "t", "mixed", STEPS, 1, tmp_path)
        got = job.state_dict()
    want, _ = adamw_reference()
    assert_weights_equal(got, want, atol=1e-6)
    assert counters(server, "ring-proc").held_gradients == STAGES * STEPS


def test_the_trainer_stats_say_which_ring(client: object) -> None:
    job = client.create_job("ring-stats", models.mixed(), optimizer=ADAMW, token="t", unit_bytes=None)  # type: ignore[attr-defined]
    for step_ring, want in ((None, f"a step ring of {STAGES} slots"), (False, "a ring of 2 slots")):
        with job.trainer(step_ring=step_ring) as trainer:
            st = trainer.stats()
            assert st.step_ring == (step_ring is None) and want in str(st)


def test_a_trainer_closed_half_way_through_a_step_leaves_at_once_and_nothing_is_applied(client: object) -> None:
    """A held push's reply comes only with its update, which a step never committed never runs:
    ``close()`` does not wait for it; the server discards the step when the worker leaves."""
    import threading

    job = client.create_job("ring-half", models.mixed(), optimizer=ADAMW, token="t", unit_bytes=None)  # type: ignore[attr-defined]
    start = job.state_dict()
    trainer = job.trainer()
    assert trainer.connection.step_ring
    pusher = trainer.connection.pusher
    pusher.push(4, 0, trainer.executor.runners[4].spec, [torch.ones(5, 48)])  # held: the last stage of step 0
    assert pusher.uncommitted()
    closer = threading.Thread(target=trainer.close, daemon=True)
    closer.start()
    closer.join(120)  # a hang guard, not a timing: close() waiting for the held push would never end
    assert not closer.is_alive(), "close() waits for a push of a step that never commits"
    assert all(torch.equal(t, start[k]) for k, t in job.state_dict().items())  # nothing of step 0 applied
    with job.trainer() as again:  # the step is open again for the next worker
        again.step(*models.batch("mixed", 0), models.loss_fn)
        assert again.stats().steps == 1
