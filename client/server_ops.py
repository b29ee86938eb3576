"""A client's operations on a server and on jobs by name (``Client`` inherits them): status, and
drop, save, wait for, reschedule and export a job, each with the server's admin secret or with the
job's token; shutdown with the admin secret.

With the admin secret they go through one admin session (opened on first use). With a token they
go through a handle on the job, kept per (job, token) and opened again only when the server has
forgotten its session: each handle is a session, and a job has at most ``--max-sessions-per-job``
(a script polling ``wait_step`` used to open one per call).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from wstream.protocol import SessionExpiredError, StateError
from wstream.protocol import messages as m
from wstream.protocol.auth import SessionSigner
from wstream.protocol.layout import numel_of
from wstream.protocol.lr_schedules import Schedule

from .chain import progress_bar
from .channel import Channel, Keyring, admin_session
from .env import job_token
from .groups import export_metadata
from .job_handle import named_state, pull_consistent, stage_tensors, wait_for_step
from .units import chain_layout

if TYPE_CHECKING:
    from .job_handle import Job

R = TypeVar("R", bound=m.Message)
T = TypeVar("T")


class ServerOperations:
    """Mixed into :class:`~wstream.client.client.Client`, whose connection it uses."""

    _chan: Channel
    _keys: Keyring
    _admin: SessionSigner | None
    _token_jobs: dict[tuple[str, str], Job]
    _token_jobs_lock: threading.Lock
    wait_timeout_s: float

    if TYPE_CHECKING:  # the client's own

        def _admin_secret(self) -> str | None: ...
        def attach_job(self, name: str, *, token: str | None = None) -> Job: ...

    def status(self) -> m.StatusReply:
        reply, _ = self._chan.request(m.Status(), m.StatusReply)
        return reply

    def drop_job(self, name: str, *, token: str | None = None) -> None:
        """Delete job ``name`` from the server, and its snapshots in the server's store: with the
        admin secret, else with the job's ``token`` (default ``$WSTREAM_TOKEN``; a server with an
        admin secret refuses it)."""
        if self._admin_secret() is None:
            self._with_token(name, token, lambda job: job.drop())
            self._token_jobs.pop((name, self._job_token(token)), None)
            return
        self._admin_request(lambda sid: m.DropJob(session=sid, job=name), m.Ok)

    def save_job(self, name: str, *, token: str | None = None, timeout: float | None = None) -> tuple[int, str]:
        """Snapshot job ``name`` (as :meth:`Job.save`): with the admin secret, else with
        the job's ``token`` (default ``$WSTREAM_TOKEN``; a server with an admin secret refuses it)."""
        if self._admin_secret() is None:
            return self._with_token(name, token, lambda job: job.save(timeout=timeout))
        reply = self._admin_request(
            lambda sid: m.Save(session=sid, job=name), m.Saved, timeout_s=timeout or self.wait_timeout_s, held=True
        )
        return reply.step, reply.path

    def wait_step(self, name: str, step: int, *, token: str | None = None, timeout: float | None = None) -> int:
        """Wait until job ``name`` holds the weights after ``step`` steps (as :meth:`Job.wait_step`):
        with the admin secret, else with the job's ``token`` (default ``$WSTREAM_TOKEN``)."""
        if self._admin_secret() is None:
            return self._with_token(name, token, lambda job: job.wait_step(step, timeout=timeout))

        def reached(t: int, left: float) -> int:
            return self._admin_request(lambda sid: m.AwaitStep(session=sid, job=name, step=t), m.StepReached, timeout_s=left, held=True).step

        return wait_for_step(reached, step, timeout or self.wait_timeout_s)

    def set_schedule(
        self, name: str, schedule: Schedule | None = None, *, lr: float | None = None, token: str | None = None
    ) -> None:
        """Change job ``name``'s base ``lr`` and/or learning-rate ``schedule`` from its next step
        on (as :meth:`Job.set_schedule`): with the admin secret, else with the job's
        ``token`` (default ``$WSTREAM_TOKEN``; a server with an admin secret refuses it)."""
        if self._admin_secret() is None:
            self._with_token(name, token, lambda job: job.set_schedule(schedule, lr=lr))
            return
        self._admin_request(lambda sid: m.SetSchedule(session=sid, job=name, lr=lr, schedule=schedule), m.Ok)

    def export_job(self, name: str, path: str | os.PathLike[str], *, progress: bool | None = None) -> int:
        """Write job ``name``'s fp32 weights to a safetensors file, with the admin secret (no job
        token needed); returns the step they are of. :meth:`Job.export` does it with the token."""
        from safetensors.torch import save_file

        layout = self._admin_request(lambda sid: m.Describe(session=sid, job=name), m.Layout)
        total = sum(numel_of(p.shape) for s in layout.stages for p in s.params)
        with progress_bar(progress, total, f"pulling {name}") as bar:

            def pull(i: int) -> tuple[int, dict[str, torch.Tensor]]:
                assert self._admin is not None
                reply, data = self._chan.request(m.Pull(session=self._admin.session, stage=i, job=name), m.Master)
                return reply.version, stage_tensors(layout.stages[i], data)

            step, stages = pull_consistent(
                pull, len(layout.stages), name, pulled=lambda i: bar.update(sum(numel_of(p.shape) for p in layout.stages[i].params))
            )
        out = named_state(stages, units=layout.units is not None)
        metadata = export_metadata(name, chain_layout(layout.stages, layout.units), layout.param_groups)
        save_file(out, os.fspath(path), metadata=metadata)
        return step

    def shutdown(self) -> None:
        """Stop the server cleanly (as SIGTERM does: jobs are snapshotted where it has a store).
        Needs the admin secret."""
        self._admin_request(lambda sid: m.Shutdown(session=sid), m.Ok)

    # ---- the two ways in -----------------------------------------------------------------------
    def _admin_request(self, make: Callable[[bytes], m.Message], reply_type: type[R], **kw: Any) -> R:
        """Send an admin request in this client's admin session (opened on first use, and again
        once if the server forgot it, e.g. after a restart)."""
        secret = self._admin_secret()
        if secret is None:
            raise StateError("this operation needs the server's admin secret: Client(address, admin_secret=...)")
        for attempt in (0, 1):
            if self._admin is None:
                self._admin = admin_session(self._chan, secret)
                self._keys.add(self._admin)
            try:
                reply, _ = self._chan.request(make(self._admin.session), reply_type, **kw)
                return reply
            except SessionExpiredError:
                self._admin = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _with_token(self, name: str, token: str | None, op: Callable[[Job], T]) -> T:
        """``op`` on the kept handle of job ``name`` opened with ``token``; once more on a new
        handle if the server forgot the kept one's session (a restart, an eviction, the job
        dropped and created again)."""
        key = (name, self._job_token(token))
        for attempt in (0, 1):
            with self._token_jobs_lock:  # two threads asking at once open one session
                job = self._token_jobs.get(key)
                if job is None:
                    job = self._token_jobs[key] = self.attach_job(name, token=key[1])
            try:
                return op(job)
            except SessionExpiredError:
                self._token_jobs.pop(key, None)
                if attempt:
                    raise
        raise AssertionError("unreachable")

    @staticmethod
    def _job_token(token: str | None) -> str:
        """The token of a job operation made without the admin secret."""
        return job_token(token, how="token= (or the server's admin secret: Client(admin_secret=...))")
