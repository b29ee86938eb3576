"""A lone worker's gradient is read in place from its slot by the stage's update (NOTE [Held
gradient slots] in server/step_commit.py): the path is taken where holding cannot block the worker, and
the weights are those of plain PyTorch (AdamW, global-norm clipping, a schedule), as through the
gather; several workers' gradients are still gathered into their mean."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import zmq

import models
from conftest import ServerThread, run_workers
from test_drop import Scene, commit_with_updates_held, push
from test_equivalence import assert_weights_equal
from test_recipe import ADAMW, CLIP, STEPS, cosine_factor, reference
from wstream.client import Client
from wstream.protocol import AdamW, GradientError
from wstream.protocol import messages as m
from wstream.protocol.grad_norm import squared_norm
from wstream.protocol.layout import build_stage_spec
from wstream.server.job import Job
from wstream.server.memory import MemoryAccount

STAGES = len(models.mixed())


def counters(server: ServerThread, name: str):  # noqa: ANN201 - the server's JobCounters
    return server.inprocess.server.jobs[name].counters


def adamw_reference(ranks: int = 1) -> tuple[dict[str, torch.Tensor], list[float]]:
    want, norms, _ = reference(
        models.mixed(), lambda p: torch.optim.AdamW(p, lr=3e-2, weight_decay=0.05), cosine_factor(3, 10, 0.1), CLIP,
        STEPS, ranks=ranks,
    )
    return want, norms


@pytest.mark.parametrize(
    ("grad_slots", "step_ring", "held_per_step"),
    [(1, False, 1), (2, False, 2), (STAGES, False, STAGES), (8, False, STAGES), (2, None, STAGES)],
)
@pytest.mark.parametrize("shm", [True, False])
def test_a_lone_worker_is_read_in_place_and_equals_pytorch_with_clipping(
    client: Client, server: ServerThread, grad_slots: int, step_ring: bool | None, held_per_step: int, shm: bool
) -> None:
    """Held: the step's last ``grad_slots`` pushes (with one slot, the last alone: it needs none
    after it); the others are gathered with the worker's norm. A CPU worker on shared memory asks
    for a step ring by default (rule 5): every push held. Same weights every way."""
    if step_ring is None and not shm:
        held_per_step = grad_slots  # data frames: no shared ring, so no step ring
    job = client.create_job("held", models.mixed(), optimizer=ADAMW, token="t", unit_bytes=None)  # counts per chain stage
    norms = []
    with job.trainer(grad_slots=grad_slots, shm=shm, step_ring=step_ring) as trainer:
        assert trainer.connection.step_ring == (shm and step_ring is None)
        for s in range(STEPS):
            trainer.step(*models.batch("mixed", s), models.loss_fn)
            norms.append(trainer.stats().grad_norm)
    want, want_norms = adamw_reference()
    assert_weights_equal(job.state_dict(), want, atol=1e-6)
    assert norms == pytest.approx(want_norms, rel=1e-5)
    assert sum(n > CLIP for n in want_norms) >= 3  # clipping happened
    c = counters(server, "held")
    assert c.gradients == STAGES * STEPS
    assert c.held_gradients == held_per_step * STEPS


def test_bfloat16_weights_are_the_same_held_or_gathered(client: Client, server: ServerThread) -> None:
    """A bf16 job (fp32 master, the update casts it into the published slot): every push held and
    all but one gathered give bit-identical masters (the same gradient, the same norm floats)."""
    got = {}
    for slots in (1, 8):
        name = f"bf16-{slots}"
        job = client.create_job(name, models.mixed(), optimizer=ADAMW, token="t", dtype="bfloat16", unit_bytes=None)  # held per stage
        with job.trainer(grad_slots=slots, step_ring=slots == 8) as trainer:  # 8: the step ring
            for s in range(STEPS):
                trainer.step(*models.batch("mixed", s), models.loss_fn)
        got[slots] = job.state_dict()
        assert counters(server, name).held_gradients == (1 if slots == 1 else STAGES) * STEPS
    assert got[1].keys() == got[8].keys()
    for k in got[1]:
        assert torch.equal(got[1][k], got[8][k]), k
    initial = torch.nn.Sequential(*models.mixed()).state_dict()
    assert max((got[8][k] - initial[k]).abs().max().item() for k in initial) > 1e-3  # it trained


def test_two_workers_are_gathered_into_their_mean(server: ServerThread, tmp_path: Path) -> None:
    with Client(server.address, timeout=30) as c:
        job = c.create_job("held-dp", models.mixed(), optimizer=ADAMW, token="t", unit_bytes=None)  # counts per chain stage
        run_workers(server.address, "held-dp", "t", "mixed", STEPS, 2, tmp_path)
        got = job.state_dict()
    want, _ = adamw_reference(ranks=2)
    assert_weights_equal(got, want, atol=1e-6)
    assert counters(server, "held-dp").held_gradients == 0
    assert counters(server, "held-dp").gradients == 2 * STAGES * STEPS


@pytest.mark.parametrize("step_ring", [False, None])
def test_a_delayed_job_is_gathered_unless_its_worker_has_a_step_ring(
    client: Client, server: ServerThread, step_ring: bool | None
) -> None:
    """Rule 1: an ordinary ring's pushes of a delayed job are gathered, however many slots; rule
    5: a step ring's are all held (its slots free in the order the next step pushes)."""
    name = f"held-delayed-{step_ring}"
    job = client.create_job(name, models.mixed(), optimizer=ADAMW, token="t", delayed_update=True, unit_bytes=None)
    with job.trainer(grad_slots=8, step_ring=step_ring) as trainer:
        for s in range(3):
            trainer.step(*models.batch("mixed", s), models.loss_fn)
    assert counters(server, name).held_gradients == (0 if step_ring is False else 3 * STAGES)


# ---- the job's rules, without a worker process -------------------------------------------------------


def joined_job(stages: int, sessions: tuple[bytes, ...], slots: int, name: str = "j") -> Job:
    """A sealed job of ``stages`` one-parameter stages with a joined worker of ``slots`` slots per session."""
    created = m.CreateJob(name=name, token="t", nonce=b"n" * 32, client_nonce=b"c" * 16, options=m.JobOptions(optimizer=AdamW(lr=1e-3)))
    job = Job.create(created, MemoryAccount(2**30))
    for i in range(stages):
        spec = build_stage_spec(str(i), [("w", (10,))])
        job.add_stage(m.AddStage(session=b"s" * 16, index=i, spec=spec), [zmq.Frame(torch.zeros(spec.numel).numpy().tobytes())])
    job.seal()
    for session in sessions:
        job.join(session, m.Join(session=session, shm=True, grad_slots=slots))
    job.open_barrier(lambda task: None)
    return job


def lone_job(stages: int, slots: int) -> tuple[Job, list[m.Push], list[object]]:
    """A sealed one-stage-per-``stages`` job with one joined worker of ``slots`` slots."""
    return joined_job(stages, (b"w" * 16,), slots), [], []


def test_a_push_without_its_norm_is_gathered_and_a_negative_norm_is_refused() -> None:
    job, _, _ = lone_job(2, 4)
    tasks: list[object] = []
    try:
        w = job.worker_of(b"w" * 16)
        numel = job.stages[1].grad.numel()  # type: ignore[union-attr]
        with pytest.raises(GradientError, match="negative|never negative"):
            job.push(m.Push(session=w.session, stage=1, step=0, slot=0, numel=numel, sumsq=-1.0), [], b"id", w, tasks.append)
        job.push(m.Push(session=w.session, stage=1, step=0, slot=0, numel=numel), [], b"id", w, tasks.append)
        assert len(tasks) == 1 and job.stages[1].held is None  # a gather: no norm came with it
        job.push(m.Push(session=w.session, stage=0, step=0, slot=1, numel=numel, sumsq=4.0), [], b"id", w, tasks.append)
        assert len(tasks) == 1 and job.stages[0].held is not None and w.held == {1}
        assert job.counters.held_gradients == 1
    finally:
        job.close()


def test_holding_never_leaves_the_worker_without_a_slot_for_the_rest_of_its_step() -> None:
    """Rule 2: with 2 slots and 5 stages pushed last to first, only the last two are held."""
    job, _, _ = lone_job(5, 2)
    tasks: list[object] = []
    try:
        w = job.worker_of(b"w" * 16)
        numel = job.stages[0].grad.numel()  # type: ignore[union-attr]
        held = []
        for k, stage in enumerate(range(4, -1, -1)):
            slot = next(s for s in range(2) if s not in w.busy)
            job.push(m.Push(session=w.session, stage=stage, step=0, slot=slot, numel=numel, sumsq=1.0), [], b"id", w, tasks.append)
            held.append(job.stages[stage].held is not None)
            for t in tasks:  # the gathers complete at once here
                t.run()  # type: ignore[attr-defined]
                job.finish_task(t, None, tasks.append)  # type: ignore[arg-type]
            tasks.clear()
            assert len(w.busy) - len(w.held) == 0 and len(w.held) <= 2
        assert held == [False, False, False, True, True]
    finally:
        job.close()


def two_worker_job(stages: int) -> tuple[Job, list[object]]:
    """A sealed job of ``stages`` one-parameter stages with two joined workers of 2 slots each."""
    return joined_job(stages, (b"a" * 16, b"b" * 16), 2, name="j2"), []


def finish(job: Job, tasks: list[object]) -> list[object]:
    """Run the queued pool tasks as the pool would and return the replies."""
    out: list[object] = []
    while tasks:
        t = tasks.pop(0)
        t.run()  # type: ignore[attr-defined]
        out += job.finish_task(t, None, tasks.append)  # type: ignore[arg-type]
    return out


def test_two_workers_pushes_are_parked_and_summed_in_one_gather() -> None:
    """Rule 4: the first push of a stage waits in its slot; the last one gathers both in one task,
    whose sum and norm are the two gradients'."""
    job, tasks = two_worker_job(2)
    try:
        a, b = job.worker_of(b"a" * 16), job.worker_of(b"b" * 16)
        st = job.stages[1]
        numel = st.grad.numel()  # type: ignore[union-attr]
        a.slots[0][:numel].copy_(torch.arange(numel, dtype=torch.float32))
        b.slots[1][:numel].copy_(torch.full((numel,), 2.0))
        job.push(m.Push(session=a.session, stage=1, step=0, slot=0, numel=numel), [], b"a-id", a, tasks.append)
        assert tasks == [] and set(st.parked) == {a.id} and 0 in a.busy  # parked: no copy, its slot kept
        job.push(m.Push(session=b.session, stage=1, step=0, slot=1, numel=numel), [], b"b-id", b, tasks.append)
        assert len(tasks) == 1 and tasks[0].workers == (a.id, b.id) and st.parked == {}  # type: ignore[attr-defined]
        replies = finish(job, tasks)
        assert sorted(r.identity for r in replies) == [b"a-id", b"b-id"]  # type: ignore[attr-defined]
        assert all(isinstance(r.message, m.Pushed) for r in replies)  # type: ignore[attr-defined]
        want = torch.arange(numel, dtype=torch.float32) + 2.0
        assert torch.equal(st.grad, want) and st.gathered == {a.id, b.id}
        assert st.sumsq is not None and st.sumsq[1:] == (2, squared_norm(want))
        assert 0 not in a.busy and 1 not in b.busy
    finally:
        job.close()


def three_workers_step(order: str) -> torch.Tensor:
    """The master after one step of a one-stage job whose three workers push ``a``, ``b`` and ``c``
    (1, 2^-24 and -1 in every element: (a + b) + c is 0 in fp32, (a + c) + b is 2^-24) in ``order``."""
    sessions = {w: w.encode() * 16 for w in "abc"}
    job = joined_job(1, tuple(sessions.values()), 2, name="j3")
    tasks: list[object] = []
    try:
        numel = job.stages[0].grad.numel()  # type: ignore[union-attr]
        values = {"a": 1.0, "b": 2.0**-24, "c": -1.0}
        workers = {w: job.worker_of(sid) for w, sid in sessions.items()}
        for w in order:
            worker = workers[w]
            worker.slots[0][:numel].fill_(values[w])
            sumsq = squared_norm(worker.slots[0][:numel])
            push = m.Push(session=worker.session, stage=0, step=0, slot=0, numel=numel, sumsq=sumsq)
            job.push(push, [], f"{w}-push".encode(), worker, tasks.append)
        finish(job, tasks)
        for w, worker in workers.items():
            job.commit(m.Commit(session=worker.session, step=0), f"{w}-commit".encode(), worker)
        finish(job, tasks)
        assert job.step == 1
        return job.stages[0].master.clone()
    finally:
        job.close()


def test_three_workers_gradients_are_summed_in_an_order_of_their_values_not_of_their_arrival() -> None:
    """Found by review: three or more workers' gradients were summed in the order they arrived,
    so two runs on the same data could differ in the last bit (5.96e-8 after 10 steps), and a run
    with a worker restarted was not the run without it bit for bit (DESIGN.md's promise); two
    workers were exact only because a + b == b + a. The parked pushes are now summed in an order
    of their values (their norms, then their elements), so the sum is a function of the workers'
    gradients, not of when each came."""
    masters = {order: three_workers_step(order) for order in ("abc", "cab", "bca", "acb")}
    first = masters["abc"]
    assert all(torch.equal(first, other) for other in masters.values()), masters


def test_a_parked_push_is_gathered_when_its_partner_leaves_having_pushed_nothing() -> None:
    job, tasks = two_worker_job(1)
    try:
        a, b = job.worker_of(b"a" * 16), job.worker_of(b"b" * 16)
        numel = job.stages[0].grad.numel()  # type: ignore[union-attr]
        a.slots[0][:numel].fill_(3.0)
        job.push(m.Push(session=a.session, stage=0, step=0, slot=0, numel=numel), [], b"a-id", a, tasks.append)
        assert tasks == []
        job.remove_worker(b.id, tasks.append, lambda wid, why: None, "its lease ended")
        replies = finish(job, tasks)  # the gather of a's gradient alone, then the commit's update
        assert [r.identity for r in replies if isinstance(r.message, m.Pushed)] == [b"a-id"]  # type: ignore[attr-defined]
        assert job.step == 1 and torch.equal(job.stages[0].master, torch.full((numel,), -1e-3))
    finally:
        job.close()


def test_a_held_push_is_answered_when_its_worker_left_after_the_commit(held: Scene) -> None:
    """Every request gets one answer: the held push's update runs after its worker left (the step
    committed), and the push is still answered ``pushed`` (it was answered nothing)."""
    job = held.victim()
    a, sign_a = held.worker(job)
    last = len(job.specs) - 1
    for stage in range(last, 0, -1):  # gathered (no norm with them)
        rid = push(held, a, sign_a, job, stage, 0)
        held.wire.collect(lambda: rid in held.wire.replies)
        assert isinstance(held.wire.replies[rid][0], m.Pushed), held.wire.replies[rid]
    held.update.shut()
    kept = held.wire.send(m.Push(session=a.session, stage=0, step=0, slot=0, numel=job.specs[0].numel, sumsq=1.0), signer=sign_a)
    committed = held.wire.call(m.Commit(session=a.session, step=0), signer=sign_a)  # the held push completed the step
    assert isinstance(committed, m.Committed), committed
    held.update.wait_entered()
    assert held.srv.server.jobs["victim"].stages[0].held is not None and kept not in held.wire.replies
    left = held.wire.call(m.Leave(session=a.session), signer=sign_a)
    assert isinstance(left, m.Ok), left
    held.update.release()
    held.wire.collect(lambda: kept in held.wire.replies)
    (reply,) = held.wire.replies[kept]
    assert isinstance(reply, m.Pushed) and (reply.stage, reply.step) == (0, 0), reply
    assert job.wait_step(1) == 1


def test_a_deferred_fetch_is_answered_when_its_worker_leaves(held: Scene) -> None:
    """A fetch of step 1 waits for its stage's update of step 0. Its worker leaves meanwhile: the
    fetch is answered then (``session_expired``), once, and the update, released later, answers
    nothing more (defect seen: it stayed queued, unanswered, until the stage reached the step, and
    was then answered to a session that was gone)."""
    job = held.victim()
    a, sign_a = held.worker(job)
    commit_with_updates_held(held, a, sign_a, job)
    waiting = held.wire.send(m.Fetch(session=a.session, stage=1, step=1), signer=sign_a)
    barrier = held.wire.send(m.Status())
    held.wire.collect(lambda: barrier in held.wire.replies)
    assert waiting not in held.wire.replies, held.wire.replies[waiting]  # deferred: stage 1 is updating
    left = held.wire.call(m.Leave(session=a.session), signer=sign_a)
    assert isinstance(left, m.Ok), left
    held.wire.collect(lambda: waiting in held.wire.replies)
    (reply,) = held.wire.replies[waiting]
    assert isinstance(reply, m.Error) and reply.code == "session_expired", reply
    assert "detached" in reply.message and "stage 1" in reply.message, reply.message
    held.update.release()
    assert job.wait_step(1) == 1
    barrier = held.wire.send(m.Status())
    held.wire.collect(lambda: barrier in held.wire.replies)
    assert len(held.wire.replies[waiting]) == 1, held.wire.replies[waiting]


@pytest.mark.parametrize("with_norm", [True, False])
def test_gradient_slots_hold_a_push_longer_than_its_stage(with_norm: bool) -> None:
    """A stage whose parameters are not aligned (a raw client's spec may lay them back to back) has
    a push layout longer than the stage itself: each trained parameter's gradient starts aligned.
    The worker's slots must hold it (defect seen: slots of the stage's size, a held push's update
    failed on a gradient cut short and the stage never reached step 1; without the norm the gather
    answered ``internal``)."""
    from wstream.protocol.layout import push_layout

    spec = m.StageSpec(
        name="s0", numel=3,
        params=[m.ParamSpec("a", (1,), 0), m.ParamSpec("f", (1,), 1, 0, True), m.ParamSpec("c", (1,), 2)],
    )
    numel = push_layout(spec).numel
    assert numel > spec.numel  # the case: the gradient of "c" starts aligned, past the stage's end
    created = m.CreateJob(name="unaligned", token="t", nonce=b"n" * 32, client_nonce=b"c" * 16, options=m.JobOptions(optimizer=AdamW(lr=1e-3)))
    job = Job.create(created, MemoryAccount(2**30))
    tasks: list[object] = []
    try:
        job.add_stage(m.AddStage(session=b"s" * 16, index=0, spec=spec), [zmq.Frame(torch.zeros(3).numpy().tobytes())])
        job.seal()
        w = job.join(b"w" * 16, m.Join(session=b"w" * 16, shm=True, grad_slots=2))
        job.open_barrier(tasks.append)
        assert all(s.numel() >= numel for s in w.slots)
        w.slots[0][:numel].copy_(torch.arange(numel, dtype=torch.float32))
        sumsq = squared_norm(w.slots[0][:numel]) if with_norm else None
        out = job.push(m.Push(session=w.session, stage=0, step=0, slot=0, numel=numel, sumsq=sumsq), [], b"id", w, tasks.append)
        out += finish(job, tasks)
        committed = job.commit(m.Commit(session=w.session, step=0), b"c-id", w)
        assert committed is not None and isinstance(committed.message, m.Committed), committed
        out += finish(job, tasks)
        assert job.stages[0].failed is None and job.step == 1
        assert not [r for r in out if isinstance(r.message, m.Error)], out  # type: ignore[attr-defined]
    finally:
        job.close()


def test_a_failed_norm_answers_the_commit_instead_of_running_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A norm task (the last expected gradient came in without a task knowing it was the last: the
    other worker left having pushed nothing) that fails, a bug, fails the stage as a failed update
    does and answers the held commit ``internal`` (defect seen: the task was queued again and again
    and the commit never answered)."""
    import wstream.server.pool_tasks as pool_tasks

    created = m.CreateJob(name="norm", token="t", nonce=b"n" * 32, client_nonce=b"c" * 16, options=m.JobOptions(optimizer=AdamW(lr=1e-3)))
    job = Job.create(created, MemoryAccount(2**30))
    tasks: list[object] = []
    try:
        spec = build_stage_spec("0", [("w", (10,))])
        job.add_stage(m.AddStage(session=b"s" * 16, index=0, spec=spec), [zmq.Frame(torch.zeros(spec.numel).numpy().tobytes())])
        job.seal()
        a = job.join(b"a" * 16, m.Join(session=b"a" * 16, shm=True, world_size=2))
        numel = job.stages[0].grad.numel()  # type: ignore[union-attr]
        out = job.push(m.Push(session=a.session, stage=0, step=0, slot=0, numel=numel), [], b"a-push", a, tasks.append)
        out += finish(job, tasks)  # gathered before the barrier opened: no norm (two gradients expected)
        assert job.commit(m.Commit(session=a.session, step=0), b"a-commit", a) is None  # held
        b = job.join(b"b" * 16, m.Join(session=b"b" * 16, shm=True, world_size=2))
        out += job.open_barrier(tasks.append)

        def injected(_: torch.Tensor) -> float:
            raise MemoryError("injected")

        monkeypatch.setattr(pool_tasks, "squared_norm", injected)
        out += job.remove_worker(b.id, tasks.append, lambda wid, why: None, "left")
        for _ in range(5):  # a norm task, then nothing more
            if not tasks:
                break
            t = tasks.pop(0)
            try:
                t.run()  # type: ignore[attr-defined]
                err = None
            except BaseException as exc:
                err = exc
            out += job.finish_task(t, err, tasks.append)  # type: ignore[arg-type]
        assert tasks == []
        (answer,) = [r for r in out if r.identity == b"a-commit"]  # type: ignore[attr-defined]
        assert isinstance(answer.message, m.Error) and answer.message.code == "internal", answer  # type: ignore[attr-defined]
        assert "norm" in answer.message.message and "injected" in answer.message.message  # type: ignore[attr-defined]
        assert job.stages[0].failed is not None
    finally:
        job.close()


def test_a_worker_of_a_job_with_nothing_to_push_is_refused_a_reader_is_not() -> None:
    """Every parameter frozen and no buffer: no push would ever come, so no step would commit and a
    worker's ``commit`` would wait for good (defect seen). Its join is refused, naming why; a reader
    (weights only) may join."""
    from wstream.protocol import StateError

    created = m.CreateJob(name="frozen", token="t", nonce=b"n" * 32, client_nonce=b"c" * 16, options=m.JobOptions(optimizer=AdamW(lr=1e-3)))
    job = Job.create(created, MemoryAccount(2**30))
    try:
        spec = build_stage_spec("0", [("w", (4,), 0, True)])
        job.add_stage(m.AddStage(session=b"s" * 16, index=0, spec=spec), [zmq.Frame(torch.zeros(spec.numel).numpy().tobytes())])
        job.seal()
        with pytest.raises(StateError, match="'frozen' has nothing to train.*join as a reader"):
            job.join(b"w" * 16, m.Join(session=b"w" * 16, shm=True))
        reader = job.join(b"r" * 16, m.Join(session=b"r" * 16, shm=True, reader=True))
        assert reader.reader
    finally:
        job.close()


def test_held_commits_and_waiting_pulls_are_bounded() -> None:
    """A peer that sends ``commit`` or ``pull`` again and again without reading the answers is
    refused past a bound, with a message saying so (defect seen: each waited in an unbounded list,
    memory for anyone holding a token)."""
    from wstream.protocol import StateError
    from wstream.server.step_commit import MAX_HELD_COMMITS
    from wstream.server.versions import MAX_WAITING_PULLS

    job, _, _ = lone_job(1, 2)
    try:
        w = job.worker_of(b"w" * 16)
        for k in range(MAX_HELD_COMMITS):
            assert job.commit(m.Commit(session=w.session, step=0, id=k + 1), b"id", w) is None  # held
        with pytest.raises(StateError, match=f"already has {MAX_HELD_COMMITS} commits waiting"):
            job.commit(m.Commit(session=w.session, step=0, id=99), b"id", w)
        job.stages[0].updating = True  # (as while its update runs: a pull waits for it)
        for k in range(MAX_WAITING_PULLS):
            assert job.pull(m.Pull(session=w.session, stage=0, id=k + 1), b"id") is None
        with pytest.raises(StateError, match=f"{MAX_WAITING_PULLS} pulls already wait"):
            job.pull(m.Pull(session=w.session, stage=0, id=999), b"id")
        job.stages[0].updating = False
    finally:
        job.close()
