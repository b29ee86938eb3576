"""One job's state on the server: stages, versions, workers, pending gradients.

Nothing here touches a socket. Each method returns the replies to send (:class:`Outgoing`) and
queues stage updates through the ``submit`` callback; :mod:`wstream.server.handlers` calls them.
The parts a job is made of live next to it: its stages and their shared-memory segment in
:mod:`~wstream.server.published`, one stage's state and update in :mod:`~wstream.server.stage_state`,
its workers in :mod:`~wstream.server.workers`; this module keeps the rules that tie them together.

# NOTE [Versions and who may read what]
# 1. ``stage.version`` counts the updates applied to a stage: version t holds the weights that
#    step t reads. Stages change version only after their step committed (NOTE below).
# 2. A worker pushes (i, t) only after its last use of w_i(t) (it copies weights into its own
#    buffer at fetch time, or reads them in place and is done with them), so once every expected
#    worker pushed (i, t) nobody still reads w_i(t). That is why, with one published slot, the
#    update can write the slot in place: it runs only after the step committed.
# 3. ``fetch(i, t+1)`` arriving before the update of (i, t) completes is deferred, and answered
#    when the version flips. ``pull(i)`` is deferred while stage i updates (no torn reads).
# 4. Gradient slot s of a worker is busy from its push until the reply ``pushed`` (sent once the
#    gradient is added into the stage's accumulator); a push into a busy slot is an error.
# 5. A job with ``delayed_update`` reads one version behind: step t reads w_i(t - 1) (but the
#    first step after creation or a restore reads the weights it starts from, and steps before
#    ``delay_after`` read w_i(t) as synchronous training does), while the update
#    of (i, t - 1) may be running. Such a job always has two slots: version v is in slot v % 2, and
#    the update (i, t) -> t + 1 writes slot (t + 1) % 2 = (t - 1) % 2 only after step t committed,
#    i.e. after every expected worker's last read of w_i(t - 1) (rule 2).
#
# NOTE [The step commit point]
# A step is all-or-nothing: no stage is updated for step t before every gradient of step t is in.
# 1. ``push(i, t)`` is accepted while the job's open step is t (``open_step``) and stage i is at
#    version t; a gather task adds the slot into the stage's fp32 accumulator ``grad`` (copy for
#    the first gradient of the attempt, add for the others) and ``pushed`` frees the slot.
# 2. The step *commits* when every trained stage holds the gradient of every expected worker
#    (live, ``first_step <= t``, not a reader) and its squared norm: the global gradient norm is
#    then known, so clipping is exact (one factor for every stage, folded into the fused
#    kernel's ``grad_scale`` with the mean over workers). A non-finite norm commits the step
#    without an update (``skipped``: weights and optimizer state unchanged, as a loss scaler
#    skips a step). The learning rate is the schedule's at step t.
# 3. At the commit every stage is marked updating and its update queued in the order the next
#    step needs it (forward order; backward order for a delayed job), the held ``commit``
#    requests are answered, and ``open_step`` becomes t + 1. The next step's forward overlaps
#    the updates: its fetch of stage i waits for stage i's update only.
# 4. A worker that leaves (dies, stalls past its lease, or quits) while the open step holds any
#    gradient of its (``contributors``) poisons the step: the step is *discarded* on every stage
#    (accumulators forgotten: a new ``attempt`` starts; gather tasks of the old attempt add
#    nothing), and every other contributor's session is ended, so its trainer re-attaches and
#    trains step t again (or, if it had moved on, is told to resync). Nothing was applied, so
#    every stage is still at t: the job is consistent at every moment. A worker that leaves
#    having pushed nothing of the open step only stops being expected. Workers that joined for
#    step t + 1 are sent back the same way when nobody is left to train step t.
# 5. A worker that joins trains the open step when nothing of it has been gathered yet (or the
#    start barrier is still shut), else the next one.
# 6. A delayed-update job may push (i, t + 1) while stage i is still at t (its forward read
#    t - 1); such a push is held (``waiting_push``) until the stage reaches t + 1.
#
# NOTE [Held gradient slots]
# A step's gradient must live somewhere from its push to its commit. With several workers it is
# their sum, in the stage's accumulator ``grad`` (a gather copies or adds each slot into it and
# frees the slot). With one worker the sum *is* its slot, so the copy (8 bytes/parameter, plus 4
# for the norm) is avoidable: the update can read the slot in place. But the ring is small (2
# slots by default) and a step pushes every trained stage, so slots held until the commit would
# leave the worker without a free slot before its last push, and the commit waits for that push:
# a deadlock. So a push is *held* only when holding cannot block the worker:
# 1. It carries its norm (``Push.sumsq``: the worker measured its gradient, so no server pass
#    does), the job is not delayed (its updates of step t run during step t + 1) and its worker
#    is the only one the open step waits for (the start barrier opened; ``expected`` can only
#    shrink once a gradient of the step is accepted: a worker joining then trains the next step,
#    NOTE [The step commit point] rule 5).
# 2. ``held + 1 + remaining <= ring``: the worker's slots held already (by this step or an
#    update of the last one still running), this one, and one for each push the worker still owes
#    the step (trained stages it has not pushed yet) fit in its ring. Every later push then finds
#    a slot that no hold keeps (gathered slots come back without waiting for anything), so the
#    worker never waits on a hold before its commit. In a backward pass this holds the step's
#    last ``ring`` pushes: stages 0, 1 of a chain, which the next step's forward reads first.
# 3. A held push counts as gathered at once (its norm is the worker's); the stage's update
#    reads the gradient (and the buffers' values) from the slot and answers ``pushed`` when it is
#    done, which frees the slot. A step discarded before its commit answers held pushes with the
#    error as it does pending ones; a committed step's held slot stays mapped (the server holds
#    its own mapping) until its update, even when its worker left meanwhile.
# Otherwise the push is gathered as before; a lone worker's norm still spares the gather's norm
# pass. The norm each stage adds to the global one is the same float either way: the fp32
# ``vector_norm`` of that stage's gradient sum, squared in float64 (``squared_norm``; the worker
# computes it on its slot, which with one worker is that sum).
#
# NOTE [Buffers]
# A stage's buffers (``ParamSpec.buffer``: BatchNorm's running statistics and count) are frozen
# entries of its layout: in the master, published, snapshotted and pulled like weights, with no
# gradient and no optimizer state. Each worker's push carries them after the gradient
# (``push_layout``): a float's new value, an integer's increment. They are gathered with it (the
# accumulator sums them, so a stage with buffers is "trained" even when no parameter is), left out
# of the norm, and applied by the stage's update after the commit: the value becomes the mean over
# the W expected workers (the sum divided by W: exact for one worker), the count grows by the mean
# increment. So buffers move with the step, atomically, and a skipped step leaves them too.
# Why the mean and not one rank's (DDP broadcasts rank 0's buffers before each forward): wstream
# workers have no ranks and come and go, every worker's batch counts as its gradient does, and for
# a running mean with equal batches the mean is the statistic of the whole batch.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from wstream.protocol import (
    InternalError,
    LayoutError,
    NotReadyError,
    SessionExpiredError,
    StaleStepError,
    StateError,
)
from wstream.protocol import messages as m
from wstream.protocol.lr_schedules import lr_at

from .counters import JobCounters, Timeline
from .job_key import JobKey, token_verifier
from .memory import MemoryAccount
from .outgoing import Outgoing
from .published import PublishedStages
from .snapshot import JobRecord, Snapshot
from .stage_state import (
    Deferred,
    DeferredPush,
    GatherTask,
    HeldPush,
    NormTask,
    PoolTask,
    StageState,
    UpdateTask,
    align,
)
from .workers import MAX_WAITING_FETCHES, Worker, WorkerTable

__all__ = ["MAX_WAITING_FETCHES", "CommitRecord", "Job", "Outgoing", "PoolTask", "UpdateTask", "token_verifier"]

COMMITS_KEPT = 8
"""Committed steps whose outcome a late ``commit`` request can still be answered with."""

Submit = Callable[[PoolTask], None]
EndSession = Callable[[int, str], None]
"""Ends the session of worker ``id`` with a reason (the handlers do: it needs the session table)."""


@dataclass(frozen=True, slots=True)
class CommitRecord:
    """How step ``step`` committed (the ``committed`` reply, status and metrics read it)."""

    step: int
    grad_norm: float
    lr: float
    skipped: bool
    clip: float

log = logging.getLogger(__name__)


class Job:
    """A job: its stages in shared memory, its optimizer, its workers and sessions."""

    def __init__(self, record: JobRecord, memory: MemoryAccount, total_numel: int | None = None) -> None:
        self.name = record.name
        self.key = JobKey(record.name, record.verifier)  # checks attach and base proofs
        self.options = options = record.options
        self.base: Job | None = None  # set by the server when it creates or restores this job
        # one published slot is enough whatever the dtype: updates run after the commit (NOTE rule 2)
        self.double_buffer = options.double_buffer or options.delayed_update
        self.base_step = 0  # delayed updates read max(t - 1, base_step): see NOTE rule 5
        self.published_dtype = options.dtype
        self.memory = memory
        self.published = PublishedStages(
            record.name, options.optimizer, options.dtype, self.double_buffer, options.frozen, memory, total_numel,
            groups=options.param_groups,  # groups: the job's parameter groups
            on_base=options.base is not None,
        )
        self.stages: list[StageState] = self.published.stages
        self.worker_table = WorkerTable(record.name, memory)
        self.snapshot: Snapshot | None = None  # the snapshot being written, if any
        self.last_snapshot_step: int | None = None
        self._versions: Counter[int] = Counter()  # stage version -> how many stages are at it
        self._updating = 0
        # the step commit point (NOTE [The step commit point])
        self.open_step = 0  # the step whose gradients are being gathered
        self.attempt = 0  # bumped at every commit and discard: a gather of an older attempt adds nothing
        self.contributors: set[int] = set()  # workers with a gradient accepted for the open step
        self._complete: set[int] = set()  # trained stages holding every expected gradient and its norm
        self._trained = 0  # stages with something to train
        self.waiting_commit: list[tuple[Deferred, int]] = []  # (request, worker id) until the commit
        self.commits: deque[CommitRecord] = deque(maxlen=COMMITS_KEPT)
        self.last_commit: CommitRecord | None = None  # the newest (one reference: the metrics thread reads it)
        self.skipped_steps = 0
        self.discarded_steps = 0
        self.counters = JobCounters()  # bytes served, gradients, durations (server/counters.py)
        self.sealed = False
        self.timeline = Timeline()  # for ``timeline``
        self.last_activity = time.monotonic()  # of creation: an unsealed job idle too long is dropped

    @classmethod
    def create(cls, msg: m.CreateJob, memory: MemoryAccount) -> Job:
        return cls(JobRecord(msg.name, token_verifier(msg.token), msg.options, []), memory, msg.total_numel)

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
        job = cls(record, memory, sum(s.numel for s in record.specs))
        job.base = base
        try:
            job.published.load(record.specs, stages, step)
            job._versions = Counter({step: len(job.stages)})
            job._trained = sum(st.trained for st in job.stages)
            job.seal()
        except BaseException:
            job.close()
            raise
        job.last_snapshot_step = step
        job.open_step = step
        job.base_step = step  # the weights before ``step`` are gone: the first step reads ``step``
        return job

    def snapshot_sources(self) -> list[tuple[threading.Lock, Callable[[], dict[str, torch.Tensor]]]]:
        """Per stage, the lock and the capture a snapshot writer takes it with."""
        return [(st.lock, st.capture) for st in self.stages]

    def record(self) -> JobRecord:
        return JobRecord(self.name, self.key.vk, self.options, [s.spec for s in self.stages])

    # ---- creation --------------------------------------------------------------------------------
    def add_stage(self, msg: m.AddStage, frames: list[Any]) -> None:
        if self.sealed:
            raise StateError(f"job {self.name!r} is sealed: stages cannot be added any more")
        self.published.add(msg, frames)
        self._versions[0] += 1
        self._trained += self.stages[-1].trained
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
        if units is not None and len(units) != len(self.stages):
            raise LayoutError(
                f"job {self.name!r} has {len(self.stages)} stages, but its options' units list {len(units)}: "
                "one entry per stage (how many chain stages each holds)"
            )
        self.published.seal()
        if units is not None:
            self.options = msgspec.structs.replace(self.options, units=list(units))
        self.sealed = True

    def close(self) -> None:
        """Free everything: unlink segments and release the memory reserved."""
        self.worker_table.close()
        self.published.close()

    def refuse_waiters(self, error: Callable[[bytes, int], None]) -> None:
        """Answer every request still waiting on this job with ``error`` (the job is going away):
        deferred fetches, pulls and pushes, pushes being gathered, and held commits."""
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
            st.waiting_push.clear()
        for d, _ in self.waiting_commit:
            error(d.identity, d.request_id)
        self.waiting_commit.clear()

    # ---- queries -----------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.sealed

    @property
    def step(self) -> int:
        """Steps completed by every stage."""
        return min(self._versions, default=0)

    @property
    def updates(self) -> int:
        """Stage updates applied since the job was created or resumed."""
        return self.counters.optimizer.count

    @property
    def updates_in_flight(self) -> int:
        """Stage updates handed to the optimizer pool and not finished."""
        return self._updating

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
            "reserve": p.slack,
        }

    def stage(self, index: int) -> StageState:
        return self.published.stage(index)

    def worker_of(self, session: bytes) -> Worker:
        return self.worker_table.of_session(session)

    @property
    def workers(self) -> dict[int, Worker]:
        return self.worker_table.all

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
        numel = self.published.max_stage_numel
        # NOTE [The step commit point] rule 5: the open step, unless part of it is gathered already
        joins_open = not self.worker_table.started or not self.contributors
        first_step = self.open_step if joins_open else self.open_step + 1
        return self.worker_table.join(session, msg, first_step, numel, align(numel * 4))

    def open_barrier(self, submit: Submit) -> list[Outgoing]:
        """Start training once ``world_size`` workers have joined (checked after every join)."""
        pushers = self.worker_table.barrier_opens()
        if pushers is None:
            return []
        self.counters.steps.start(time.monotonic())
        log.info("job %r: %d worker(s) joined, training starts", self.name, pushers)
        return self._check_complete(self.stages, submit)

    def remove_worker(self, worker_id: int, submit: Submit, end_session: EndSession, reason: str) -> list[Outgoing]:
        """Detach a worker. If the open step holds a gradient of its, the step is discarded on
        every stage and the other contributors are sent back to train it again (NOTE [The step
        commit point] rule 4); otherwise the step goes on without it."""
        w = self.worker_table.pop(worker_id)
        if w is None:
            return []
        log.info("job %r: worker %d detached (%s)", self.name, worker_id, reason)
        out: list[Outgoing] = []
        if worker_id in self.contributors:
            out += self._discard_open_step(worker_id, end_session, reason)
        else:  # its held commits are answered: its session is gone, so it will never see the step
            gone = SessionExpiredError(f"job {self.name!r}: worker {worker_id} detached ({reason}) before its step committed")
            mine = [d for d, wid in self.waiting_commit if wid == worker_id]
            self.waiting_commit = [c for c in self.waiting_commit if c[1] != worker_id]
            out += [Outgoing.error(d.identity, d.request_id, gone) for d in mine]
            out += self._check_complete(self.stages, submit)
        self.worker_table.free(w)
        if self.worker_table.started and not self.worker_table.expected(self.open_step):
            ahead = [v.id for v in self.workers.values() if not v.reader and v.first_step > self.open_step]
            for wid in ahead:  # nobody is left to train the open step: they must train it (rule 4)
                end_session(wid, f"step {self.open_step} has no worker left to train it")
        return out

    def _discard_open_step(self, leaver: int, end_session: EndSession, reason: str) -> list[Outgoing]:
        t = self.open_step
        others = sorted(self.contributors - {leaver})
        log.warning(
            "job %r: step %d discarded on every stage (worker %d left after pushing part of it: %s)%s",
            self.name, t, leaver, reason, f"; workers {others} train it again" if others else "",
        )
        self.attempt += 1
        self.discarded_steps += 1
        self.contributors.clear()
        self._complete.clear()
        gone = SessionExpiredError(
            f"job {self.name!r}: step {t} was discarded because worker {leaver} left after pushing part of it "
            f"({reason}); attach again and train step {t}"
        )
        out: list[Outgoing] = []
        for st in self.stages:
            st.gathered.clear()
            for p in st.pending.values():  # their gathers add nothing now; the slots die with the sessions
                out.append(Outgoing.error(p.identity, p.request_id, gone))
            st.pending = {}
            if st.held is not None and st.held.attempt == self.attempt - 1:  # of the discarded step
                out.append(Outgoing.error(st.held.push.identity, st.held.push.request_id, gone))
                held_by = self.workers.get(st.held.worker)
                if held_by is not None:
                    held_by.held.discard(st.held.push.slot)
                    held_by.busy.discard(st.held.push.slot)
                st.held = None
        for d, _ in self.waiting_commit:
            out.append(Outgoing.error(d.identity, d.request_id, gone))
        self.waiting_commit = []
        for wid in others:
            end_session(wid, f"step {t} discarded")
        return out

    # ---- fetch / push / pull -------------------------------------------------------------------
    def fetch(self, msg: m.Fetch, identity: bytes, worker: Worker) -> Outgoing | None:
        if not self.ready:
            raise NotReadyError(f"job {self.name!r} is still uploading its weights")
        st = self.stage(msg.stage)
        t = self.read_version(msg.step)
        if t == st.version and (not st.updating or not st.single_slot):  # an update writes the other slot
            return self._weights_reply(st, t, identity, msg.id, worker.shm)
        if self.options.delayed_update and t == st.version - 1 and not st.updating:  # NOTE rule 5
            return self._weights_reply(st, t, identity, msg.id, worker.shm)
        if t == st.version + 1:
            if worker.waiting >= MAX_WAITING_FETCHES:
                raise StateError(
                    f"this worker already has {worker.waiting} fetches waiting for updates (the limit is "
                    f"{MAX_WAITING_FETCHES}): wait for their replies"
                )
            worker.waiting += 1
            st.waiting_fetch.append(Deferred(identity, msg.id, t, worker.shm, worker))
            return None
        if t > st.version + 1:
            raise StaleStepError(
                f"stage {msg.stage} is at step {st.version}; step {msg.step} is more than one step ahead"
            )
        raise StaleStepError(
            f"stage {msg.stage} weights of step {t} were replaced (the stage is at step "
            f"{st.version}{', updating' if st.updating else ''})"
        )

    def read_version(self, step: int) -> int:
        """The weights version step ``step`` computes on (NOTE rule 5)."""
        if not self.options.delayed_update or step < self.options.delay_after:
            return step
        return max(step - 1, self.base_step)

    def _weights_reply(self, st: StageState, version: int, identity: bytes, request_id: int, shm: bool) -> Outgoing:
        base = self.base.stages[st.index] if self.base is not None else None
        return st.weights_reply(version, identity, request_id, shm, base, self.counters.served)

    def push(self, msg: m.Push, frames: list[Any], identity: bytes, worker: Worker, submit: Submit) -> list[Outgoing]:
        """Accept a gradient (its gather queued, or its slot held); returns the replies of a step
        that this push completes (a held push may commit the step at once)."""
        st = self.stage(msg.stage)
        if self.options.delayed_update and st.version < msg.step <= self.open_step + 1:
            if len(st.waiting_push) >= len(worker.slots) * max(1, len(self.workers)):
                raise StateError(f"too many pushes held for stage {st.index}: wait for their replies")
            st.waiting_push.append(DeferredPush(msg, frames, identity, worker))  # NOTE rule 6
            return []
        return self._accept_push(st, msg, frames, identity, worker, submit)

    def _accept_push(
        self, st: StageState, msg: m.Push, frames: list[Any], identity: bytes, worker: Worker, submit: Submit
    ) -> list[Outgoing]:
        if msg.step != self.open_step and msg.step == st.version:
            raise StaleStepError(
                f"gradient of stage {msg.stage} step {msg.step}: the job gathers step {self.open_step}"
            )
        pending = st.accept_push(msg, frames, identity, worker)
        self.contributors.add(worker.id)
        self.counters.gradients += 1
        assert st.grad is not None
        self.counters.gradient_bytes += st.grad.numel() * 4
        attempt, pushes = worker.pushes
        pushes = pushes + 1 if attempt == self.attempt else 1
        worker.pushes = (self.attempt, pushes)
        expected_set = self.worker_table.expected(self.open_step) if self.worker_table.started else set()
        expected = len(expected_set)
        source = worker.slots[pending.slot][: st.grad.numel()]
        if (  # NOTE [Held gradient slots] rules 1 and 2
            msg.sumsq is not None
            and not self.options.delayed_update
            and expected_set == {worker.id}
            and len(worker.held) + 1 + (self._trained - pushes) <= len(worker.slots)
        ):
            del st.pending[worker.id]
            st.held = HeldPush(worker.id, pending, source, self.attempt)
            worker.held.add(pending.slot)
            st.gathered.add(worker.id)
            st.sumsq = (self.attempt, 1, msg.sumsq)
            self.counters.held_gradients += 1
            now = time.monotonic_ns()  # taken without a task: an instant in the gather category
            self.timeline.add(f"held {st.index}", "gather", "held gradients", now, now, st.index, self.open_step)
            return self._check_complete([st], submit)
        st.gathering += 1
        submit(GatherTask(self, st, worker.id, source, self.attempt, expected, msg.sumsq if expected == 1 else None))
        return []

    def commit(self, msg: m.Commit, identity: bytes, worker: Worker) -> Outgoing | None:
        """Answer when step ``msg.step`` commits (held until then; a delayed job's worker may
        already say so for the step after the open one)."""
        if self.open_step <= msg.step <= self.open_step + 1:
            self.waiting_commit.append((Deferred(identity, msg.id, msg.step), worker.id))
            return None
        for rec in self.commits:
            if rec.step == msg.step:
                return Outgoing(identity, committed_reply(msg.id, rec))
        if msg.step < self.open_step:
            raise StaleStepError(
                f"step {msg.step} committed long ago (the job gathers step {self.open_step}); its outcome is not kept"
            )
        raise StaleStepError(f"step {msg.step} is ahead of the job, which gathers step {self.open_step}")

    def set_schedule(self, lr: float | None, schedule: Any) -> None:
        """A new base lr and/or schedule, used from the next commit on (``set_schedule``)."""
        opt = self.options.optimizer
        new = msgspec.structs.replace(
            opt, lr=opt.lr if lr is None else lr, schedule=opt.schedule if schedule is None else schedule
        )
        self.options = msgspec.structs.replace(self.options, optimizer=new)
        log.info("job %r: lr %g, schedule %r from step %d on", self.name, new.lr, new.schedule, self.open_step)

    # ---- the pool's completions ----------------------------------------------------------------------
    def finish_task(self, task: PoolTask, error: BaseException | None, submit: Submit) -> list[Outgoing]:
        """Called on the loop thread when a pool task completes."""
        if isinstance(task, UpdateTask):
            return self.finish_update(task, error, submit)
        if isinstance(task, GatherTask):
            return self._finish_gather(task, error, submit)
        task.stage.gathering -= 1  # a NormTask
        return self._check_complete([task.stage], submit)

    def _finish_gather(self, task: GatherTask, error: BaseException | None, submit: Submit) -> list[Outgoing]:
        st = task.stage
        st.gathering -= 1
        if task.attempt != self.attempt:
            return []  # discarded meanwhile: its push was answered then
        p = st.pending.pop(task.worker, None)
        w = self.workers.get(task.worker)
        if p is None or w is None:
            return []
        w.busy.discard(p.slot)
        self.timeline.add(f"gather {st.index}", "gather", task.thread, task.started_ns,
                          task.started_ns + int(task.seconds * 1e9), st.index, self.open_step)
        if error is not None:
            return [Outgoing(p.identity, m.Error(id=p.request_id, code="internal", message=f"gather failed: {error}"))]
        st.gathered.add(task.worker)
        out = [Outgoing(p.identity, m.Pushed(id=p.request_id, stage=st.index, step=self.open_step, slot=p.slot))]
        return out + self._check_complete([st], submit)

    def _check_complete(self, stages: Iterable[StageState], submit: Submit) -> list[Outgoing]:
        """Note the stages that now hold every expected gradient of the open step (and ask for a
        norm where no gather computed it); commit when all do."""
        if not self.worker_table.started or not self.contributors:
            return []
        expected = self.worker_table.expected(self.open_step)
        if not expected:
            return []
        for st in stages:
            if st.index in self._complete or not st.trained or st.gathering or not expected <= st.gathered:
                continue
            if st.sumsq is not None and st.sumsq[:2] == (self.attempt, len(st.gathered)):
                self._complete.add(st.index)
            else:
                st.gathering += 1
                submit(NormTask(self, st, self.attempt))
        if len(self._complete) < self._trained:
            return []
        return self._commit(len(expected), submit)

    def _commit(self, workers: int, submit: Submit) -> list[Outgoing]:
        """NOTE [The step commit point] rules 2 and 3."""
        t = self.open_step
        spec = self.options.optimizer
        norm = math.sqrt(sum(st.sumsq[2] for st in self.stages if st.sumsq is not None and st.trained)) / workers
        lr = lr_at(spec.schedule, spec.lr, t)
        skipped = not math.isfinite(norm)
        clip = 1.0
        if not skipped and spec.clip_grad_norm is not None:
            clip = min(1.0, spec.clip_grad_norm / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_
        record = CommitRecord(t, norm, lr, skipped, clip)
        self.commits.append(record)
        self.last_commit = record
        if skipped:
            self.skipped_steps += 1
            log.warning("job %r: step %d has a gradient norm of %s: no stage is updated", self.name, t, norm)
        order = reversed(self.stages) if self.options.delayed_update else iter(self.stages)
        now = time.monotonic_ns()
        for st in order:
            st.updating = True
            self._updating += 1
            st.gathered.clear()
            source = st.held.source if st.held is not None else None
            submit(UpdateTask(
                self, st, grad_scale=workers / clip, lr=lr, apply=not skipped, workers=workers, source=source, submitted_ns=now,
            ))
        self.open_step = t + 1
        self.attempt += 1  # the accumulators start again for the next step
        self.contributors.clear()
        self._complete.clear()
        out = [Outgoing(d.identity, committed_reply(d.request_id, record)) for d, _ in self.waiting_commit if d.step == t]
        self.waiting_commit = [c for c in self.waiting_commit if c[0].step != t]
        return out

    def finish_update(self, task: UpdateTask, error: BaseException | None, submit: Submit) -> list[Outgoing]:
        """Called on the loop thread when an update completes: flip the version, answer waiters."""
        st = task.stage
        st.updating = False
        self._updating -= 1
        if task.started_ns:
            end = task.started_ns + int(task.seconds * 1e9)
            self.timeline.add(f"queued {st.index}", "queue", "update queue", task.submitted_ns, task.started_ns, st.index, st.version)
            self.timeline.add(f"update {st.index}", "optimizer", task.thread, task.started_ns, end, st.index, st.version)
        if error is not None:  # a bug: the stage stays at its version, and who waits for it is told
            log.error("job %r stage %d: the update of step %d failed: %r", self.name, st.index, st.version, error)
            failed = InternalError(f"the update of stage {st.index} step {st.version} failed: {error!r} (a bug in wstream)")
            waiting = [*st.waiting_fetch, *st.waiting_pull]
            st.waiting_fetch, st.waiting_pull = [], []
            for d in waiting:
                if d.worker is not None:
                    d.worker.waiting -= 1
            held = [Outgoing.error(o.identity, o.message.id, failed) for o in self._release_held(st)]
            return [Outgoing.error(d.identity, d.request_id, failed) for d in waiting] + held
        out = self._release_held(st)
        self._set_version(st, st.version + 1)
        if task.apply:
            self.counters.optimizer.observe(task.seconds)
            st.updates += 1
            st.optimizer_s += task.seconds
            st.last_optimizer_s = task.seconds
        out += self._answer_waiters(st)
        held = st.waiting_push
        st.waiting_push = []
        for d in held:  # NOTE rule 6: a delayed job's pushes of the step the stage reached now
            if d.worker.id not in self.workers:
                continue
            try:
                out += self._accept_push(st, d.msg, d.frames, d.identity, d.worker, submit)
            except Exception as exc:  # answered as the push would have been
                out.append(Outgoing.error(d.identity, d.msg.id, exc))
        return out

    def _release_held(self, st: StageState) -> list[Outgoing]:
        """The stage's update has read its held slot: free it and answer its push (NOTE [Held
        gradient slots] rule 3)."""
        h = st.held
        if h is None:
            return []
        st.held = None
        w = self.workers.get(h.worker)
        if w is None:  # it left after the commit: its session is gone, nobody waits for the reply
            return []
        w.held.discard(h.push.slot)
        w.busy.discard(h.push.slot)
        return [Outgoing(h.push.identity, m.Pushed(id=h.push.request_id, stage=st.index, step=st.version, slot=h.push.slot))]

    def _set_version(self, st: StageState, version: int) -> None:
        old = st.version
        self._versions[old] -= 1
        st.version = version
        self._versions[version] += 1
        if not self._versions[old]:
            del self._versions[old]
            step = min(self._versions)
            if step > old:  # ``old`` was the job's step and no stage is left at it
                self.counters.steps.add(step - old, time.monotonic())

    def _answer_waiters(self, st: StageState) -> list[Outgoing]:
        out = []
        waiting = st.waiting_fetch
        st.waiting_fetch = []
        for d in waiting:
            if d.step == st.version:
                out.append(self._weights_reply(st, d.step, d.identity, d.request_id, d.shm))
                self.timeline.add(f"fetch {st.index} waited", "deferred", "deferred fetches", d.since_ns, time.monotonic_ns(), st.index, d.step)
                if d.worker is not None:
                    d.worker.waiting -= 1
            else:
                st.waiting_fetch.append(d)
        pulls = st.waiting_pull
        st.waiting_pull = []
        out.extend(self.pull_reply(st, d.identity, d.request_id) for d in pulls)
        return out

    def consistent_step(self) -> int | None:
        """The step every stage is at, when all are at the same one and none is updating."""
        if self._updating or len(self._versions) != 1 or not self.sealed:
            return None
        return next(iter(self._versions))

    def pull(self, msg: m.Pull, identity: bytes) -> Outgoing | None:
        if not self.ready:
            raise NotReadyError(f"job {self.name!r} is still uploading its weights")
        st = self.stage(msg.stage)
        if st.updating:
            st.waiting_pull.append(Deferred(identity, msg.id))
            return None
        return self.pull_reply(st, identity, msg.id)

    def pull_reply(self, st: StageState, identity: bytes, request_id: int) -> Outgoing:
        return st.master_reply(identity, request_id, self.counters.served)


def committed_reply(request_id: int, rec: CommitRecord) -> m.Committed:
    return m.Committed(id=request_id, step=rec.step, grad_norm=rec.grad_norm, lr=rec.lr, skipped=rec.skipped, clip=rec.clip)
