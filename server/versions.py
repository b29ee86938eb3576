"""Which weights a job's stages hold, and who may read them: the version each stage is at, and the
reads of it (``fetch``: the weights a step computes on; ``pull``: the master), answered at once or,
when what they ask for is not there yet or is being written, once the stage's update is done.

Kept apart from :mod:`wstream.server.job` (the job, which owns this part and the others) and from
:mod:`wstream.server.step_commit` (which decides when a step's updates run, and flips the versions
here when they are done).

# NOTE [Versions and who may read what]
# 1. ``stage.version`` counts the updates applied to a stage: version t holds the weights that
#    step t reads. Stages change version only after their step committed (NOTE [The step commit
#    point] in step_commit.py).
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
# 6. ``await_step(t)`` is answered once every stage is at version t or beyond (the job's step,
#    the least version, reached t), so no update of a step before t is left to run. t may be at
#    most the step after the open one (job.py), as for ``commit``, so every wait ends within two
#    steps. It waits in the job's list (at most MAX_WAITING_STEPS requests), which is looked at
#    whenever an update ends. A stage whose update failed stays at its version for good: who
#    waits for a step past it is told (step_commit.py), and so is who waits when the job is
#    dropped (job.py).
# 7. Rule 2 does not hold for a stage with nothing trained (every parameter frozen, or frozen
#    whole on a base): it pushes nothing, so the step commits, and its update runs, while a worker
#    may still read it in that step's backward. Its update only publishes the master, which never
#    changes, so every slot it ever published holds the same bytes (an update that rewrites one
#    rewrites the same bytes): a fetch of any step up to its version is served at once.
# 8. Rule 2 does not hold for a reader either (``Join.reader``: it fetches and never pushes), so
#    no commit waits for its reads: its data-frames replies are a copy of the version (one per
#    version, shared by its replies still queued), never the slot, which the update to version
#    t + 2 (t + 1 with one slot) rewrites whatever is still queued. A reader on shared memory
#    reads the slot in place, as every worker does: it must be done with version t before then
#    (a client's reader ranks are, running in lockstep with the rank that pushes).
"""

from __future__ import annotations

import time
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from wstream.protocol import InternalError, NotReadyError, SessionExpiredError, StaleStepError, StateError, WstreamError
from wstream.protocol import messages as m

from .counters import JobCounters, Timeline
from .outgoing import Outgoing
from .stage_state import Deferred, ReplyCopies, StageState
from .workers import MAX_WAITING_FETCHES, Worker


def answered(reply: Callable[[], Outgoing], d: Deferred) -> Outgoing:
    """A deferred request's reply, or its error (a copy refused: ``ReplyCopies``) as its answer."""
    try:
        return reply()
    except WstreamError as exc:
        return Outgoing.error(d.identity, d.request_id, exc)


class ReadJob(Protocol):
    """What the reads need of their job (``wstream.server.job.Job``)."""

    @property
    def name(self) -> str: ...
    @property
    def options(self) -> m.JobOptions: ...
    @property
    def base(self) -> ReadJob | None: ...
    @property
    def stages(self) -> list[StageState]: ...
    @property
    def ready(self) -> bool: ...
    @property
    def counters(self) -> JobCounters: ...
    @property
    def timeline(self) -> Timeline: ...
    @property
    def reply_copies(self) -> ReplyCopies: ...
    def stage(self, index: int) -> StageState: ...


MAX_WAITING_PULLS = 256
"""``pull`` requests one stage keeps waiting for its update at once; one more is refused."""
MAX_WAITING_STEPS = 256
"""``await_step`` requests one job keeps waiting at once (NOTE rule 6); one more is refused."""


class StageVersions:
    """The version each stage of one job is at, and the fetches and pulls that read the stages
    (NOTE [Versions and who may read what])."""

    def __init__(self, job: ReadJob) -> None:
        # a weak reference: the job holds this part, and a cycle back would keep a dropped job's tensors
        # and mappings alive until Python's cyclic collector ran (the account released them at the drop)
        self._job = weakref.ref(job)
        self.counts: Counter[int] = Counter()  # stage version -> how many stages are at it
        self.base_step = 0  # delayed updates read max(t - 1, base_step): see NOTE rule 5
        self.waiting_step: list[Deferred] = []  # await_step requests (NOTE rule 6)

    @property
    def job(self) -> ReadJob:
        job = self._job()
        assert job is not None, "a part of a job that is gone was used: a bug in wstream"
        return job

    @property
    def step(self) -> int:
        """Steps completed by every stage."""
        return min(self.counts, default=0)

    def fetch(self, msg: m.Fetch, identity: bytes, worker: Worker) -> Outgoing | None:
        if not self.job.ready:
            raise NotReadyError(f"job {self.job.name!r} is still uploading its weights")
        st = self.job.stage(msg.stage)
        t = self.read_version(msg.step)
        if st.failed is not None and t > st.version:  # a version it will never reach
            raise InternalError(st.failed)
        if t == st.version and (not st.updating or not st.single_slot):  # an update writes the other slot
            return self.weights_reply(st, t, identity, msg.id, worker.shm, reader=worker.reader)
        if t <= st.version and not st.trained:  # NOTE rule 7: its weights never change
            return self.weights_reply(st, t, identity, msg.id, worker.shm, reader=worker.reader)
        if self.job.options.delayed_update and t == st.version - 1 and not st.updating:  # NOTE rule 5
            return self.weights_reply(st, t, identity, msg.id, worker.shm, reader=worker.reader)
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
                f"{st.what} is at step {st.version}; step {msg.step} is more than one step ahead"
            )
        raise StaleStepError(
            f"{st.what}: weights of step {t} were replaced (the stage is at step "
            f"{st.version}{', updating' if st.updating else ''})"
        )

    def worker_left(self, worker_id: int, reason: str) -> list[Outgoing]:
        """Answer the fetches of a worker that leaves which wait for their stage's update: its
        session is gone, so they are answered now (``session_expired``), not when the update ends."""
        out: list[Outgoing] = []
        for st in self.job.stages:
            mine = [d for d in st.waiting_fetch if d.worker is not None and d.worker.id == worker_id]
            if not mine:
                continue
            st.waiting_fetch = [d for d in st.waiting_fetch if d.worker is None or d.worker.id != worker_id]
            gone = SessionExpiredError(
                f"job {self.job.name!r}: worker {worker_id} detached ({reason}) while its fetch of {st.what} waited for the update"
            )
            out += [Outgoing.error(d.identity, d.request_id, gone) for d in mine]
        return out

    def read_version(self, step: int) -> int:
        """The weights version step ``step`` computes on (NOTE rule 5)."""
        if not self.job.options.delayed_update or step < self.job.options.delay_after:
            return step
        return max(step - 1, self.base_step)

    def weights_reply(
        self, st: StageState, version: int, identity: bytes, request_id: int, shm: bool, *, reader: bool = False
    ) -> Outgoing:
        base = self.job.base.stages[st.index] if self.job.base is not None else None
        # NOTE rule 8: a reader's frames are a copy, unless the stage's weights never change (rule 7)
        copy = self.job.reply_copies if reader and st.trained else None
        return st.weights_reply(version, identity, request_id, shm, base, self.job.counters.served, copy=copy)

    def set_version(self, st: StageState, version: int) -> None:
        old = st.version
        self.counts[old] -= 1
        st.version = version
        self.counts[version] += 1
        if not self.counts[old]:
            del self.counts[old]
            step = min(self.counts)
            if step > old:  # ``old`` was the job's step and no stage is left at it
                self.job.counters.steps.add(step - old, time.monotonic())

    def answer_waiters(self, st: StageState) -> list[Outgoing]:
        out = []
        waiting = st.waiting_fetch
        st.waiting_fetch = []
        for d in waiting:
            if d.step == st.version:
                reader = d.worker is not None and d.worker.reader
                out.append(answered(lambda d=d, reader=reader: self.weights_reply(st, d.step, d.identity, d.request_id, d.shm, reader=reader), d))
                self.job.timeline.add(f"fetch {st.span} waited", "deferred", "deferred fetches", d.since_ns, time.monotonic_ns(), st.index, d.step)
                if d.worker is not None:
                    d.worker.waiting -= 1
            else:
                st.waiting_fetch.append(d)
        pulls = st.waiting_pull
        st.waiting_pull = []
        out.extend(answered(lambda d=d: self.pull_reply(st, d.identity, d.request_id), d) for d in pulls)
        if self.waiting_step:
            out += self._steps_reached()
        return out

    def await_step(self, msg: m.AwaitStep, identity: bytes) -> Outgoing | None:
        """``step_reached`` now if every stage is at ``msg.step`` or beyond, else once they are
        (NOTE rule 6)."""
        if not self.job.ready:
            raise NotReadyError(f"job {self.job.name!r} is still uploading its weights")
        failed = next((st for st in self.job.stages if st.failed is not None and st.version < msg.step), None)
        if failed is not None:  # a version it will never reach
            raise InternalError(failed.failed or "")
        if self.step >= msg.step:
            return Outgoing(identity, m.StepReached(id=msg.id, step=self.step))
        if len(self.waiting_step) >= MAX_WAITING_STEPS:
            raise StateError(
                f"job {self.job.name!r}: {MAX_WAITING_STEPS} requests already wait for a step (the limit): "
                "wait for their answers"
            )
        self.waiting_step.append(Deferred(identity, msg.id, msg.step))
        return None

    def _steps_reached(self) -> list[Outgoing]:
        step = self.step
        return [Outgoing(d.identity, m.StepReached(id=d.request_id, step=step)) for d in self._take_steps(lambda t: t <= step)]

    def refuse_steps(self, beyond: int, error: Exception) -> list[Outgoing]:
        """Answer with ``error`` every ``await_step`` of a step past ``beyond`` (a stage stays at
        ``beyond`` for good: its update failed)."""
        return [Outgoing.error(d.identity, d.request_id, error) for d in self._take_steps(lambda t: t > beyond)]

    def _take_steps(self, chosen: Callable[[int], bool]) -> list[Deferred]:
        """The waiting ``await_step`` requests whose step is ``chosen``, no longer waiting."""
        taken = [d for d in self.waiting_step if chosen(d.step)]
        if taken:
            self.waiting_step = [d for d in self.waiting_step if not chosen(d.step)]
        return taken

    def pull(self, msg: m.Pull, identity: bytes) -> Outgoing | None:
        if not self.job.ready:
            raise NotReadyError(f"job {self.job.name!r} is still uploading its weights")
        st = self.job.stage(msg.stage)
        if st.updating:
            if len(st.waiting_pull) >= MAX_WAITING_PULLS:
                raise StateError(
                    f"{st.what}: {MAX_WAITING_PULLS} pulls already wait for its update (the limit): wait for their answers"
                )
            st.waiting_pull.append(Deferred(identity, msg.id))
            return None
        return self.pull_reply(st, identity, msg.id)

    def pull_reply(self, st: StageState, identity: bytes, request_id: int) -> Outgoing:
        return st.master_reply(identity, request_id, self.job.counters.served, self.job.reply_copies)

