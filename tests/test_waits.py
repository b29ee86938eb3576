"""A worker that waits on other workers says what it waits for, at once and then periodically,
and gives up after the client's ``wait_timeout`` with an error naming the cause (issue 16).

Both cases used to wait 600 s with no word, then raise ``ServerUnavailable`` although the server
answered all along."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from wstream.client import AdamW, Client, WaitTimeoutError

WAIT = dict(wait_timeout=2.0, wait_report=0.4)
"""Short enough for a test: the waits below can never end by themselves."""


def model() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(4, 4), nn.Linear(4, 2)]


def data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(3, 4), torch.randn(3, 2)


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and r.name.startswith("wstream.client")]


def test_a_second_trainer_of_a_job_in_one_process_is_named_at_once_and_its_wait_ends(
    server, caplog: pytest.LogCaptureFixture
) -> None:
    x, y = data()
    with Client(server.address, timeout=30, **WAIT) as client:
        job = client.create_job("twice", model(), token="t", optimizer=AdamW(lr=1e-2))
        first = job.trainer(prefetch=0)
        first.step(x, y, nn.functional.mse_loss)
        with caplog.at_level(logging.INFO, logger="wstream.client"):
            second = job.trainer(prefetch=0)
            joined = messages(caplog, logging.WARNING)
            assert any("already has a trainer in this process" in s and f"worker {first.connection.worker_id}" in s for s in joined), joined
            with pytest.raises(WaitTimeoutError) as err:
                second.step(x, y, nn.functional.mse_loss)
        reports = [s for s in messages(caplog, logging.WARNING) if "still waiting" in s]
        assert len(reports) >= 2, reports  # periodically, not once
        cause = f"the gradients of worker {first.connection.worker_id}"
        assert all(cause in s for s in reports), reports
        assert cause in str(err.value) and "'twice'" in str(err.value), err.value
        assert "2 s" in str(err.value), err.value  # it names the timeout it gave up after
        second.close()
        first.close()


def test_a_wait_on_a_job_of_units_counts_the_chain_stages_missing(server) -> None:
    """A job cut into transfer units: what the server says its step waits for counts the stages
    of the chain the worker trains (6), not the units it stores them in (3)."""
    x = torch.randn(3, 4)
    torch.manual_seed(0)
    with Client(server.address, timeout=30, **WAIT) as client:
        job = client.create_job("cut", [nn.Linear(4, 4) for _ in range(6)], token="t", optimizer=AdamW(lr=1e-2), unit_bytes=2 * 20 * 4)
        assert job.units is not None and job.units.counts == (2, 2, 2)
        first = job.trainer(prefetch=0)
        first.step(x, x, nn.functional.mse_loss)
        second = job.trainer(prefetch=0)
        with pytest.raises(WaitTimeoutError) as err:
            second.step(x, x, nn.functional.mse_loss)
        assert f"the gradients of worker {first.connection.worker_id} (6 of 6 stages missing" in str(err.value), err.value
        info = job_info(client, "cut")
        assert (info.stages, info.units) == (6, 3)
        second.close()
        first.close()


def test_world_size_two_with_one_worker_says_whom_it_waits_for(server, caplog: pytest.LogCaptureFixture) -> None:
    x, y = data()
    with Client(server.address, timeout=30, **WAIT) as client:
        job = client.create_job("pair", model(), token="t", optimizer=AdamW(lr=1e-2))
        with caplog.at_level(logging.INFO, logger="wstream.client"):
            trainer = job.trainer(world_size=2, prefetch=0)
            at_join = messages(caplog, logging.INFO) + messages(caplog, logging.WARNING)
            want = "waiting for 1 of 2 workers to join"
            assert any(want in s and "present: worker 0" in s for s in at_join), at_join
            with pytest.raises(WaitTimeoutError) as err:
                trainer.step(x, y, nn.functional.mse_loss)
        reports = [s for s in messages(caplog, logging.WARNING) if "still waiting" in s]
        assert len(reports) >= 2 and all(want in s for s in reports), reports
        assert want in str(err.value), err.value
        trainer.close()


def test_status_says_what_each_job_waits_for(server) -> None:
    """The server's side of it: ``status`` names what a job's open step waits for."""
    x, y = data()
    with Client(server.address, timeout=30, **WAIT) as client:
        job = client.create_job("quiet", model(), token="t", optimizer=AdamW(lr=1e-2))
        assert job_info(client, "quiet").waiting is None  # no worker yet: nothing waits
        with job.trainer(world_size=2, prefetch=0):
            waiting = job_info(client, "quiet").waiting
            assert waiting is not None and "1 of 2 workers to join" in waiting, waiting
        lone = client.create_job("lone", model(), token="t", optimizer=AdamW(lr=1e-2))
        with lone.trainer(prefetch=0) as trainer:
            trainer.step(x, y, nn.functional.mse_loss)
            assert job_info(client, "lone").waiting is None  # a lone worker's step committed


def job_info(client: Client, name: str):
    (info,) = [j for j in client.status().jobs if j.name == name]
    return info


def test_a_trainer_that_fails_after_joining_leaves_no_worker_behind(server, caplog: pytest.LogCaptureFixture) -> None:
    """A trainer that fails after its ``join`` (here a weight budget below two stages) leaves the
    job again and is forgotten here (defect seen: the next trainer was told the job "already has a
    trainer in this process", and the server kept a worker that a world-size-2 step would wait for)."""
    x, y = data()
    with Client(server.address, timeout=30, **WAIT) as client:
        job = client.create_job("failed-join", model(), token="t", optimizer=AdamW(lr=1e-2))
        with pytest.raises(ValueError, match="weight_budget"):
            job.trainer(weight_budget=8, zero_copy=False)
        line = next(j for j in client.status().jobs if j.name == "failed-join")
        assert line.workers == [], line
        with caplog.at_level(logging.WARNING, logger="wstream.client"):
            with job.trainer() as trainer:
                trainer.step(x, y, nn.functional.mse_loss)
        assert not [s for s in messages(caplog, logging.WARNING) if "already has a trainer" in s]


def test_close_leaves_the_job_even_when_the_last_drain_is_interrupted(server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (or any error) while ``close`` drains the last gradients still leaves the job and
    stops the heartbeat (defect seen: the worker stayed, renewing its lease, and the other
    workers' steps waited for it)."""
    x, y = data()
    with Client(server.address, timeout=30, **WAIT) as client:
        job = client.create_job("interrupted-close", model(), token="t", optimizer=AdamW(lr=1e-2))
        trainer = job.trainer()
        trainer.step(x, y, nn.functional.mse_loss)

        def interrupted() -> None:
            raise KeyboardInterrupt

        with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
            patch.setattr(trainer.connection.pusher, "drain", interrupted)
            trainer.close()
        assert trainer.connection.closed and not trainer.connection.heartbeat._thread.is_alive()
        line = next(j for j in client.status().jobs if j.name == "interrupted-close")
        assert line.workers == [], line


def test_a_wait_that_timed_out_does_not_fail_the_next_one(server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait of the gradient sender that gave up (``WaitTimeoutError``, e.g. for a slot before the
    step pushed anything, which leaves the trainer open) is that wait's outcome: the next wait
    starts afresh (defect seen: the error was kept, and every later step failed with it at once)."""
    from wstream.client.waiting import WaitWatch

    with Client(server.address, timeout=30, **WAIT) as client:
        job = client.create_job("timed-out-once", model(), token="t", optimizer=AdamW(lr=1e-2))
        with job.trainer() as trainer:
            pusher = trainer.connection.pusher

            def gave_up(self: WaitWatch) -> None:
                raise WaitTimeoutError(f"gave up waiting {self.what} (injected)")

            with monkeypatch.context() as patch, pytest.raises(WaitTimeoutError, match="injected"):
                patch.setattr(WaitWatch, "tick", gave_up)
                pusher._wait_until(lambda: False, "wait test", "for nothing")
            pusher._wait_until(lambda: True, "wait test", "for nothing")  # done: returns at once
            trainer.step(*data(), nn.functional.mse_loss)
