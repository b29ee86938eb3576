"""When snapshots are taken, and what follows: the writer thread hand-off, the requests that wait
for a durable snapshot (``seal``, ``save``), the final snapshots at shutdown and the jobs restored
at start.

:mod:`wstream.server.snapshot` is the on-disk format and the store; this module decides when to use
it (NOTE [Consistent snapshots while training goes on] in snapshot.py). Every method runs on the
loop thread except :meth:`SnapshotScheduler._write`, which runs on the writer thread and reports back
through a :class:`~wstream.server.mailbox.Mailbox`.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from wstream.protocol import InternalError, StateError, UnknownJobError, WstreamError

from .config import ServerConfig
from .job import Job
from .mailbox import Mailbox
from .memory import MemoryAccount
from .outgoing import Outbox, Outgoing
from .snapshot import Snapshot, SnapshotError, SnapshotStore, Waiter

log = logging.getLogger(__name__)

Written = tuple[Job, Snapshot, str | None, BaseException | None]
"""A snapshot the writer finished: its job, the snapshot, its path (None: cancelled) and error."""


class SnapshotScheduler:
    """Snapshots of the jobs in ``jobs`` (the server's job table, shared) into ``store``; with no
    store (``enabled`` False) nothing is ever written."""

    def __init__(self, store: SnapshotStore | None, config: ServerConfig, jobs: dict[str, Job], outbox: Outbox) -> None:
        self.store = store
        self.every = config.snapshot_every
        self.buffer_bytes = config.snapshot_buffer
        self.jobs = jobs
        self.outbox = outbox
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wstream-snapshot")
        self.written: Mailbox[Written] = Mailbox()
        self._waiters: dict[str, list[Waiter]] = {}
        self._turns: list[str] = []
        """Jobs due for a snapshot while another was under way, in the order they became due: the
        first starts next (NOTE in :meth:`_start_next`)."""
        self.unresumed: dict[str, str] = {}
        """Jobs of the store not resumed at start, and why: their files stay in place (a restart that
        can resume them will), so a new job of that name is refused (its snapshots would be mixed
        with theirs, and the pruning of old ones would take the new job's)."""

    @property
    def enabled(self) -> bool:
        return self.store is not None

    def fileno(self) -> int:
        return self.written.fileno()

    # ---- start ---------------------------------------------------------------------------------
    def restore_jobs(self, memory: MemoryAccount, stop: threading.Event | None = None) -> None:
        """Resume every job of the store from its newest intact snapshot (until ``stop`` is set: a
        signal during a long restore ends the start)."""
        if self.store is None:
            return
        self.store.remove_partial()
        on_a_base: list[str] = []
        for name in self.store.jobs():  # bases and plain jobs first, jobs on a base after them
            if stop is not None and stop.is_set():
                return
            self._restore_job(name, memory, on_a_base)
        for name in on_a_base:
            if stop is not None and stop.is_set():
                return
            self._restore_job(name, memory, None)

    def _restore_job(self, name: str, memory: MemoryAccount, defer: list[str] | None) -> None:
        """Resume job ``name`` from its newest intact snapshot; a job on top of a base is only
        noted in ``defer`` when that is given (its base may not be resumed yet)."""
        assert self.store is not None
        t0 = time.perf_counter()
        try:
            step, record, stages, path = self.store.load_latest(name)
            if record.options.base is not None and defer is not None:
                defer.append(name)
                return
            base = self.jobs.get(record.options.base) if record.options.base is not None else None
            if record.options.base is not None and base is None:
                raise UnknownJobError(f"its base {record.options.base!r} was not resumed")
            job = Job.restore(record, step, stages, memory, base=base)
            job.last_snapshot_path = str(path)
        except (SnapshotError, WstreamError, OSError) as exc:  # OSError: e.g. /dev/shm has no room for it
            log.error(
                "job %r not resumed: %s (its files are left in place, and a new job of that name is refused "
                "until a restart resumes it or they are moved away)", name, exc,
            )
            self.unresumed[name] = str(exc)
            return
        try:  # the schedule changes since (NOTE [Schedule changes kept between snapshots] in snapshot.py)
            job.resume_schedule(self.store.read_schedule_log(name))
        except Exception as exc:  # noqa: BLE001 - written atomically, so not expected: never a reason not to start
            log.error("job %r: its schedule log could not be read (%r): it resumes with its snapshot's schedule", name, exc)
        self.jobs[name] = job
        log.info(
            "job %r resumed at step %d from %s (%d stages, %.2f s)",
            name, step, path, len(job.stages), time.perf_counter() - t0,
        )

    # ---- while serving -------------------------------------------------------------------------
    def request(self, job: Job, waiter: Waiter, reason: str) -> None:
        """Answer ``waiter`` once a snapshot of ``job`` at a consistent step is durable."""
        self._waiters.setdefault(job.name, []).append(waiter)
        self.maybe_snapshot(job, reason)

    def maybe_snapshot(self, job: Job, reason: str | None = None) -> None:
        """Start a snapshot of ``job`` if one is due and the job is at a consistent step."""
        if self.store is None or job.snapshot is not None or self.jobs.get(job.name) is not job:
            return
        step = job.consistent_step()
        if step is None:
            return
        waiters = self._waiters.pop(job.name, [])
        if step == job.last_snapshot_step and not job.record_changed and job.last_snapshot_path is not None:
            path = job.last_snapshot_path
            for w in waiters:  # nothing changed since: that snapshot is it
                self.outbox.send(Outgoing(w.identity, w.reply(step, path)))
            self._leave_turns(job.name)
            return
        every = self.every
        if reason is None and waiters:
            reason = "save request"
        last = job.last_snapshot_step if job.last_snapshot_step is not None else -every
        if job.snapshot_failed_step is not None:  # a failed one is tried again when the next is due, not at every step
            last = max(last, job.snapshot_failed_step)
        if reason is None and every and step >= last + every:
            reason = f"every {every} steps"  # also when the step it was due at came during a write
        if reason is None:
            self._leave_turns(job.name)
            return
        if self._writing or (self._turns and self._turns[0] != job.name):  # one at a time, in turn: :meth:`_start_next`
            self._waiters.setdefault(job.name, [])[:0] = waiters  # (kept, first, for when it can start)
            if job.name not in self._turns:
                self._turns.append(job.name)
            return
        self._leave_turns(job.name)
        snap = self._snapshot_of(job, step, reason, waiters)
        job.record_changed = False  # (a change from now on is for the next one)
        job.snapshot = snap
        self._writer.submit(self._write, job, snap)

    def _snapshot_of(self, job: Job, step: int, reason: str, waiters: list[Waiter] | None = None) -> Snapshot:
        """A snapshot of ``job`` at ``step``, keeping the weights the next step reads where they are
        not the step's own (a delayed job's: NOTE [Consistent snapshots] rule 5 in snapshot.py)."""
        return Snapshot(job.record(), step, self.buffer_bytes, reason, waiters=waiters or [], previous=job.reads_previous(step))

    def _write(self, job: Job, snap: Snapshot) -> None:
        """On the writer thread; the result goes back to the loop."""
        assert self.store is not None
        path: str | None = None
        error: BaseException | None = None
        try:
            written = self.store.write(snap, job.snapshot_sources())
            path = str(written) if written is not None else None
        except BaseException as exc:  # reported on the loop thread
            error = exc
        finally:
            snap.close()  # parked updates go on (NOTE [Consistent snapshots] rule 3)
        self.written.post((job, snap, path, error))

    def drain(self) -> None:
        """Finish the snapshots the writer has written since the last call."""
        for job, snap, path, error in self.written.drain():
            self._finished(job, snap, path, error)

    def _finished(self, job: Job, snap: Snapshot, path: str | None, error: BaseException | None) -> None:
        self._record(job, snap, path, error)
        self._start_next(after=job)

    def _start_next(self, after: Job | None) -> None:
        """The writer is free: start the next snapshot.

        NOTE [One snapshot at a time]
        1. One snapshot is under way at a time, server-wide: a snapshot's clones are taken from its
           start (NOTE [Consistent snapshots] rule 2), so several queued for the one writer held
           one ``--snapshot-buffer`` each (found by review: 6 jobs held 4x the buffer, outside the
           memory limit).
        2. A job due while another is under way takes a turn (``_turns``, in the order they became
           due); turns are served first to last, so no job waits for more than the turns before it
           (a first version tried the jobs in table order, and two busy jobs starved a third).
        3. The first turn's job may be in the middle of a step when the writer frees: the writer
           waits for it (its updates' completions, or the discard of its step, ask again), and no
           other job starts meanwhile.
        4. With no turn taken, every job is asked, the one that just finished (``after``) last."""
        while self._turns:
            name = self._turns[0]
            job = self.jobs.get(name)
            if job is None:
                self._turns.pop(0)
                continue
            self.maybe_snapshot(job)
            if self._writing or (self._turns and self._turns[0] == name):
                return  # started, or waited for (rule 3)
        for other in [j for j in self.jobs.values() if j is not after] + ([after] if after is not None else []):
            if self.jobs.get(other.name) is other:
                self.maybe_snapshot(other)

    def job_left(self) -> None:
        """A job left the table (dropped): with no snapshot under way, the next turn may start
        (the dropped job may have been the first, that the writer waited for)."""
        if not self._writing:
            self._start_next(None)

    @property
    def _writing(self) -> bool:
        """A snapshot is under way (NOTE [One snapshot at a time] rule 1)."""
        return any(j.snapshot is not None for j in self.jobs.values())

    def _leave_turns(self, name: str) -> None:
        if name in self._turns:
            self._turns.remove(name)

    def _record(self, job: Job, snap: Snapshot, path: str | None, error: BaseException | None) -> None:
        """Note a finished write and answer its waiters."""
        if job.snapshot is snap:
            job.snapshot = None
        seconds = time.monotonic() - snap.started
        if error is not None and snap.cancelled:  # its job was dropped under it: the files went with the job
            log.info("snapshot of job %r at step %d stopped: the job was dropped (%r)", job.name, snap.step, error)
        elif error is not None:
            job.counters.snapshot_failures += 1
            log.error("snapshot of job %r at step %d failed: %r", job.name, snap.step, error)
            job.record_changed = True  # what it held is not on disk: the next one must hold it
            job.snapshot_failed_step = snap.step  # tried again once the job moves on (or asked to save)
            for w in snap.waiters:
                self.outbox.error(w.identity, w.request_id, InternalError(f"snapshot failed: {error}"))
        elif path is not None:
            job.last_snapshot_step, job.last_snapshot_path = snap.step, path
            job.schedule.snapshot_seq = snap.record.schedule_seq
            job.counters.snapshots.observe(seconds)
            job.counters.snapshot_bytes += snap.bytes_written
            log.info(
                "job %r: snapshot of step %d (%s) written to %s: %d bytes in %.2f s",
                job.name, snap.step, snap.reason, path, snap.bytes_written, seconds,
            )
            for w in snap.waiters:
                self.outbox.send(Outgoing(w.identity, w.reply(snap.step, path)))

    def forget(self, job: Job, gone: WstreamError) -> None:
        """``job`` is dropped: take its files out of the store, stop its snapshot, answer its waiters
        with ``gone``, delete the files. A store that refuses the first refuses the drop, with the
        job as it was (:class:`StateError`): else a restart would bring the dropped job back."""
        gone_dir = None
        if self.store is not None:  # out of the store before the drop is answered; deleted after any write in progress
            try:
                gone_dir = self.store.take_out(job.name)
            except OSError as exc:
                raise StateError(
                    f"job {job.name!r} was not dropped: its snapshots could not be taken out of the store ({exc!r}); "
                    "it is as it was"
                ) from None
        waiters = self._waiters.pop(job.name, [])
        self._leave_turns(job.name)
        if job.snapshot is not None:  # its waiters too: a cancelled write ends with no one to answer
            job.snapshot.cancel()
            waiters += job.snapshot.waiters
            job.snapshot.waiters = []
        for w in waiters:
            self.outbox.error(w.identity, w.request_id, gone)
        if gone_dir is not None:
            self._writer.submit(shutil.rmtree, gone_dir, True)

    # ---- shutdown ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Wait for the writer, then snapshot every job whose consistent state is newer than its
        last snapshot (a job stopped in the middle of a step resumes from its last snapshot)."""
        self._writer.shutdown(wait=True)
        for job, snap, path, error in self.written.drain():  # writes that finished during shutdown
            self._record(job, snap, path, error)
        self.written.close()
        if self.store is None:
            return
        try:
            self._final_snapshots(self.store)
        finally:
            self.store.close()
        for name, waiters in self._waiters.items():  # saves that waited for a consistent step
            job = self.jobs.get(name)
            done = job is not None and job.last_snapshot_path is not None and job.last_snapshot_step == job.consistent_step()
            for w in waiters:
                if done:
                    assert job is not None and job.last_snapshot_step is not None and job.last_snapshot_path is not None
                    self.outbox.send(Outgoing(w.identity, w.reply(job.last_snapshot_step, job.last_snapshot_path)))
                else:
                    self.outbox.error(w.identity, w.request_id, StateError(
                        f"the server is shutting down with job {name!r} in the middle of a step: no snapshot of "
                        "it was taken for this request (the job resumes from its last snapshot)"
                    ))
        self._waiters.clear()

    def _final_snapshots(self, store: SnapshotStore) -> None:
        for job in self.jobs.values():
            job.snapshot = None
            step = job.consistent_step()
            if step is None or (step == job.last_snapshot_step and not job.record_changed):
                if step is None:
                    log.warning("job %r is in the middle of a step: it will resume from its last snapshot", job.name)
                continue
            snap = self._snapshot_of(job, step, "shutdown")
            try:
                path = store.write(snap, job.snapshot_sources())
                job.last_snapshot_step, job.last_snapshot_path = step, None if path is None else str(path)
                job.schedule.snapshot_seq = snap.record.schedule_seq
                log.info("job %r: snapshot of step %d written at shutdown to %s", job.name, step, path)
            except OSError as exc:
                log.error("job %r: the shutdown snapshot failed: %s", job.name, exc)
