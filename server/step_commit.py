"""The step commit point of one job: the open step's gradients accepted (gathered, or held in their
slots), the commit once all are in (kept as a :class:`CommitRecord`), the stage updates it queues and
their completion, and the open step discarded when a worker leaves in the middle of it. The job
(:mod:`wstream.server.job`) owns this part; an update done here flips its stage's version in
:mod:`wstream.server.versions`, which answers the reads that waited for it.

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
#    skips a step), and so does a learning rate that overflows (the schedule's factor at step t
#    times the base lr, or a group's lr_scale times that). The learning rate is the schedule's at
#    step t.
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
#    t - 1); such a push is held (``waiting_push``) until the stage reaches t + 1, or answered
#    ``session_expired`` at once if its worker leaves first (nobody will take it then).
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
#    does), the job is not delayed (its updates of step t run during step t + 1; but see rule 5)
#    and its worker
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
#    its own mapping) until its update, even when its worker left meanwhile, and the push is
#    answered then all the same (every request gets one answer).
# 4. With several workers expected, a push is *parked*: left pending in its slot until the last
#    expected worker's push of the stage comes, which gathers them all in one task (the sum
#    written once: ``torch.add(a, b, out=grad)``, 12 bytes per parameter for two workers where a
#    copy then an add moved 20), in an order of their values, not of their arrival
#    (``pool_tasks.in_value_order``: by each push's norm, then its elements), so that the fp32 sum
#    of three or more is a function of the gradients alone, and a step trained again after a fault
#    sums as it did. A parked slot waits only for the other workers' pushes of the
#    same stage, which every worker pushes in the same order (its plan's BACKWARDs, from the last
#    position down), so a worker ahead waits for one behind, never the reverse. A worker that
#    leaves having pushed nothing stops being expected: the parked pushes then gather
#    (``check_complete``); one that leaves having pushed discards the step (their pushes are
#    answered with the error).
# 5. A *step ring* (``Join.step_ring``: a lone shared-memory worker, where the memory limit has
#    room) has a slot per stage, stage k's push always in slot k: rule 2 always holds (slot k is
#    free again once stage k's last update read it), so every push of the step is held and no
#    gradient is copied. A delayed job too (rule 1's exception): its updates of step t run in
#    backward order during step t + 1, whose pushes come in the same order, each into the slot
#    that stage's update of step t frees; the worker waits for that slot exactly as a push of
#    rule 6 waits for its stage, and never pushes ahead of a stage's version. It costs shared memory the size of the step's gradient, reserved on top of
#    the private accumulators, which such a worker never touches (``torch.empty``: no page of them
#    is written; they are there for a second worker, which would get an ordinary ring and make
#    the first one's pushes park in its slots, rule 4).
# Otherwise the push is gathered as before; a lone worker's norm still spares the gather's norm
# pass. The norm each stage adds to the global one is the same float either way: ``squared_norm``
# of that stage's gradient sum (NOTE [Gradient norms] in wstream/protocol/grad_norm.py; a CPU
# worker computes it on its slot, which with one worker is that sum). The sum of several workers'
# gradients has the server's native kernel's float where it is built (NOTE [Native kernels] in
# native.py, rule 3).
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from wstream.protocol import InternalError, SessionExpiredError, StaleStepError, StateError
from wstream.protocol import messages as m
from wstream.protocol.lr_schedules import lr_at

from .counters import JobCounters, Timeline
from .outgoing import Outgoing
from .pool_tasks import GatherTask, NormTask, PoolTask, UpdatedJob, UpdateTask
from .stage_state import Deferred, DeferredPush, HeldPush, StageState
from .versions import StageVersions
from .workers import Worker, WorkerTable

COMMITS_KEPT = 8
"""Committed steps whose outcome a late ``commit`` request can still be answered with."""
MAX_HELD_COMMITS = 4
"""``commit`` requests one worker keeps waiting at once (its own step's and a delayed job's next
one are all a client sends); one more is refused."""

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


def committed_reply(request_id: int, rec: CommitRecord) -> m.Committed:
    return m.Committed(id=request_id, step=rec.step, grad_norm=rec.grad_norm, lr=rec.lr, skipped=rec.skipped, clip=rec.clip)


log = logging.getLogger(__name__)


class CommitJob(UpdatedJob, Protocol):
    """What the commit point needs of its job (``wstream.server.job.Job``); the pool's tasks it
    queues are given the job itself."""

    @property
    def options(self) -> m.JobOptions: ...
    @property
    def stages(self) -> list[StageState]: ...
    @property
    def worker_table(self) -> WorkerTable: ...
    @property
    def workers(self) -> dict[int, Worker]: ...
    @property
    def counters(self) -> JobCounters: ...
    @property
    def timeline(self) -> Timeline: ...
    def stage(self, index: int) -> StageState: ...
    def step_opened(self, step: int) -> None: ...


class StepCommit:
    """One job's commit point (NOTE [The step commit point]): the open step and the gradients of it
    accepted, the commit, the updates it queues and their completion, the discard of the open step,
    and the gradient slots held until an update reads them (NOTE [Held gradient slots])."""

    def __init__(self, job: CommitJob, versions: StageVersions) -> None:
        # a weak reference: the job holds this part, and a cycle back would keep a dropped job's tensors
        # and mappings alive until Python's cyclic collector ran (the account released them at the drop)
        self._job = weakref.ref(job)
        self.versions = versions  # the job's: an update done flips its stage's version there
        self.open_step = 0  # the step whose gradients are being gathered
        self.attempt = 0  # bumped at every commit and discard: a gather of an older attempt adds nothing
        self.contributors: set[int] = set()  # workers with a gradient accepted for the open step
        self._complete: set[int] = set()  # trained stages holding every expected gradient and its norm
        self.trained = 0  # stages with something to train
        self.updating = 0  # stage updates handed to the optimizer pool and not finished
        self.waiting_commit: list[tuple[Deferred, int]] = []  # (request, worker id) until the commit
        self.commits: deque[CommitRecord] = deque(maxlen=COMMITS_KEPT)
        self.last_commit: CommitRecord | None = None  # the newest (one reference: the metrics thread reads it)
        self.skipped_steps = 0
        self.discarded_steps = 0

    @property
    def job(self) -> CommitJob:
        job = self._job()
        assert job is not None, "a part of a job that is gone was used: a bug in wstream"
        return job

    # ---- gradients of the open step ------------------------------------------------------------
    def push(self, msg: m.Push, frames: list[Any], identity: bytes, worker: Worker, submit: Submit) -> list[Outgoing]:
        """Accept a gradient (its gather queued, or its slot held); returns the replies of a step
        that this push completes (a held push may commit the step at once)."""
        st = self.job.stage(msg.stage)
        if st.failed is not None:
            raise InternalError(st.failed)
        if self.job.options.delayed_update and st.version < msg.step <= self.open_step + 1:
            st.check_push(msg, frames, worker)  # what can be told now is told now, not when the stage gets there
            if len(st.waiting_push) >= len(worker.slots) * max(1, len(self.job.workers)):
                raise StateError(f"too many pushes held for {st.what}: wait for their replies")
            st.waiting_push.append(DeferredPush(msg, frames, identity, worker))  # NOTE rule 6
            return []
        return self._accept_push(st, msg, frames, identity, worker, submit)

    def _accept_push(
        self, st: StageState, msg: m.Push, frames: list[Any], identity: bytes, worker: Worker, submit: Submit
    ) -> list[Outgoing]:
        if msg.step != self.open_step and msg.step == st.version:
            raise StaleStepError(
                f"gradient of {st.what} step {msg.step}: the job gathers step {self.open_step}"
            )
        pending = st.accept_push(msg, frames, identity, worker)
        self.contributors.add(worker.id)
        self.job.counters.gradients += 1
        assert st.grad is not None
        self.job.counters.gradient_bytes += st.grad.numel() * 4
        attempt, pushes = worker.pushes
        pushes = pushes + 1 if attempt == self.attempt else 1
        worker.pushes = (self.attempt, pushes)
        expected_set = self.job.worker_table.expected(self.open_step) if self.job.worker_table.started else set()
        expected = len(expected_set)
        source = worker.slots[pending.slot][: st.grad.numel()]
        if (  # NOTE [Held gradient slots] rules 1 and 2
            msg.sumsq is not None
            and (worker.slot_offsets or not self.job.options.delayed_update)
            and expected_set == {worker.id}
            and (worker.slot_offsets or len(worker.held) + 1 + (self.trained - pushes) <= len(worker.slots))
        ):
            del st.pending[worker.id]
            st.held = HeldPush(worker.id, pending, source, self.attempt)
            worker.held.add(pending.slot)
            st.gathered.add(worker.id)
            st.sumsq = (self.attempt, 1, msg.sumsq)
            self.job.counters.held_gradients += 1
            now = time.monotonic_ns()  # taken without a task: an instant in the gather category
            self.job.timeline.add(f"held {st.span}", "gather", "held gradients", now, now, st.index, self.open_step)
            return self.check_complete([st], submit)
        if expected > 1:  # NOTE [Held gradient slots] rule 4: one gather when the last of them comes
            st.parked[worker.id] = (source, msg.sumsq)
            self._gather_parked(st, expected_set, submit)
            return []
        st.gathering += 1
        submit(GatherTask(self.job, st, (worker.id,), (source,), self.attempt, expected, msg.sumsq if expected == 1 else None))
        return []

    def _gather_parked(self, st: StageState, expected: set[int], submit: Submit) -> None:
        """Sum the stage's parked pushes in one gather once every expected worker's gradient is
        parked or gathered (NOTE [Held gradient slots] rule 4)."""
        if not st.parked or not expected <= st.gathered | st.parked.keys():
            return
        workers = tuple(st.parked)
        sources, norms = tuple(s for s, _ in st.parked.values()), tuple(n for _, n in st.parked.values())
        st.parked = {}
        st.gathering += 1
        submit(GatherTask(self.job, st, workers, sources, self.attempt, len(expected), norms=norms))

    def commit(self, msg: m.Commit, identity: bytes, worker: Worker) -> Outgoing | None:
        """Answer when step ``msg.step`` commits (held until then; a delayed job's worker may
        already say so for the step after the open one)."""
        if self.open_step <= msg.step <= self.open_step + 1:
            held = sum(1 for _, wid in self.waiting_commit if wid == worker.id)
            if held >= MAX_HELD_COMMITS:
                raise StateError(
                    f"this worker already has {held} commits waiting (the limit is {MAX_HELD_COMMITS}): wait for their replies"
                )
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

    # ---- the pool's completions ----------------------------------------------------------------------
    def finish_task(self, task: PoolTask, error: BaseException | None, submit: Submit) -> list[Outgoing]:
        """Called on the loop thread when a pool task completes."""
        if isinstance(task, UpdateTask):
            return self.finish_update(task, error, submit)
        if isinstance(task, GatherTask):
            return self._finish_gather(task, error, submit)
        task.stage.gathering -= 1  # a NormTask
        if error is not None:
            return self._norm_failed(task.stage, error)
        return self.check_complete([task.stage], submit)

    def _norm_failed(self, st: StageState, error: BaseException) -> list[Outgoing]:
        """A stage's norm task failed (a bug): the open step can never commit. The stage fails as a
        failed update fails it, and who waits for the step is told: the held commits, the
        ``await_step`` requests past the stage's version, its held push."""
        log.error("job %r stage %d: the gradient norm of step %d failed: %r", self.job.name, st.index, self.open_step, error)
        st.failed = f"the gradient norm of {st.what} step {self.open_step} failed: {error!r} (a bug in wstream)"
        failed = InternalError(st.failed)
        out = [Outgoing.error(d.identity, d.request_id, failed) for d, _ in self.waiting_commit]
        self.waiting_commit = []
        out += self.versions.refuse_steps(st.version, failed)
        h = self._take_held(st)
        if h is not None:
            out.append(Outgoing.error(h.push.identity, h.push.request_id, failed))
        return out

    def _finish_gather(self, task: GatherTask, error: BaseException | None, submit: Submit) -> list[Outgoing]:
        st = task.stage
        st.gathering -= 1
        if task.attempt != self.attempt:
            return []  # discarded meanwhile: its pushes were answered then
        self.job.timeline.add(f"gather {st.span}", "gather", task.thread, task.started_ns,
                              task.started_ns + int(task.seconds * 1e9), st.index, self.open_step)
        out: list[Outgoing] = []
        for wid in task.workers:
            p = st.pending.pop(wid, None)
            w = self.job.workers.get(wid)
            if p is None or w is None:
                continue
            w.busy.discard(p.slot)
            if error is not None:
                out.append(Outgoing(p.identity, m.Error(id=p.request_id, code="internal", message=f"gather failed: {error}")))
                continue
            st.gathered.add(wid)
            out.append(Outgoing(p.identity, m.Pushed(id=p.request_id, stage=st.index, step=self.open_step, slot=p.slot)))
        if error is not None:
            return out
        return out + self.check_complete([st], submit)

    def check_complete(self, stages: Iterable[StageState], submit: Submit) -> list[Outgoing]:
        """Note the stages that now hold every expected gradient of the open step (and ask for a
        norm where no gather computed it); commit when all do."""
        if not self.job.worker_table.started or not self.contributors:
            return []
        expected = self.job.worker_table.expected(self.open_step)
        if not expected:
            return []
        for st in stages:
            if st.parked:  # fewer workers expected now (one left having pushed nothing): maybe all in
                self._gather_parked(st, expected, submit)
            if st.index in self._complete or not st.trained or st.gathering or not expected <= st.gathered:
                continue
            if st.sumsq is not None and st.sumsq[:2] == (self.attempt, len(st.gathered)):
                self._complete.add(st.index)
            else:
                st.gathering += 1
                submit(NormTask(self.job, st, self.attempt))
        if len(self._complete) < self.trained:
            return []
        return self._commit(len(expected), submit)

    def _commit(self, workers: int, submit: Submit) -> list[Outgoing]:
        """NOTE [The step commit point] rules 2 and 3."""
        t = self.open_step
        spec = self.job.options.optimizer
        norm = math.sqrt(sum(st.sumsq[2] for st in self.job.stages if st.sumsq is not None and st.trained)) / workers
        lr = lr_at(spec.schedule, spec.lr, t)
        top_lr = lr * max([1.0, *(g.lr_scale for g in self.job.options.param_groups)])  # group 0 and each group
        skipped = not math.isfinite(norm) or not math.isfinite(top_lr)
        clip = 1.0
        if not skipped and spec.clip_grad_norm is not None:
            clip = min(1.0, spec.clip_grad_norm / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_
        record = CommitRecord(t, norm, lr, skipped, clip)
        self.commits.append(record)
        self.last_commit = record
        if skipped:
            self.skipped_steps += 1
            why = f"a gradient norm of {norm}" if not math.isfinite(norm) else f"a learning rate of {top_lr} (the base lr times the schedule's factor)"
            log.warning("job %r: step %d has %s: no stage is updated", self.job.name, t, why)
        order = reversed(self.job.stages) if self.job.options.delayed_update else iter(self.job.stages)
        now = time.monotonic_ns()
        for st in order:
            st.updating = True
            self.updating += 1
            st.gathered.clear()
            source = st.held.source if st.held is not None else None
            submit(UpdateTask(
                self.job, st, grad_scale=workers / clip, lr=lr, apply=not skipped and st.trained, workers=workers, source=source, submitted_ns=now,
                resubmit=submit,
            ))
        self.open_step = t + 1
        self.job.step_opened(t + 1)  # (a schedule change replayed after a restore: NOTE [Schedule changes kept between snapshots])
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
        self.updating -= 1
        if task.started_ns:
            end = task.started_ns + int(task.seconds * 1e9)
            self.job.timeline.add(f"queued {st.span}", "queue", "update queue", task.submitted_ns, task.started_ns, st.index, st.version)
            self.job.timeline.add(f"update {st.span}", "optimizer", task.thread, task.started_ns, end, st.index, st.version)
        if error is not None:  # a bug: the stage stays at its version, and who waits for it is told
            log.error("job %r stage %d: the update of step %d failed: %r", self.job.name, st.index, st.version, error)
            st.failed = f"the update of {st.what} step {st.version} failed: {error!r} (a bug in wstream)"
            failed = InternalError(st.failed)
            waiting = [*st.waiting_fetch, *st.waiting_pull]
            st.waiting_fetch, st.waiting_pull = [], []
            for waiter in waiting:
                if waiter.worker is not None:
                    waiter.worker.waiting -= 1
            answers = [Outgoing.error(w.identity, w.request_id, failed) for w in waiting]
            answers += self.versions.refuse_steps(st.version, failed)
            answers += [Outgoing.error(o.identity, o.message.id, failed) for o in self._release_held(st)]
            # a delayed job's pushes held back until this update (rule 6) will not be taken either
            answers += [Outgoing.error(p.identity, p.msg.id, failed) for p in st.waiting_push]
            st.waiting_push = []
            return answers
        out = self._release_held(st)
        self.versions.set_version(st, st.version + 1)
        if task.apply:
            self.job.counters.optimizer.observe(task.seconds)
            st.updates += 1
            st.optimizer_s += task.seconds
            st.last_optimizer_s = task.seconds
        out += self.versions.answer_waiters(st)
        deferred = st.waiting_push
        st.waiting_push = []
        for push in deferred:  # NOTE rule 6: a delayed job's pushes of the step the stage reached now
            if push.worker.id not in self.job.workers:  # (its leave answered it: never taken, its ring is gone)
                continue
            try:
                out += self._accept_push(st, push.msg, push.frames, push.identity, push.worker, submit)
            except Exception as exc:  # answered as the push would have been
                out.append(Outgoing.error(push.identity, push.msg.id, exc))
        return out

    def _release_held(self, st: StageState) -> list[Outgoing]:
        """The stage's update has read its held slot: free it and answer its push (NOTE [Held
        gradient slots] rule 3)."""
        h = self._take_held(st)
        if h is None:
            return []
        return [Outgoing(h.push.identity, m.Pushed(id=h.push.request_id, stage=st.index, step=st.version, slot=h.push.slot))]

    def _take_held(self, st: StageState) -> HeldPush | None:
        """Take the stage's held slot off it and free the slot in its worker's ring (a worker that
        left has no slots to free; its push is answered all the same)."""
        h, st.held = st.held, None
        if h is not None:
            w = self.job.workers.get(h.worker)
            if w is not None:
                w.held.discard(h.push.slot)
                w.busy.discard(h.push.slot)
        return h

    # ---- a worker leaves -------------------------------------------------------------------------
    def worker_left(self, worker_id: int, submit: Submit, end_session: EndSession, reason: str) -> list[Outgoing]:
        """Worker ``worker_id`` was detached (rule 4): if the open step holds a gradient of its, the
        step is discarded on every stage; otherwise its held commits are answered and the step goes
        on without it."""
        out = self._refuse_held_back(worker_id, reason)
        if worker_id in self.contributors:
            out += self._discard_open_step(worker_id, end_session, reason)
        else:  # its held commits are answered: its session is gone, so it will never see the step
            gone = SessionExpiredError(f"job {self.job.name!r}: worker {worker_id} detached ({reason}) before its step committed")
            mine = [d for d, wid in self.waiting_commit if wid == worker_id]
            self.waiting_commit = [c for c in self.waiting_commit if c[1] != worker_id]
            out += [Outgoing.error(d.identity, d.request_id, gone) for d in mine]
            out += self.check_complete(self.job.stages, submit)
        return out

    def _refuse_held_back(self, worker_id: int, reason: str) -> list[Outgoing]:
        """Answer the pushes of a worker that leaves which wait for their stage's update (a delayed
        job's, rule 6): nobody will take them now."""
        gone = SessionExpiredError(
            f"job {self.job.name!r}: worker {worker_id} detached ({reason}) before its stage reached the step of this gradient"
        )
        out: list[Outgoing] = []
        for st in self.job.stages:
            if any(p.worker.id == worker_id for p in st.waiting_push):
                out += [Outgoing.error(p.identity, p.msg.id, gone) for p in st.waiting_push if p.worker.id == worker_id]
                st.waiting_push = [p for p in st.waiting_push if p.worker.id != worker_id]
        return out

    def _discard_open_step(self, leaver: int, end_session: EndSession, reason: str) -> list[Outgoing]:
        t = self.open_step
        others = sorted(self.contributors - {leaver})
        log.warning(
            "job %r: step %d discarded on every stage (worker %d left after pushing part of it: %s)%s",
            self.job.name, t, leaver, reason, f"; workers {others} train it again" if others else "",
        )
        self.attempt += 1
        self.discarded_steps += 1
        self.contributors.clear()
        self._complete.clear()
        gone = SessionExpiredError(
            f"job {self.job.name!r}: step {t} was discarded because worker {leaver} left after pushing part of it "
            f"({reason}); attach again and train step {t}"
        )
        out: list[Outgoing] = []
        for st in self.job.stages:
            st.gathered.clear()
            for p in st.pending.values():  # their gathers add nothing now; the slots die with the sessions
                out.append(Outgoing.error(p.identity, p.request_id, gone))
            st.pending = {}
            st.parked = {}
            if st.held is not None and st.held.attempt == self.attempt - 1:  # of the discarded step
                h = self._take_held(st)
                assert h is not None
                out.append(Outgoing.error(h.push.identity, h.push.request_id, gone))
        ended = {leaver, *others}  # the other workers' commits wait on (a delayed job's of the step after)
        out += [Outgoing.error(d.identity, d.request_id, gone) for d, wid in self.waiting_commit if wid in ended]
        self.waiting_commit = [c for c in self.waiting_commit if c[1] not in ended]
        for wid in others:
            end_session(wid, f"step {t} discarded")
        return out
