"""One job's state on the server: stages, versions, workers, pending gradients.

Nothing here touches a socket. Each method returns the replies to send (:class:`Outgoing`) and
queues stage updates through the ``submit`` callback; :mod:`wstream.server.handlers` calls them.
The parts a job is made of live next to it: its stages and their shared-memory segment in
:mod:`~wstream.server.published`, one stage's state and update in :mod:`~wstream.server.stage_state`,
its workers in :mod:`~wstream.server.workers`, its stages' versions and the reads they serve in
:mod:`~wstream.server.versions` (NOTE [Versions and who may read what]), the step commit point and
held gradient slots in :mod:`~wstream.server.step_commit` (NOTE [The step commit point], NOTE [Held
gradient slots]); this module keeps the job that owns them and the rules that tie them together:
creation, restore, sealing, workers joining and leaving, the requests the handlers hand it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import torch

from wstream.protocol import LayoutError, NotReadyError, StaleStepError, StateError
from wstream.protocol import messages as m
from wstream.protocol.layout import push_layout

from .counters import JobCounters, Timeline
from .job_key import JobKey, token_verifier
from .memory import MemoryAccount
from .outgoing import Outgoing
from .published import PublishedStages
from .schedule_log import ScheduleLog
from .snapshot import Capture, JobRecord, Snapshot
from .pool_tasks import PoolTask, UpdateTask
from .stage_state import Deferred, ReplyCopies, StageState, align
from .step_commit import CommitRecord, EndSession, StepCommit, Submit
from .versions import StageVersions
from .workers import MAX_WAITING_FETCHES, Worker, WorkerTable

__all__ = ["MAX_WAITING_FETCHES", "CommitRecord", "Job", "Outgoing", "PoolTask", "UpdateTask", "token_verifier"]

log = logging.getLogger(__name__)


class Job:
    """A job: its stages in shared memory, its optimizer, its workers and sessions."""

    def __init__(
        self, record: JobRecord, memory: MemoryAccount, total_numel: int | None = None, trained_numel: int | None = None
    ) -> None:
        self.name = record.name
        self.incarnation = record.incarnation  # JobRecord.incarnation
        self.key = JobKey(record.name, record.verifier)  # checks attach and base proofs
        self.options = options = record.options
        self.base: Job | None = None  # set by the server when it creates or restores this job
        # one published slot is enough whatever the dtype: updates run after the commit (NOTE [Versions
        # and who may read what] rule 2)
        self.double_buffer = options.double_buffer or options.delayed_update
        self.published_dtype = options.dtype
        self.memory = memory
        self.published = PublishedStages(
            record.name, options.optimizer, options.dtype, self.double_buffer, options.frozen, memory, total_numel,
            trained_numel=trained_numel, groups=options.param_groups,  # groups: the job's parameter groups
            on_base=options.base is not None,
        )
        self.stages: list[StageState] = self.published.stages
        self.worker_table = WorkerTable(record.name, memory)
        self.snapshot: Snapshot | None = None  # the snapshot being written, if any
        self.last_snapshot_step: int | None = None
        self.last_snapshot_path: str | None = None  # where that snapshot is (not always the newest name: a damaged one may be newer)
        self.record_changed = False
        self.snapshot_failed_step: int | None = None
        """The step whose periodic snapshot failed last: not tried again until the job moves on
        (a save request still tries)."""
        """The job's record (its options: lr, schedule) changed since the last snapshot began: a
        snapshot at the same step is not the same snapshot."""
        self.versions = StageVersions(self)  # NOTE [Versions and who may read what]: fetch, pull
        self.step_commit = StepCommit(self, self.versions)  # NOTE [The step commit point]
        self.counters = JobCounters()  # bytes served, gradients, durations (server/counters.py)
        self.sealed = False
        self.timeline = Timeline()  # for ``timeline``
        self.reply_copies = ReplyCopies()  # weight copies that replies not yet sent hold (bounded)
        self.schedule = ScheduleLog()  # set_schedule's changes since the snapshots (server/schedule_log.py)
        self.last_activity = time.monotonic()  # of creation: an unsealed job idle too long is dropped

    @classmethod
    def create(cls, msg: m.CreateJob, memory: MemoryAccount) -> Job:
        return cls(JobRecord(msg.name, token_verifier(msg.token), msg.options, []), memory, msg.total_numel, msg.trained_numel)

    @classmethod
    def restore(
        cls,
        record: JobRecord,
        step: int,
        stages: Iterable[tuple[int, dict[str, torch.Tensor]]],
        memory: MemoryAccount,
        *,
        base: Job | None = None,
    ) -> Job:
        """The job as a snapshot of ``step`` holds it: sealed, every stage at version ``step``."""
        trained = sum(push_layout(s, cache=False).numel for s in record.specs)  # gradients and buffers: what has state
        job = cls(record, memory, sum(s.numel for s in record.specs), trained)
        job.base = base
        try:
            previous = job.published.load(record.specs, stages, step)
            job.reply_copies.weights = sum(st.master.nbytes for st in job.stages)
            job.versions.counts = Counter({step: len(job.stages)})
            job.step_commit.trained = sum(st.trained for st in job.stages)
            job.seal()
        except BaseException:
            job.close()
            raise
        job.last_snapshot_step = step
        job.schedule.seq = job.schedule.snapshot_seq = record.schedule_seq
        job.step_commit.open_step = step
        # a delayed job's step reads the version before it, when the snapshot kept it (NOTE
        # [Consistent snapshots] rule 5 in snapshot.py); else it is gone, and step ``step`` reads ``step``
        job.versions.base_step = step - 1 if previous and job.options.delayed_update else step
        return job

    def reads_previous(self, step: int) -> bool:
        """Whether step ``step`` reads the weights of the version before it (a delayed job's, NOTE
        [Versions and who may read what] rule 5), which its snapshot then keeps too."""
        return self.options.delayed_update and self.versions.read_version(step) == step - 1

    def snapshot_sources(self) -> list[tuple[threading.Lock, Capture]]:
        """Per stage, the lock and the capture a snapshot writer takes it with."""
        return [(st.lock, st.capture) for st in self.stages]

    def record(self) -> JobRecord:
        return JobRecord(self.name, self.key.vk, self.options, [s.spec for s in self.stages], self.incarnation, self.schedule.seq)

    # ---- creation --------------------------------------------------------------------------------
    def add_stage(self, msg: m.AddStage, frames: list[Any]) -> None:
        if self.sealed:
            raise StateError(f"job {self.name!r} is sealed: stages cannot be added any more")
        self.published.add(msg, frames)
        self.versions.counts[0] += 1
        self.step_commit.trained += self.stages[-1].trained
        self.reply_copies.weights += self.stages[-1].master.nbytes
        self.last_activity = time.monotonic()

    def seal(self, units: list[int] | None = None) -> None:
        """Make the job ready for workers; ``units`` (protocol 7, from ``seal``) becomes its
        ``options.units``."""
        if self.sealed:
            raise StateError(f"job {self.name!r} is already sealed")
        if not self.stages:
            raise LayoutError(f"job {self.name!r} has no stages: add at least one before sealing")
        if self.base is not None and len(self.stages) != len(self.base.stages):
            raise LayoutError(
                f"job {self.name!r} has {len(self.stages)} stages; its base {self.base.name!r} has "
                f"{len(self.base.stages)}: stage i of a job trains on top of stage i of its base"
            )
        units = self.options.units if units is None else units
        try:
            m.check_units(units)
        except ValueError as exc:
            raise LayoutError(f"job {self.name!r}: {exc}") from None
        if units is not None and len(units) != len(self.stages):
            raise LayoutError(
                f"job {self.name!r} has {len(self.stages)} stages, but its options' units list {len(units)}: "
                "one entry per stage (how many chain stages each holds)"
            )
        self.published.seal()
        if units is not None:
            self.options = msgspec.structs.replace(self.options, units=list(units))
            first = 0
            for st, n in zip(self.stages, units):  # errors and spans name the chain stages a unit holds
                st.chain = (first, first + n - 1)
                first += n
        self.sealed = True

    def close(self) -> None:
        """Free everything: unlink segments and release the memory reserved."""
        self.worker_table.close()
        self.published.close()

    def refuse_waiters(self, error: Callable[[bytes, int], None]) -> None:
        """Answer every request still waiting on this job with ``error`` (the job is going away):
        deferred fetches, pulls and pushes, pushes being gathered, held commits and ``await_step``."""
        for st in self.stages:
            for d in [*st.waiting_fetch, *st.waiting_pull]:
                error(d.identity, d.request_id)
            for p in st.pending.values():
                error(p.identity, p.request_id)
            if st.held is not None:
                error(st.held.push.identity, st.held.push.request_id)
                st.held = None
            for w in st.waiting_push:
                error(w.identity, w.msg.id)
            st.waiting_fetch.clear()
            st.waiting_pull.clear()
            st.pending.clear()
            st.parked.clear()
            st.waiting_push.clear()
        for d, _ in self.step_commit.waiting_commit:
            error(d.identity, d.request_id)
        self.step_commit.waiting_commit.clear()
        for d in self.versions.waiting_step:
            error(d.identity, d.request_id)
        self.versions.waiting_step.clear()

    # ---- queries -----------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.sealed

    @property
    def step(self) -> int:
        """Steps completed by every stage."""
        return self.versions.step

    @property
    def updates(self) -> int:
        """Stage updates applied since the job was created or resumed."""
        return self.counters.optimizer.count

    @property
    def updates_in_flight(self) -> int:
        """Stage updates handed to the optimizer pool and not finished."""
        return self.step_commit.updating

    @property
    def waiting_steps(self) -> int:
        """``await_step`` requests waiting for their step's updates."""
        return len(self.versions.waiting_step)

    @property
    def held_commits(self) -> int:
        """``commit`` requests held until their step commits."""
        return len(self.step_commit.waiting_commit)

    def memory_by_kind(self, workers: list[Worker] | None = None) -> dict[str, int]:
        """The bytes this job holds in the server's memory account, by kind (their sum is what
        admission control counts for it). ``workers``: a copy of the workers (the metrics thread
        passes one, NOTE in server/metrics.py)."""
        if workers is None:
            workers = list(self.workers.values())
        p = self.published
        return {
            "published": p.nbytes,
            "private": max(0, p.reserved - p.nbytes),  # 0 once closed
            "gradients": sum(w.reserved for w in workers),
            "reserve": p.ahead,
        }

    def stage(self, index: int) -> StageState:
        return self.published.stage(index)

    def worker_of(self, session: bytes) -> Worker:
        return self.worker_table.of_session(session)

    @property
    def workers(self) -> dict[int, Worker]:
        return self.worker_table.all

    def chain_stages(self, unit: int) -> int:
        """How many chain stages server stage ``unit`` holds: its ``options.units`` entry (a
        transfer unit, NOTE [Transfer units] in client/units.py), else one."""
        units = self.options.units
        return 1 if units is None else units[unit]

    @property
    def num_chain_stages(self) -> int:
        """The stages of the chain the job was made from (the server holds them in
        ``len(self.stages)`` server stages, fewer when cut into units)."""
        units = self.options.units
        return len(self.stages) if units is None else sum(units)

    @property
    def num_params(self) -> int:
        return self.published.num_params

    @property
    def reserved(self) -> int:
        """Bytes the stages hold (published and private), the workers' rings not counted."""
        return self.published.reserved

    # ---- workers -----------------------------------------------------------------------------------
    def join(self, session: bytes, msg: m.Join) -> Worker:
        if not self.ready:
            raise NotReadyError(f"job {self.name!r} is still uploading its weights")
        if self.options.frozen:
            raise StateError(
                f"job {self.name!r} is a frozen base: nothing trains it; create a job on top of it "
                "(create_job(..., base=...)) and train that"
            )
        if not msg.reader and all(st.grad is None for st in self.stages):
            raise StateError(
                f"job {self.name!r} has nothing to train: every parameter of every stage is frozen and no stage has "
                "a buffer, so no step would ever commit; join as a reader to read its weights"
            )
        # a slot holds any stage's push: the stage's size, or its push layout where that is longer
        # (parameters laid out unaligned: each trained one's gradient starts aligned)
        numel = max([self.published.max_stage_numel, *(st.grad.numel() for st in self.stages if st.grad is not None)])
        # NOTE [The step commit point] rule 5: the open step, unless part of it is gathered already
        joins_open = not self.worker_table.started or not self.contributors
        first_step = self.open_step if joins_open else self.open_step + 1
        return self.worker_table.join(session, msg, first_step, numel, align(numel * 4), self._step_ring(msg))

    def _step_ring(self, msg: m.Join) -> list[int] | None:
        """Each stage's push numel when ``msg`` may have a step ring (``Join.step_ring``): a lone
        shared-memory worker, with no other worker pushing; else None."""
        alone = not any(not w.reader for w in self.workers.values())
        if not (msg.step_ring and msg.shm and not msg.reader and msg.world_size == 1 and alone):
            return None
        return [0 if st.grad is None else st.grad.numel() for st in self.stages]

    def open_barrier(self, submit: Submit) -> list[Outgoing]:
        """Start training once ``world_size`` workers have joined (checked after every join)."""
        pushers = self.worker_table.barrier_opens()
        if pushers is None:
            return []
        self.counters.steps.start(time.monotonic())
        log.info("job %r: %d worker(s) joined, training starts", self.name, pushers)
        return self.step_commit.check_complete(self.stages, submit)

    def remove_worker(self, worker_id: int, submit: Submit, end_session: EndSession, reason: str) -> list[Outgoing]:
        """Detach a worker. If the open step holds a gradient of its, the step is discarded on
        every stage and the other contributors are sent back to train it again (NOTE [The step
        commit point] rule 4); otherwise the step goes on without it."""
        w = self.worker_table.pop(worker_id)
        if w is None:
            return []
        log.info("job %r: worker %d detached (%s)", self.name, worker_id, reason)
        out = self.versions.worker_left(worker_id, reason)
        out += self.step_commit.worker_left(worker_id, submit, end_session, reason)
        self.worker_table.free(w)
        if self.worker_table.started and not self.worker_table.expected(self.open_step):
            ahead = [v.id for v in self.workers.values() if not v.reader and v.first_step > self.open_step]
            for wid in ahead:  # nobody is left to train the open step: they must train it (rule 4)
                end_session(wid, f"step {self.open_step} has no worker left to train it")
        return out

    # ---- fetch / push / commit / pull: the requests the handlers hand the job's parts ------------
    def fetch(self, msg: m.Fetch, identity: bytes, worker: Worker) -> Outgoing | None:
        """The weights step ``msg.step`` computes on, now or once its stage's update is done."""
        return self.versions.fetch(msg, identity, worker)

    def push(self, msg: m.Push, frames: list[Any], identity: bytes, worker: Worker, submit: Submit) -> list[Outgoing]:
        """Accept a gradient (its gather queued, or its slot held); returns the replies of a step
        that this push completes (a held push may commit the step at once)."""
        return self.step_commit.push(msg, frames, identity, worker, submit)

    def commit(self, msg: m.Commit, identity: bytes, worker: Worker) -> Outgoing | None:
        """Answer when step ``msg.step`` commits (held until then; a delayed job's worker may
        already say so for the step after the open one)."""
        return self.step_commit.commit(msg, identity, worker)

    def pull(self, msg: m.Pull, identity: bytes) -> Outgoing | None:
        """The stage's master, now or once its update is done."""
        return self.versions.pull(msg, identity)

    def await_step(self, msg: m.AwaitStep, identity: bytes) -> Outgoing | None:
        """``step_reached`` once every stage holds the weights after ``msg.step`` steps, a step
        no further than the one after the step the job gathers (NOTE [Versions and who may read
        what] rule 6)."""
        gathering = self.open_step
        if msg.step > gathering + 1:
            raise StaleStepError(
                f"job {self.name!r} gathers step {gathering}: step {msg.step} is more than one step past it "
                f"(wait for step {gathering + 1} first)"
            )
        return self.versions.await_step(msg, identity)

    def set_schedule(self, lr: float | None, schedule: Any) -> None:
        """A new base lr and/or schedule, used from the next commit on (``set_schedule``), noted in
        :attr:`schedule` (NOTE [Schedule changes kept between snapshots] in snapshot.py)."""
        opt = self.options.optimizer
        new = msgspec.structs.replace(
            opt, lr=opt.lr if lr is None else lr, schedule=opt.schedule if schedule is None else schedule
        )
        self.options = msgspec.structs.replace(self.options, optimizer=new)
        self.record_changed = True
        self.schedule.add(self.open_step, new)
        log.info("job %r: lr %g, schedule %r from step %d on", self.name, new.lr, new.schedule, self.open_step)

    def resume_schedule(self, entries: list[dict[str, Any]]) -> None:
        """Take the logged schedule changes of a restored job at its open step (NOTE [Schedule
        changes kept between snapshots] in snapshot.py, rule 3): those of that step now, the later
        ones as their steps open (:meth:`step_opened`)."""
        spec = self.schedule.resume(entries, self.open_step, type(self.options.optimizer), self.name)
        if spec is not None:
            self.options = msgspec.structs.replace(self.options, optimizer=spec)

    def step_opened(self, step: int) -> None:
        """The job gathers ``step`` now: a logged schedule change of that step takes effect."""
        for spec in self.schedule.opened(step):
            self.options = msgspec.structs.replace(self.options, optimizer=spec)
            log.info("job %r: lr %g, schedule %r from step %d on (a change replayed)", self.name, spec.lr, spec.schedule, step)

    # ---- the pool's completions ----------------------------------------------------------------------
    def finish_task(self, task: PoolTask, error: BaseException | None, submit: Submit) -> list[Outgoing]:
        """Called on the loop thread when a pool task completes."""
        return self.step_commit.finish_task(task, error, submit)

    def consistent_step(self) -> int | None:
        """The step every stage is at, when all are at the same one and none is updating."""
        if self.step_commit.updating or len(self.versions.counts) != 1 or not self.sealed:
            return None
        return next(iter(self.versions.counts))

    # ---- the commit point's state that others read (handlers, views, metrics, the pool's tasks) -----
    @property
    def open_step(self) -> int:
        """The step whose gradients are being gathered."""
        return self.step_commit.open_step

    @property
    def attempt(self) -> int:
        """Bumped at every commit and discard: a gather of an older attempt adds nothing."""
        return self.step_commit.attempt

    @property
    def contributors(self) -> set[int]:
        """Workers with a gradient accepted for the open step."""
        return self.step_commit.contributors

    @property
    def waiting_commit(self) -> list[tuple[Deferred, int]]:
        """Held ``commit`` requests: (request, worker id) until the commit."""
        return self.step_commit.waiting_commit

    @property
    def last_commit(self) -> CommitRecord | None:
        """The newest commit (one reference: the metrics thread reads it)."""
        return self.step_commit.last_commit

    @property
    def skipped_steps(self) -> int:
        """Steps committed without an update (a gradient norm that is not finite)."""
        return self.step_commit.skipped_steps

    @property
    def discarded_steps(self) -> int:
        """Open steps discarded because a worker that had pushed part of them left."""
        return self.step_commit.discarded_steps
