"""``await_step``: wait until a job's weights are those after step t, without moving any weights.

A trainer's step returns once its gradients are in; the step's updates then run on the server. A
caller that must know they are applied (before an export, an evaluation, a timed block's end)
used to pull a stage's master (its whole fp32 weights over the socket). ``await_step`` is
answered with ``step_reached`` once every stage is at version t or beyond (NOTE [Versions and who
may read what] in server/versions.py), with an error when a stage's update fails or the job is
dropped (tests/test_drop.py), and at once when the job is there already.

The in-process server runs the very same handlers; the updates are held at a gate
(tests/test_drop.py's) to show the answer waits for them.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from conftest import ADMIN_SECRET
from test_drop import OPTIMIZER, Scene, commit_with_updates_held, push_all, victim_model
from wstream.client import AdamW, Client, WaitTimeoutError
from wstream.protocol import messages as m
from wstream.server.inprocess import InProcessServer
from wstream.server.metrics import ServerCollector
from wstream.server.pool_tasks import UpdateTask
from wstream.server.versions import MAX_WAITING_STEPS


def test_await_step_is_answered_once_every_update_of_the_step_is_applied(held: Scene) -> None:
    job = held.victim()
    a, sign_a = held.worker(job)
    commit_with_updates_held(held, a, sign_a, job)
    waiting = held.wire.send(m.AwaitStep(session=job.session, step=1), signer=job._signer)
    # the server answers in order on one loop: a later request answered first shows it waits
    barrier = held.wire.send(m.Status())
    held.wire.collect(lambda: barrier in held.wire.replies)
    assert waiting not in held.wire.replies, held.wire.replies.get(waiting)
    held.update.release()
    held.wire.collect(lambda: waiting in held.wire.replies)
    (reply,) = held.wire.replies[waiting]
    assert isinstance(reply, m.StepReached) and reply.step == 1, reply
    for stage in range(len(job.specs)):  # every update was applied when it was answered
        master = held.wire.call(m.Pull(session=job.session, stage=stage), signer=job._signer)
        assert isinstance(master, m.Master) and master.version == 1, master


def test_await_step_of_a_step_reached_is_answered_at_once_with_the_job_step(held: Scene) -> None:
    job = held.victim()
    assert job.wait_step(0) == 0
    a, sign_a = held.worker(job)
    push_all(held, a, sign_a, job, 0)
    committed = held.wire.call(m.Commit(session=a.session, step=0), signer=sign_a)
    assert isinstance(committed, m.Committed), committed
    assert job.wait_step(1) == 1
    assert job.wait_step(0) == 1  # the job's step, which is past the one asked for


def test_await_step_is_bounded_to_the_step_after_the_open_one_and_wait_step_goes_a_step_at_a_time(held: Scene) -> None:
    """A request waits at most for the step after the one the job gathers (so the server never
    keeps it for long); ``Job.wait_step`` of a later step asks a step at a time."""
    job = held.victim()
    far = held.wire.call(m.AwaitStep(session=job.session, step=2), signer=job._signer)
    assert isinstance(far, m.Error) and far.code == "stale_step", far
    assert "gathers step 0: step 2 is more than one step past it" in far.message, far.message
    a, sign_a = held.worker(job)
    done: list[int] = []
    waiter = threading.Thread(target=lambda: done.append(job.wait_step(2)), daemon=True)
    waiter.start()
    for t in range(2):
        push_all(held, a, sign_a, job, t)
        committed = held.wire.call(m.Commit(session=a.session, step=t), signer=sign_a)
        assert isinstance(committed, m.Committed), committed
        for stage in range(len(job.specs)):  # every update of step t ended
            fetched = held.wire.call(m.Fetch(session=a.session, stage=stage, step=t + 1), signer=sign_a)
            assert isinstance(fetched, m.Weights), fetched
    waiter.join(30)
    assert done == [2]


def test_await_step_waiters_are_bounded_per_job(held: Scene) -> None:
    job = held.victim()
    ids = [held.wire.send(m.AwaitStep(session=job.session, step=1), signer=job._signer) for _ in range(MAX_WAITING_STEPS)]
    over = held.wire.call(m.AwaitStep(session=job.session, step=1), signer=job._signer)
    assert isinstance(over, m.Error) and over.code == "bad_state", over
    assert f"{MAX_WAITING_STEPS} requests already wait" in over.message, over.message
    assert not any(i in held.wire.replies for i in ids)
    held.drop(job.session, job._signer, ids)  # every one answered, none lost
    held.after()


def test_await_step_from_an_admin_session_names_the_job(admin_server: InProcessServer) -> None:
    with Client(admin_server.address, admin_secret=ADMIN_SECRET, timeout=30) as admin:
        job = admin.create_job("j", victim_model(), token="t", optimizer=OPTIMIZER)
        assert admin.wait_step("j", 0) == 0
        with job.trainer() as trainer:
            trainer.step(torch.randn(4, 6), torch.randn(4, 2), nn.functional.mse_loss)
        assert admin.wait_step("j", 1) == 1


def test_a_failed_update_answers_await_step_with_the_failure(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage whose update fails stays at its version for good (a bug in wstream, injected here):
    whoever waits for a later step is told, at once or when it asks."""
    real_run = UpdateTask.run

    def failing_run(task: UpdateTask) -> UpdateTask:
        if task.stage.index == 1:
            raise RuntimeError("injected update failure")
        return real_run(task)

    monkeypatch.setattr(UpdateTask, "run", failing_run)
    job = client.create_job("fails", victim_model(), optimizer=AdamW(lr=1e-2), token="t", unit_bytes=None)
    with job.trainer() as trainer:
        # the failure answers the step's held push of stage 1 as well: it surfaces in the step when
        # that answer comes before the step returns (a race of the two), else in wait_updates
        with pytest.raises(Exception, match="the update of stage 1 step 0 failed"):
            trainer.step(torch.randn(4, 6), torch.randn(4, 2), nn.functional.mse_loss)
            trainer.wait_updates()
    with pytest.raises(Exception, match="the update of stage 1 step 0 failed"):
        job.wait_step(1)


def test_trainer_wait_updates_gives_plain_pytorch_weights_without_a_pull(client: Client) -> None:
    """After ``wait_updates`` every stage's master is the one plain PyTorch reaches, and the server
    served no master bytes to get there."""
    torch.manual_seed(5)
    model = [nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 2)]
    reference = nn.Sequential(*copy.deepcopy(model))
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    job = client.create_job("plain", model, optimizer=AdamW(lr=1e-2), token="t")
    data = [(torch.randn(4, 6), torch.randn(4, 2)) for _ in range(3)]
    with job.trainer() as trainer:
        for x, y in data:
            trainer.step(x, y, nn.functional.mse_loss)
            opt.zero_grad()
            nn.functional.mse_loss(reference(x), y).backward()
            opt.step()
        assert trainer.wait_updates() == 3
    for i, module in enumerate(reference):
        got = job.pull_stage(i)
        for name, want in module.state_dict().items():
            torch.testing.assert_close(got[name], want, rtol=1e-6, atol=1e-6)


def test_metrics_count_the_waiting_await_steps_and_held_commits(held: Scene) -> None:
    def gauges() -> dict[str, float]:
        families = ServerCollector(held.srv.server).collect()
        return {
            f.name: s.value for f in families for s in f.samples
            if f.name in ("wstream_job_waiting_steps", "wstream_job_held_commits") and s.labels["job"] == "victim"
        }  # fmt: skip

    job = held.victim()
    a, sign_a = held.worker(job)
    assert gauges() == {"wstream_job_waiting_steps": 0, "wstream_job_held_commits": 0}
    commit_with_updates_held(held, a, sign_a, job)
    waiting = [held.wire.send(m.AwaitStep(session=job.session, step=1), signer=job._signer) for _ in range(2)]
    commit_next = held.wire.send(m.Commit(session=a.session, step=1), signer=sign_a)  # held until step 1 commits
    barrier = held.wire.send(m.Status())
    held.wire.collect(lambda: barrier in held.wire.replies)
    assert gauges() == {"wstream_job_waiting_steps": 2, "wstream_job_held_commits": 1}
    held.update.release()
    held.wire.collect(lambda: all(w in held.wire.replies for w in waiting))
    assert gauges() == {"wstream_job_waiting_steps": 0, "wstream_job_held_commits": 1}
    assert commit_next not in held.wire.replies


def test_a_wait_that_outlasts_its_timeout_says_so_and_leaves_the_connection_usable(client: Client) -> None:
    """A held request whose timeout passes while the server is well is a slow wait, not a dead
    server: :class:`WaitTimeoutError`, and the same client goes on (defect seen: the wait read as
    "did not answer ... this connection is closed", and every later request failed at once)."""
    stages = [nn.Linear(4, 4)]
    job = client.create_job("slow-wait", stages, optimizer=AdamW(lr=1e-3), token="t")
    with job.trainer() as trainer:
        trainer.step(torch.randn(2, 4), torch.randn(2, 4), nn.functional.mse_loss)
        with pytest.raises(WaitTimeoutError, match=r"await_step was not answered within 0\.\d+ s; the server is up"):
            job.wait_step(2, timeout=0.2)  # step 2 is never trained while nobody steps
        assert trainer.wait_updates() == 1  # the held request's late answer, should it come, is not taken for this one
        trainer.step(torch.randn(2, 4), torch.randn(2, 4), nn.functional.mse_loss)
        assert job.wait_step(2, timeout=30) == 2
    assert client.status().jobs and set(job.state_dict()) == {"0.weight", "0.bias"}
