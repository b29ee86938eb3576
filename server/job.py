"""One job's state on the server: stages, versions, workers, pending gradients.

Nothing here touches a socket. Each method returns the replies to send (:class:`Outgoing`) and
queues stage updates through the ``submit`` callback; :mod:`wstream.server.handlers` calls them.
The parts a job is made of live next to it: its stages and their shared-memory segment in
:mod:`~wstream.server.published`, one stage's state and update in :mod:`~wstream.server.stage_state`,
its workers in :mod:`~wstream.server.workers`; this module keeps the rules that tie them together.

# NOTE [Versions and who may read what]
# 1. ``stage.version`` counts the updates applied to a stage: version t holds the weights that
#    step t reads. A step's update of stage i runs once every *expected* worker (live, with
#    ``first_step <= t``) has pushed its gradient for (i, t).
# 2. A worker pushes (i, t) only after its last use of w_i(t) (it copies weights into its own
#    buffer at fetch time), so once the update of (i, t) starts nobody still reads w_i(t).
#    That is why, with fp32 compute, the master can be updated in place in the published slot.
# 3. ``fetch(i, t+1)`` arriving before the update of (i, t) completes is deferred, and answered
#    when the version flips. ``pull(i)`` is deferred while stage i updates (no torn reads).
# 4. Gradient slot s of a worker is busy from its push until the reply ``pushed`` (sent after the
#    update consumed it); a push into a busy slot is an error.
# 5. A job with ``delayed_update`` reads one version behind: step t reads w_i(t - 1) (but the
#    first step after creation or a restore reads the weights it starts from, and steps before
#    ``delay_after`` read w_i(t) as synchronous training does), while the update
#    of (i, t - 1) may be running. Its gradient for (i, t) is still applied to version t, and
#    only once that version exists (the worker waits for the acknowledgement of (i, t - 1)
#    before pushing (i, t)). Such a job always has two slots: version v is in slot v % 2, and the
#    update (i, t) -> t + 1 writes slot (t + 1) % 2 = (t - 1) % 2 only after every expected
#    worker pushed (i, t), i.e. after its last read of w_i(t - 1) (rule 2).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch

from wstream.protocol import (
    LayoutError,
    NotReadyError,
    StaleStepError,
    StateError,
)
from wstream.protocol import messages as m

from .counters import JobCounters, Timeline
from .job_key import JobKey, token_digest
from .memory import MemoryAccount
from .outgoing import Outgoing
from .published import PublishedStages
from .snapshot import JobRecord, Snapshot
from .stage_state import Deferred, StageState, UpdateTask, align
from .workers import MAX_WAITING_FETCHES, Worker, WorkerTable

__all__ = ["MAX_WAITING_FETCHES", "Job", "Outgoing", "UpdateTask", "token_digest"]

log = logging.getLogger(__name__)


class Job:
    """A job: its stages in shared memory, its optimizer, its workers and sessions."""

    def __init__(self, record: JobRecord, memory: MemoryAccount, total_numel: int | None = None) -> None:
        self.name = record.name
        self.key = JobKey(record.name, record.token_digest)  # attach and base proofs, session keys
        self.options = options = record.options
        self.base: Job | None = None  # set by the server when it creates or restores this job
        self.double_buffer = options.double_buffer or options.dtype != "float32" or options.delayed_update
        self.base_step = 0  # delayed updates read max(t - 1, base_step): see NOTE rule 5
        self.published_dtype = options.dtype if self.double_buffer else "float32"
        self.memory = memory
        self.published = PublishedStages(
            record.name, options.optimizer, options.dtype, self.double_buffer, options.frozen, memory, total_numel,
            groups=options.param_groups,  # groups: the job's parameter groups
        )
        self.stages: list[StageState] = self.published.stages
        self.worker_table = WorkerTable(record.name, memory)
        self.snapshot: Snapshot | None = None  # the snapshot being written, if any
        self.last_snapshot_step: int | None = None
        self._versions: Counter[int] = Counter()  # stage version -> how many stages are at it
        self._updating = 0
        self.counters = JobCounters()  # bytes served, gradients, durations (server/counters.py)
        self.sealed = False
        self.timeline = Timeline()  # for ``timeline``
        self.last_activity = time.monotonic()  # of creation: an unsealed job idle too long is dropped

    @classmethod
    def create(cls, msg: m.CreateJob, memory: MemoryAccount) -> Job:
        return cls(JobRecord(msg.name, token_digest(msg.token), msg.options, []), memory, msg.total_numel)

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
            job.seal()
        except BaseException:
            job.close()
            raise
        job.last_snapshot_step = step
        job.base_step = step  # the weights before ``step`` are gone: the first step reads ``step``
        return job

    def snapshot_sources(self) -> list[tuple[threading.Lock, Callable[[], dict[str, torch.Tensor]]]]:
        """Per stage, the lock and the capture a snapshot writer takes it with."""
        return [(st.lock, st.capture) for st in self.stages]

    def record(self) -> JobRecord:
        return JobRecord(self.name, self.key.digest, self.options, [s.spec for s in self.stages])

    # ---- creation --------------------------------------------------------------------------------
    def add_stage(self, msg: m.AddStage, frames: list[Any]) -> None:
        if self.sealed:
            raise StateError(f"job {self.name!r} is sealed: stages cannot be added any more")
        self.published.add(msg, frames)
        self._versions[0] += 1
        self.last_activity = time.monotonic()

    def seal(self) -> None:
        if self.sealed:
            raise StateError(f"job {self.name!r} is already sealed")
        if not self.stages:
            raise LayoutError(f"job {self.name!r} has no stages: add at least one before sealing")
        if self.base is not None and len(self.stages) != len(self.base.stages):
            raise LayoutError(
                f"job {self.name!r} has {len(self.stages)} stages; its base {self.base.name!r} has "
                f"{len(self.base.stages)}: stage i of a job trains on top of stage i of its base"
            )
        self.published.seal()
        self.sealed = True

    def close(self) -> None:
        """Free everything: unlink segments and release the memory reserved."""
        self.worker_table.close()
        self.published.close()

    def refuse_waiters(self, error: Callable[[bytes, int], None]) -> None:
        """Answer every deferred fetch and pull with ``error`` (the job is going away)."""
        for st in self.stages:
            for d in [*st.waiting_fetch, *st.waiting_pull]:
                error(d.identity, d.request_id)
            st.waiting_fetch.clear()
            st.waiting_pull.clear()

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
        # the first step no stage has begun to update: a step whose update started anywhere
        # cannot be trained by a newcomer any more (its forward needs the old weights)
        first_step = max(s.version + s.updating for s in self.stages)
        return self.worker_table.join(session, msg, first_step, numel, align(numel * 4))

    def open_barrier(self, submit: Callable[[UpdateTask], None]) -> None:
        """Start training once ``world_size`` workers have joined (checked after every join)."""
        pushers = self.worker_table.barrier_opens()
        if pushers is not None:
            self.counters.steps.start(time.monotonic())
            log.info("job %r: %d worker(s) joined, training starts", self.name, pushers)
            for st in self.stages:
                self._maybe_update(st, submit)

    def remove_worker(self, worker_id: int, submit: Callable[[UpdateTask], None], reason: str) -> list[Outgoing]:
        """Detach a worker: drop its unfinished pushes and start updates it was holding back."""
        w = self.worker_table.pop(worker_id)
        if w is None:
            return []
        log.info("job %r: worker %d detached (%s)", self.name, worker_id, reason)
        for st in self.stages:
            if not st.updating:
                st.pending.pop(worker_id, None)  # its gradient of an unfinished step is discarded
            self._maybe_update(st, submit)
        self.worker_table.free(w)
        return self.skip_abandoned_step()

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

    def push(
        self, msg: m.Push, frames: list[Any], identity: bytes, worker: Worker, submit: Callable[[UpdateTask], None]
    ) -> None:
        st = self.stage(msg.stage)
        st.accept_push(msg, frames, identity, worker)
        self.counters.gradients += 1
        self.counters.gradient_bytes += st.spec.numel * 4
        self._maybe_update(st, submit)

    def _maybe_update(self, st: StageState, submit: Callable[[UpdateTask], None]) -> None:
        if st.updating or not st.pending or not self.worker_table.started:
            return
        expected = self.worker_table.expected(st.version)
        if not expected.issubset(st.pending):
            return
        grads = [self.workers[wid].slots[p.slot][: st.spec.numel] for wid, p in sorted(st.pending.items())]
        first = min(p.arrived_ns for p in st.pending.values())
        self.timeline.add(f"gradients {st.index}", "gather", "gradients in", first, time.monotonic_ns(), st.index, st.version)
        st.updating = True
        self._updating += 1
        submit(UpdateTask(self, st, grads))

    def finish_update(self, task: UpdateTask, error: BaseException | None) -> list[Outgoing]:
        """Called on the loop thread when an update completes: flip, free slots, answer waiters."""
        st = task.stage
        st.updating = False
        self._updating -= 1
        out: list[Outgoing] = []
        pending = st.pending
        st.pending = {}
        for wid, p in pending.items():
            w = self.workers.get(wid)
            if w is not None:
                w.busy.discard(p.slot)
            if error is None:
                out.append(Outgoing(p.identity, m.Pushed(id=p.request_id, stage=st.index, step=st.version, slot=p.slot)))
            else:
                out.append(
                    Outgoing(p.identity, m.Error(id=p.request_id, code="internal", message=f"update failed: {error}"))
                )
        if task.started_ns:
            end = task.started_ns + int(task.seconds * 1e9)
            self.timeline.add(f"queued {st.index}", "queue", "update queue", task.submitted_ns, task.started_ns, st.index, st.version)
            self.timeline.add(f"update {st.index}", "optimizer", task.thread, task.started_ns, end, st.index, st.version)
        if error is None:
            log.debug("job %r stage %d: step %d applied (workers %s)", self.name, st.index, st.version, sorted(pending))
            self._set_version(st, st.version + 1)
            self.counters.optimizer.observe(task.seconds)
            st.updates += 1
            st.optimizer_s += task.seconds
            st.last_optimizer_s = task.seconds
        out.extend(self._answer_waiters(st))
        return out

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

    def skip_abandoned_step(self) -> list[Outgoing]:
        """Close a step that no live worker will finish (every worker that was making it is gone):
        the stages it had not reached keep their weights and optimizer state, and move on to the
        step the others are at, so the job is consistent again and a new worker can start."""
        top = max(self._versions, default=0)
        out: list[Outgoing] = []
        if len(self._versions) <= 1:
            return out
        for st in self.stages:
            while st.version < top and not st.updating and not st.pending and not self.worker_table.expected(st.version):
                log.warning(
                    "job %r: stage %d skips step %d (every worker making it left before its gradient came)",
                    self.name, st.index, st.version,
                )
                self._set_version(st, st.version + 1)
                out.extend(self._answer_waiters(st))
        return out

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
