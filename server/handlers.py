"""The request handlers: one ``_on_<op>`` per request, the dispatch table, and the rules of which
session may act on which job; they work on the job table and the sessions, never on a socket.

# NOTE [Driving the handlers without a socket]
# :meth:`Handlers.dispatch` takes (routing id, decoded message, data frames) and hands every reply to
# the :class:`~wstream.server.outgoing.Outbox` it was given; :meth:`Handlers.receive` does the same
# from an encoded header (what the transport passes). A server process wires the outbox to its
# ROUTER socket; a test may wire it to a list, submit updates to a pool whose completions it feeds
# back with :meth:`Handlers.updates_done`, and call :meth:`Handlers.expire` for lease ends.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from wstream.protocol import PROTOCOL_VERSION, AuthError, InternalError, JobExistsError, LayoutError
from wstream.protocol import MemoryLimitError, NotReadyError, ProtocolError, StateError, UnknownJobError
from wstream.protocol import WstreamError, check_frames, decode_request, peek_id
from wstream.protocol import messages as m
from wstream.protocol.auth import secret_key, session_key
from wstream.protocol.shm import SegmentSpaceError

from .config import ServerConfig
from .counters import ServerCounters
from .job import Job, PoolTask
from .job_views import attached_reply, job_info
from .memory import MemoryAccount
from .outgoing import Outbox, Outgoing
from .sessions import Session, SessionTable
from .snapshot import Waiter
from .snapshot_scheduler import SnapshotScheduler

log = logging.getLogger(__name__)

Handler = Callable[[bytes, m.Message, list[Any]], Outgoing | None]


class Handlers:
    """Answers requests on the loop thread. ``submit`` queues a stage update (its completion comes
    back through :meth:`updates_done`); ``stop`` asks the server to stop (admin ``shutdown``)."""

    def __init__(
        self,
        config: ServerConfig,
        jobs: dict[str, Job],
        memory: MemoryAccount,
        sessions: SessionTable,
        snapshots: SnapshotScheduler,
        outbox: Outbox,
        counters: ServerCounters,
        submit: Callable[[PoolTask], None],
        stop: Callable[[], None],
        started: float,
    ) -> None:
        self.config = config
        self.jobs = jobs
        self.memory = memory
        self.sessions = sessions
        self.snapshots = snapshots
        self.outbox = outbox
        self.counters = counters
        self.submit = submit
        self._stop = stop
        self.started = started
        self.shutdown_requested = False
        self.table: dict[type[m.Message], Handler] = {
            m.Hello: self._on_hello,
            m.CreateJob: self._on_create_job,
            m.Attach: self._on_attach,
            m.AdminAttach: self._on_admin_attach,
            m.Shutdown: self._on_shutdown,
            m.AddStage: self._on_add_stage,
            m.Seal: self._on_seal,
            m.Join: self._on_join,
            m.Fetch: self._on_fetch,
            m.Push: self._on_push,
            m.Commit: self._on_commit,
            m.Pull: self._on_pull,
            m.AwaitStep: self._on_await_step,
            m.Heartbeat: self._on_heartbeat,
            m.Leave: self._on_leave,
            m.DropJob: self._on_drop_job,
            m.Status: self._on_status,
            m.Save: self._on_save,
            m.SetSchedule: self._on_set_schedule,
            m.Timeline: self._on_timeline,
            m.Describe: self._on_describe,
        }

    # ---- entry points (NOTE above) ---------------------------------------------------------------
    def receive(self, identity: bytes, parts: list[Any]) -> None:
        """A message as received: its header frame, then its data frames."""
        if not parts:
            self.outbox.error(identity, 0, ProtocolError("empty message: expected a header frame"))
            return
        header = parts[0].buffer if isinstance(parts[0], zmq.Frame) else parts[0]
        request_id = 0
        try:
            request_id = peek_id(header)
            msg = decode_request(header)
        except Exception as exc:
            self._failed(identity, request_id, exc)
            return
        self.dispatch(identity, msg, parts[1:])

    def dispatch(self, identity: bytes, msg: m.Message, data: list[Any]) -> None:
        """Check and answer one decoded request; every error becomes an ``error`` reply."""
        try:
            self.counters.requests[m.op_of(type(msg))] += 1
            check_frames(msg, data)
            if isinstance(msg, m.SessionMessage):
                self.sessions.authenticate(msg)
            out = self.table[type(msg)](identity, msg, data)
        except Exception as exc:
            self._failed(identity, msg.id, exc)
            return
        if out is not None:
            self.outbox.send(out)

    def _failed(self, identity: bytes, request_id: int, exc: Exception) -> None:
        """Answer a request that raised (call from its ``except`` block)."""
        if isinstance(exc, WstreamError):
            log.debug("request %d rejected: %s", request_id, exc)
            self.outbox.error(identity, request_id, exc)
            return
        log.exception("internal error while handling request %d", request_id)  # a bug: keep serving
        self.outbox.error(identity, request_id, InternalError(f"internal server error: {exc!r} (a bug in wstream)"))

    def updates_done(self, completions: Sequence[tuple[PoolTask, BaseException | None]]) -> None:
        """Finish the tasks the pool has run (gathers, norms, updates): answer the requests that
        waited for them, commit steps, maybe snapshot."""
        for task, error in completions:
            if error is not None:
                log.error("%s of job %r stage %d failed: %r", type(task).__name__, task.job.name, task.stage.index, error)
            job = self.jobs.get(task.job.name)
            if job is not task.job:
                continue  # the job was dropped meanwhile
            self.outbox.send_all(job.finish_task(task, error, self.submit))
            self.snapshots.maybe_snapshot(job)

    def expire(self, now: float) -> None:
        """End the worker sessions whose lease ran out; drop jobs left unsealed too long."""
        lease = self.config.lease_s
        for sid in self.sessions.silent_workers(now, lease):
            self.end_session(sid, f"silent for more than its {lease:g} s lease")
        limit = self.config.creation_timeout_s
        for job in [j for j in self.jobs.values() if not j.sealed and now - j.last_activity > limit]:
            try:
                self.drop(job, f"dropped: still unsealed after {limit:g} s without a new stage")
            except StateError as exc:  # the store refused: tried again at the next tick
                log.warning("%s", exc)

    # ---- the job table -------------------------------------------------------------------------
    def end_session(self, sid: bytes, reason: str) -> None:
        s = self.sessions.end(sid)
        if s is not None and s.job is not None and s.worker is not None:
            job = s.job

            def end_worker(worker_id: int, why: str) -> None:  # another worker's session, by its id
                sid = job.worker_table.all[worker_id].session if worker_id in job.worker_table.all else None
                if sid is not None:
                    self.end_session(sid, why)

            self.outbox.send_all(job.remove_worker(s.worker, self.submit, end_worker, reason))
            self.snapshots.maybe_snapshot(job)

    def drop(self, job: Job, reason: str) -> None:
        """Remove ``job``: its sessions, snapshots and memory; requests waiting on it get errors.
        Its snapshots go first: a store that refuses leaves the job as it was (``StateError``)."""
        gone = UnknownJobError(f"job {job.name!r} was {reason}")
        self.snapshots.forget(job, gone)
        self.sessions.end_all_of(job)
        del self.jobs[job.name]
        job.refuse_waiters(lambda identity, request_id: self.outbox.error(identity, request_id, gone))
        job.close()
        self.snapshots.job_left()
        log.info("job %r %s; %d bytes free", job.name, reason, self.memory.free)

    def _named_job(self, s: Session, name: str | None, what: str) -> Job:
        """The job ``name`` of an op an admin session may aim at any job (it must name one), and a
        job session only at its own (``name`` None or its job's)."""
        if s.job is None:
            if name is None:
                raise StateError(f"{what} with an admin session: name the job ('job' field)")
            job = self.jobs.get(name)
            if job is None:
                raise UnknownJobError(f"no job named {name!r} on this server")
            return job
        if name is not None and name != s.job.name:
            raise AuthError(f"a session of job {s.job.name!r} cannot {what} job {name!r}: use an admin session")
        return s.job

    def _readable_job(self, sid: bytes, name: str | None) -> Job:
        """The job whose weights a session may read (``pull``, ``describe``): its own, or any named
        one for an admin session; reading needs no admin secret beyond that."""
        return self._named_job(self.sessions.known(sid), name, "read")

    def _job_of(self, s: Session, name: str | None, what: str) -> Job:
        """The job an admin-guarded op (``drop_job``, ``save``) acts on, by the rule of
        ``protocol/README.md``: an admin session names any job; a job session acts only on its own,
        and only where the server has no admin secret (or, for ``drop_job``, while its job is still
        being created, so a failed creation can clean up after itself)."""
        job = self._named_job(s, name, what)
        if s.job is None:
            return job
        creating = what == "drop" and not job.ready
        if self.sessions.admin is not None and not creating:
            raise AuthError(
                f"this server has an admin secret: to {what} job {job.name!r} attach with the admin secret "
                "(admin_attach; Client(admin_secret=...) or --admin-secret-file)"
            )
        return job

    def _base_for(self, msg: m.CreateJob) -> Job | None:
        """The frozen job a new job trains on top of, once its ``base_proof`` is checked."""
        options = msg.options
        if options.base is None:
            return None
        if options.frozen:
            raise StateError("a frozen job cannot have a base itself (bases do not stack)")
        base = self.jobs.get(options.base)
        if base is None:
            raise UnknownJobError(f"no job named {options.base!r} on this server (the base of {msg.name!r})")
        if not base.options.frozen or not base.ready:
            raise StateError(f"job {options.base!r} is not a frozen, ready base (create it with frozen=True)")
        base.key.check_base_proof(msg.nonce, msg.client_nonce, msg.base_proof)
        if options.dtype != base.options.dtype:
            raise LayoutError(
                f"job {msg.name!r} computes in {options.dtype}; its base {options.base!r} in {base.options.dtype}: "
                "create both with the same dtype"
            )
        return base

    # ---- sessions ------------------------------------------------------------------------------
    def _on_hello(self, identity: bytes, msg: m.Message, _data: list[Any]) -> Outgoing:
        return Outgoing(identity, m.Challenge(id=msg.id, nonce=self.sessions.nonces.issue()))

    def _on_create_job(self, identity: bytes, msg: m.Message, _data: list[Any]) -> Outgoing:
        assert isinstance(msg, m.CreateJob)
        self.sessions.nonces.take(msg.nonce)
        if msg.name in self.jobs:  # before the admin check: create_job(exist_ok=True) attaches instead
            other = self.jobs[msg.name]
            if not other.sealed:  # (exist_ok cannot attach to it: a creator that died leaves it so)
                idle = time.monotonic() - other.last_activity
                left = max(0.0, self.config.creation_timeout_s - idle)
                raise JobExistsError(
                    f"a job named {msg.name!r} {JobExistsError.BEING_CREATED} (no stage added for {idle:.0f} s); if its creator "
                    f"died it is dropped {left:.0f} s from now (--creation-timeout), or drop it with the admin secret"
                )
            raise JobExistsError(f"a job named {msg.name!r} already exists on this server")
        why = self.snapshots.unresumed.get(msg.name)
        if why is not None:
            assert self.snapshots.store is not None
            raise JobExistsError(
                f"job {msg.name!r} has snapshots in the store that were not resumed at start ({why}): a new job of "
                f"that name would be mixed with them; restart the server once they can be resumed, or move "
                f"{self.snapshots.store.job_dir(msg.name)} away and restart"
            )
        if self.sessions.admin is not None:
            self.sessions.admin.check_create(msg.name, msg.nonce, msg.client_nonce, msg.admin_proof)
        base = self._base_for(msg)
        try:
            job = Job.create(msg, self.memory)
        except SegmentSpaceError as exc:
            raise MemoryLimitError(str(exc)) from None
        job.base = base
        self.jobs[msg.name] = job
        log.info("job %r created; waiting for its stages", msg.name)
        sid = self.sessions.open(job, session_key(secret_key(msg.token), msg.nonce, msg.client_nonce))
        return Outgoing(identity, attached_reply(job, sid, self.config.lease_s, msg.id))

    def _on_attach(self, identity: bytes, msg: m.Message, _data: list[Any]) -> Outgoing:
        assert isinstance(msg, m.Attach)
        self.sessions.nonces.take(msg.nonce)  # consumed whatever follows: one guess per nonce
        job = self.jobs.get(msg.name)
        if job is None:
            raise UnknownJobError(f"no job named {msg.name!r} on this server")
        sid = self.sessions.open(job, job.key.check_proof(msg.nonce, msg.client_nonce, msg.proof))
        return Outgoing(identity, attached_reply(job, sid, self.config.lease_s, msg.id))

    def _on_admin_attach(self, identity: bytes, msg: m.Message, _data: list[Any]) -> Outgoing:
        assert isinstance(msg, m.AdminAttach)
        self.sessions.nonces.take(msg.nonce)
        admin = self.sessions.admin
        if admin is None:
            raise AuthError("this server has no admin secret (start it with --admin-secret-file FILE)")
        sid = self.sessions.open(None, admin.check_admin(msg.nonce, msg.client_nonce, msg.proof))
        log.info("admin session opened")
        return Outgoing(identity, m.AdminAttached(id=msg.id, session=sid))

    def _on_shutdown(self, identity: bytes, msg: m.Message, _data: list[Any]) -> Outgoing:
        assert isinstance(msg, m.Shutdown)
        if not self.sessions.known(msg.session).admin:
            raise AuthError("shutdown needs an admin session (attach with the server's admin secret)")
        log.info("shutdown requested by an admin session")
        self.shutdown_requested = True
        self._stop()
        return Outgoing(identity, m.Ok(id=msg.id))

    def _on_heartbeat(self, identity: bytes, msg: m.Message, _data: list[Any]) -> Outgoing:
        assert isinstance(msg, m.Heartbeat)
        self.sessions.job_session(msg.session)
        return Outgoing(identity, m.Ok(id=msg.id))

    def _on_leave(self, identity: bytes, msg: m.Message, _data: list[Any]) -> Outgoing:
        assert isinstance(msg, m.Leave)
        self.sessions.known(msg.session)  # a worker's, a job handle's or an admin session (a Client that closes)
        self.end_session(msg.session, "left")
        return Outgoing(identity, m.Ok(id=msg.id))

    # ---- creating a job ------------------------------------------------------------------------
    def _on_add_stage(self, identity: bytes, msg: m.Message, data: list[Any]) -> Outgoing:
        assert isinstance(msg, m.AddStage)
        _, job = self.sessions.job_session(msg.session)
        try:
            job.add_stage(msg, data)
        except SegmentSpaceError as exc:
            raise MemoryLimitError(str(exc)) from None
        return Outgoing(identity, m.Ok(id=msg.id))

    def _on_seal(self, identity: bytes, msg: m.Message, _data: list[Any]) -> Outgoing | None:
        assert isinstance(msg, m.Seal)
        _, job = self.sessions.job_session(msg.session)
        job.seal(msg.units)
        log.info(
            "job %r sealed: %d stages, %d bytes reserved (%d bytes free)",
            job.name,
            len(job.stages),
            job.reserved,
            self.memory.free,
        )
        reply = attached_reply(job, msg.session, self.config.lease_s, msg.id)
        if self.snapshots.enabled:  # answered once the job is durable: a crash cannot lose it after
            self.snapshots.request(job, Waiter(identity, msg.id, lambda *_: reply), "creation")
            return None
        return Outgoing(identity, reply)

    # ---- training ------------------------------------------------------------------------------
    def _on_join(self, identity: bytes, msg: m.Message, _data: list[Any]) -> Outgoing:
        assert isinstance(msg, m.Join)
        s, job = self.sessions.job_session(msg.session)
        readers = sum(w.reader for w in job.workers.values())
        if msg.reader and readers >= self.config.max_sessions_per_job:  # a reader holds no ring to count
            raise StateError(
                f"job {job.name!r} has {readers} readers already, the limit (--max-sessions-per-job): "
                "let one leave first"
            )
        try:
            w = job.join(s.id, msg)
        except SegmentSpaceError as exc:
            raise MemoryLimitError(str(exc)) from None
        s.worker = w.id
        self.outbox.send_all(job.open_barrier(self.submit))
        reply = m.Joined(
            id=msg.id,
            worker=w.id,
            step=w.first_step,
            grad_path=w.grad_path,
            grad_slot_bytes=w.slot_bytes,
            grad_slots=len(w.slots),
            grad_slot_offsets=w.slot_offsets,
            grad_ring_bytes=w.grad_buffer.numel(),
        )
        return Outgoing(identity, reply)

    def _on_fetch(self, identity: bytes, msg: m.Message, _data: list[Any]) -> Outgoing | None:
        assert isinstance(msg, m.Fetch)
        s, job = self.sessions.job_session(msg.session)
        return job.fetch(msg, identity, job.worker_of(s.id))

    def _on_push(self, identity: bytes, msg: m.Message, data: list[Any]) -> None:
        assert isinstance(msg, m.Push)
        s, job = self.sessions.job_session(msg.session)
        self.outbox.send_all(job.push(msg, data, identity, job.worker_of(s.id), self.submit))

    def _on_commit(self, identity: bytes, msg: m.Message, _data: list[Any]) -> Outgoing | None:
        assert isinstance(msg, m.Commit)
        s, job = self.sessions.job_session(msg.session)
        return job.commit(msg, identity, job.worker_of(s.id))

    def _on_pull(self, identity: bytes, msg: m.Message, _data: list[Any]) -> Outgoing | None:
        assert isinstance(msg, m.Pull)
        return self._readable_job(msg.session, msg.job).pull(msg, identity)

    def _on_await_step(self, identity: bytes, msg: m.Message, _data: list[Any]) -> Outgoing | None:
        assert isinstance(msg, m.AwaitStep)
        return self._readable_job(msg.session, msg.job).await_step(msg, identity)

    def _on_describe(self, identity: bytes, msg: m.Message, _data: list[Any]) -> Outgoing:
        assert isinstance(msg, m.Describe)
        job = self._readable_job(msg.session, msg.job)
        return Outgoing(identity, m.Layout(
            id=msg.id, job=job.name, stages=[s.spec for s in job.stages], step=job.step, units=job.options.units,
            param_groups=job.options.param_groups,
        ))

    def _on_timeline(self, identity: bytes, msg: m.Message, _data: list[Any]) -> Outgoing:
        assert isinstance(msg, m.Timeline)
        _, job = self.sessions.job_session(msg.session)
        events = job.timeline.since(msg.since_ns)
        reply = m.TimelineReply(id=msg.id, now_ns=time.monotonic_ns(), events=events, dropped=job.timeline.dropped)
        return Outgoing(identity, reply)

    # ---- administration ------------------------------------------------------------------------
    def _on_drop_job(self, identity: bytes, msg: m.Message, _data: list[Any]) -> Outgoing:
        assert isinstance(msg, m.DropJob)
        job = self._job_of(self.sessions.known(msg.session), msg.job, "drop")
        users = sorted(j.name for j in self.jobs.values() if j.base is job)
        if users:
            raise StateError(f"job {job.name!r} is the base of {users}: drop those first")
        self.drop(job, "dropped")
        return Outgoing(identity, m.Ok(id=msg.id))

    def _on_status(self, identity: bytes, msg: m.Message, _data: list[Any]) -> Outgoing:
        reply = m.StatusReply(
            id=msg.id,
            protocol=PROTOCOL_VERSION,
            pid=os.getpid(),
            uptime_s=time.monotonic() - self.started,
            memory_limit=self.memory.limit,
            memory_used=self.memory.used,
            jobs=[job_info(j) for j in self.jobs.values() if msg.job in (None, j.name)],  # type: ignore[attr-defined]
        )
        return Outgoing(identity, reply)

    def _on_save(self, identity: bytes, msg: m.Message, _data: list[Any]) -> Outgoing | None:
        assert isinstance(msg, m.Save)
        job = self._job_of(self.sessions.known(msg.session), msg.job, "save")
        if not self.snapshots.enabled:
            raise StateError("this server has no store: start it with --store DIR to save snapshots")
        if not job.ready:
            raise NotReadyError(f"job {job.name!r} is still uploading its weights")
        self.snapshots.request(job, Waiter(identity, msg.id, functools.partial(_saved, msg.id)), "save request")
        return None


    def _on_set_schedule(self, identity: bytes, msg: m.Message, _data: list[Any]) -> Outgoing:
        """The change, answered once the job's schedule log in the store holds it (NOTE [Schedule
        changes kept between snapshots] in snapshot.py): a server killed after the answer comes
        back with it. A job not sealed yet has no store directory: its creation snapshot holds it."""
        assert isinstance(msg, m.SetSchedule)
        job = self._job_of(self.sessions.known(msg.session), msg.job, "set the schedule of")
        if job.options.frozen:
            raise StateError(f"job {job.name!r} is a frozen base: it has no optimizer")
        if msg.lr is None and msg.schedule is None:
            raise StateError("set_schedule changes nothing: give lr, schedule or both")
        job.set_schedule(msg.lr, msg.schedule)
        store = self.snapshots.store
        if store is not None and job.ready:
            try:
                store.write_schedule_log(job.name, job.schedule.to_json())
            except OSError as exc:
                log.error("job %r: the schedule change could not be written to the store: %s", job.name, exc)
                raise InternalError(
                    f"the schedule of job {job.name!r} is changed on the live server, but the store could not keep it "
                    f"({exc}): the next snapshot will"
                ) from exc
            if job.schedule.long:  # (rule 5) a snapshot lets the log shed what it holds
                self.snapshots.maybe_snapshot(job, "schedule log")
        return Outgoing(identity, m.Ok(id=msg.id))


def _saved(request_id: int, step: int, path: str) -> m.Message:
    return m.Saved(id=request_id, step=step, path=path)
