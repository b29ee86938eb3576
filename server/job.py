"""One job's state on the server: stages, versions, workers, pending gradients.

Nothing here touches a socket. Each handler returns the replies to send (:class:`Outgoing`) and
queues stage updates through the ``submit`` callback; :mod:`wstream.server.service` does the I/O.

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

import hmac
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from wstream.protocol import (
    AuthError,
    GradientError,
    LayoutError,
    NotReadyError,
    StaleStepError,
    StateError,
)
from wstream.protocol import messages as m
from wstream.protocol.auth import attach_proof, base_proof, secret_key, session_key
from wstream.protocol.frames import copy_frames_into, frames_nbytes, tensor_frames
from wstream.protocol.layout import numel_of, validate_stage
from wstream.protocol.shm import create_segment, grow_segment, map_segment, truncate_segment, unlink_segment

from .memory import MemoryAccount
from .outgoing import Outgoing
from .counters import JobCounters
from .optimizer import StageOptimizer, state_bytes_per_element
from .snapshot import JobRecord, Snapshot

log = logging.getLogger(__name__)

SLOT_ALIGN_BYTES = 64
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _align(n: int) -> int:
    return (n + SLOT_ALIGN_BYTES - 1) // SLOT_ALIGN_BYTES * SLOT_ALIGN_BYTES


def token_digest(token: str) -> bytes:
    """What the server keeps of a job's token (in memory and in snapshots): the HMAC key of
    NOTE [Signed requests] in ``protocol/auth.py``."""
    return secret_key(token)


@dataclass(slots=True)
class Deferred:
    identity: bytes
    request_id: int
    step: int = 0
    shm: bool = True
    worker: Worker | None = None
    since_ns: int = field(default_factory=time.monotonic_ns)


MAX_WAITING_FETCHES = 1024
"""Deferred fetches one worker may have at once (a prefetcher has its ring's worth in flight)."""


@dataclass(slots=True)
class PendingPush:
    slot: int
    identity: bytes
    request_id: int
    arrived_ns: int = field(default_factory=time.monotonic_ns)


@dataclass(slots=True)
class Worker:
    id: int
    session: bytes
    shm: bool
    first_step: int
    grad_path: str
    grad_buffer: torch.Tensor  # uint8 mapping of the whole ring
    slots: list[torch.Tensor]  # fp32 views, one per slot, max_stage_numel each
    slot_bytes: int
    reserved: int
    reader: bool = False  # fetches only (see Join.reader)
    busy: set[int] = field(default_factory=set)
    last_seen: float = field(default_factory=time.monotonic)
    waiting: int = 0  # its fetches deferred now


@dataclass(slots=True)
class StageState:
    index: int
    spec: m.StageSpec
    master: torch.Tensor
    slots: tuple[torch.Tensor, torch.Tensor]  # published copies; both are ``master`` when single
    slot_offsets: tuple[int, int]
    optimizer: StageOptimizer
    version: int = 0
    updating: bool = False
    pending: dict[int, PendingPush] = field(default_factory=dict)
    waiting_fetch: list[Deferred] = field(default_factory=list)
    waiting_pull: list[Deferred] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held by the optimizer while it changes the stage and by a snapshot capturing it."""
    updates: int = 0
    optimizer_s: float = 0.0
    last_optimizer_s: float = 0.0

    def capture(self) -> dict[str, torch.Tensor]:
        """Copies of what a snapshot keeps of this stage (call with ``lock`` held)."""
        out = {"master": self.master.clone()}
        for k, v in self.optimizer.state_tensors().items():
            out[f"opt.{k}"] = v.clone()
        return out

    @property
    def state_nbytes(self) -> int:
        return self.master.numel() * 4 + sum(v.numel() * v.element_size() for v in self.optimizer.state_tensors().values())

    @property
    def single_slot(self) -> bool:
        return self.slots[0] is self.slots[1]

    def slot_for(self, version: int) -> int:
        return version % 2


@dataclass(slots=True)
class UpdateTask:
    """Work for the optimizer pool; ``run`` executes off the loop thread."""

    job: Job
    stage: StageState
    grads: list[torch.Tensor]
    seconds: float = 0.0
    submitted_ns: int = field(default_factory=time.monotonic_ns)
    started_ns: int = 0
    thread: str = ""

    def run(self) -> UpdateTask:
        self.started_ns = time.monotonic_ns()
        self.thread = threading.current_thread().name
        t0 = time.perf_counter()
        st = self.stage
        snap = self.job.snapshot
        if snap is not None and snap.step == st.version:  # NOTE [Consistent snapshots], rule 2
            snap.capture_before_update(st.index, st.lock, st.capture, st.state_nbytes)
        with st.lock:
            st.optimizer.step(self.grads)
            target = st.slots[st.slot_for(st.version + 1)]
            if target is not st.master:
                target.copy_(st.master)
        self.seconds = time.perf_counter() - t0
        return self


def stage_bytes(numel: int, optimizer: m.OptimizerSpec, dtype: str, double_buffer: bool) -> tuple[int, int]:
    """(published bytes in shared memory, private bytes) one stage holds (see DESIGN.md)."""
    private = numel * state_bytes_per_element(optimizer)
    if double_buffer:
        return 2 * _align(numel * m.DTYPE_ITEMSIZE[dtype]), private + numel * 4
    return _align(numel * 4), private


SEGMENT_START = 2**20
SEGMENT_DOUBLING_LIMIT = 64 * 2**20


def grown_capacity(capacity: int, needed: int) -> int:
    """The next size of a job's published segment: doubling up to 64 MiB, then +25%, and at
    least ``needed``. Few remaps (each keeps older views alive), at most 25% slack on big jobs."""
    step = capacity if capacity < SEGMENT_DOUBLING_LIMIT else capacity // 4
    return max(needed, capacity + step)


class Job:
    """A job: its stages in shared memory, its optimizer, its workers and sessions."""

    def __init__(self, record: JobRecord, memory: MemoryAccount, total_numel: int | None = None) -> None:
        self.name = record.name
        self._token = record.token_digest
        self.optimizer_spec = record.optimizer
        self.dtype = record.dtype
        self.delayed_update = record.delayed_update
        self.delay_after = record.delay_after
        self.frozen = record.frozen  # a base: weights only, read by jobs created on top of it
        self.base_name = record.base
        self.base: Job | None = None  # set by the server when it creates or restores this job
        self.double_buffer = record.double_buffer or record.dtype != "float32" or record.delayed_update
        self.base_step = 0  # delayed updates read max(t - 1, base_step): see NOTE rule 5
        self.published_dtype = record.dtype if self.double_buffer else "float32"
        self.memory = memory
        expected: int | None = None  # the published segment's final size, if known (huge pages)
        if total_numel is not None:
            pub, priv = stage_bytes(total_numel, record.optimizer, record.dtype, self.double_buffer)
            memory.check(pub + priv, f"job {record.name!r}")
            expected = pub
        self.snapshot: Snapshot | None = None  # the snapshot being written, if any
        self.last_snapshot_step: int | None = None
        self._versions: Counter[int] = Counter()  # stage version -> how many stages are at it
        self._updating = 0
        self.reserved = 0
        self.stages: list[StageState] = []
        self.workers: dict[int, Worker] = {}
        self._next_worker = 0
        self.counters = JobCounters()  # bytes served, gradients, durations (server/counters.py)
        self.num_params = 0
        self.sealed = False
        self.timeline: deque[m.TraceEvent] = deque(maxlen=m.MAX_TRACE_EVENTS)  # for ``timeline``
        self.timeline_dropped = 0
        self.world_size: int | None = None  # set by the first join; see Join
        self.started = False  # the start barrier opened
        self.max_stage_numel = 0
        self.last_activity = time.monotonic()  # of creation: an unsealed job idle too long is dropped
        # the segment's room beyond the stages in it is reserved too, until seal truncates it
        memory.reserve(SEGMENT_START, f"job {record.name!r} (its first shared-memory block)")
        self._slack = SEGMENT_START
        try:
            self.published_path = create_segment(SEGMENT_START, expected=expected)
        except BaseException:
            memory.release(SEGMENT_START)
            raise
        self.published_bytes = 0  # bytes in use
        self._capacity = SEGMENT_START
        self._mapping = map_segment(self.published_path, self._capacity)

    @classmethod
    def create(cls, msg: m.CreateJob, memory: MemoryAccount) -> Job:
        record = JobRecord(
            msg.name,
            token_digest(msg.token),
            msg.optimizer,
            msg.dtype,
            msg.double_buffer,
            [],
            msg.delayed_update,
            msg.delay_after,
            msg.frozen,
            msg.base,
        )
        return cls(record, memory, msg.total_numel)

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
            for i, tensors in stages:
                spec = record.specs[i]
                master = tensors["master"]
                if master.numel() != spec.numel or master.dtype != torch.float32:
                    raise LayoutError(f"snapshot of job {record.name!r}: stage {i} master does not fit its layout")
                st = job._append_stage(i, spec, lambda flat, src=master: flat.copy_(src))
                st.optimizer.load_state_tensors({k[4:]: v for k, v in tensors.items() if k.startswith("opt.")})
                st.version = step
                published = st.slots[st.slot_for(step)]
                if published is not st.master:
                    published.copy_(st.master)
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
        return JobRecord(
            self.name,
            self._token,
            self.optimizer_spec,
            self.dtype,
            self.double_buffer,
            [s.spec for s in self.stages],
            self.delayed_update,
            self.delay_after,
            self.frozen,
            self.base_name,
        )

    # ---- creation --------------------------------------------------------------------------------
    def add_stage(self, msg: m.AddStage, frames: list[zmq.Frame]) -> None:
        if self.sealed:
            raise StateError(f"job {self.name!r} is sealed: stages cannot be added any more")
        if msg.index != len(self.stages):
            raise LayoutError(f"job {self.name!r} expects stage {len(self.stages)} next, got stage {msg.index}")
        validate_stage(msg.index, msg.spec)
        numel = msg.spec.numel
        expected = numel * 4
        got = frames_nbytes(frames)
        if got != expected:
            raise LayoutError(
                f"stage {msg.index}: got {got} bytes of weights, the layout needs "
                f"{expected} ({numel} float32 elements)"
            )
        self._append_stage(msg.index, msg.spec, lambda flat: copy_frames_into(flat, frames))
        self._versions[0] += 1
        self.last_activity = time.monotonic()

    def _append_stage(self, index: int, spec: m.StageSpec, fill: Callable[[torch.Tensor], object]) -> StageState:
        """Reserve memory for stage ``index``, place it in the published segment, ``fill`` its
        fp32 master (a flat tensor of ``spec.numel``) and set up its optimizer."""
        numel = spec.numel
        pub, priv = stage_bytes(numel, self.optimizer_spec, self.dtype, self.double_buffer)
        if self.frozen:  # never updated: no optimizer state
            priv -= numel * state_bytes_per_element(self.optimizer_spec)
        offset = self.published_bytes
        capacity = self._capacity if offset + pub <= self._capacity else grown_capacity(self._capacity, offset + pub)
        slack = capacity - offset - pub
        what = f"job {self.name!r} stage {index}"
        self.memory.check(pub + priv + max(0, slack - self._slack), what)
        if capacity != self._capacity:
            grow_segment(self.published_path, capacity)
            self._capacity = capacity
            self._mapping = map_segment(self.published_path, capacity)  # older views keep older maps
        self.memory.reserve(pub + priv, what)
        self._set_slack(slack)
        self.reserved += pub + priv
        self.published_bytes = offset + pub
        pub_dtype = DTYPES[self.published_dtype]
        slot_nbytes = pub // 2 if self.double_buffer else pub
        views = [
            self._mapping[o : o + numel * pub_dtype.itemsize].view(pub_dtype)
            for o in ((offset, offset + slot_nbytes) if self.double_buffer else (offset,))
        ]
        if self.double_buffer:
            master = torch.empty(numel, dtype=torch.float32)
            fill(master)
            slots, offsets = (views[0], views[1]), (offset, offset + slot_nbytes)
            views[0].copy_(master)
        else:
            master = views[0]
            fill(master)
            slots, offsets = (master, master), (offset, offset)
        st = StageState(index, spec, master, slots, offsets, StageOptimizer(self.optimizer_spec, master))
        self.stages.append(st)
        self.max_stage_numel = max(self.max_stage_numel, numel)
        self.num_params += sum(numel_of(p.shape) for p in spec.params)
        return st

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
        truncate_segment(self.published_path, self.published_bytes)
        self._set_slack(0)
        self.sealed = True

    def _set_slack(self, slack: int) -> None:
        if slack > self._slack:
            self.memory.reserve(slack - self._slack, f"job {self.name!r} (shared-memory room)")
        else:
            self.memory.release(self._slack - slack)
        self._slack = slack

    def close(self) -> None:
        """Free everything: unlink segments and release the memory reserved."""
        for w in list(self.workers.values()):
            self._free_worker(w)
        self.workers.clear()
        unlink_segment(self.published_path)
        self.memory.release(self.reserved + self._slack)
        self.reserved = 0
        self._slack = 0

    def refuse_waiters(self, error: Callable[[bytes, int], None]) -> None:
        """Answer every deferred fetch and pull with ``error`` (the job is going away)."""
        for st in self.stages:
            for d in [*st.waiting_fetch, *st.waiting_pull]:
                error(d.identity, d.request_id)
            st.waiting_fetch.clear()
            st.waiting_pull.clear()

    # ---- queries -----------------------------------------------------------------------------------
    def check_proof(self, nonce: bytes, client_nonce: bytes, proof: bytes) -> None:
        """Check an attach proof (the expected value is never revealed)."""
        if not hmac.compare_digest(proof, attach_proof(self._token, self.name, nonce, client_nonce)):
            raise AuthError(f"wrong token for job {self.name!r}: the attach proof does not match")

    def check_base_proof(self, nonce: bytes, client_nonce: bytes, proof: bytes | None) -> None:
        """Check the proof a new job gives of this (frozen) job's token, to train on top of it."""
        if proof is None or not hmac.compare_digest(proof, base_proof(self._token, self.name, nonce, client_nonce)):
            raise AuthError(f"wrong token for the base {self.name!r}: the base proof does not match")

    def session_key(self, nonce: bytes, client_nonce: bytes) -> bytes:
        return session_key(self._token, nonce, client_nonce)

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
        return {
            "published": self.published_bytes,
            "private": max(0, self.reserved - self.published_bytes),  # 0 once closed
            "gradients": sum(w.reserved for w in workers),
            "reserve": self._slack,
        }

    def stage(self, index: int) -> StageState:
        if index >= len(self.stages):
            raise LayoutError(f"job {self.name!r} has {len(self.stages)} stages; there is no stage {index}")
        return self.stages[index]

    def worker_of(self, session: bytes) -> Worker:
        for w in self.workers.values():
            if w.session == session:
                return w
        raise StateError("this session has not joined the job as a worker: send 'join' first")

    def attached_reply(self, session: bytes, lease_s: float, request_id: int) -> m.Attached:
        return m.Attached(
            id=request_id,
            session=session,
            job=self.name,
            stages=[s.spec for s in self.stages],
            optimizer=self.optimizer_spec,
            dtype=self.dtype,
            step=max((s.version for s in self.stages), default=0),
            ready=self.ready,
            published_path=self.published_path,
            published_bytes=self.published_bytes,
            slot_offsets=[s.slot_offsets for s in self.stages],
            published_dtype=self.published_dtype,
            lease_s=lease_s,
            delayed_update=self.delayed_update,
            delay_after=self.delay_after,
            frozen=self.frozen,
            **self._base_fields(),
        )

    def _base_fields(self) -> dict[str, Any]:
        base = self.base
        if base is None:
            return {}
        return {
            "base": base.name,
            "base_stages": [s.spec for s in base.stages],
            "base_path": base.published_path,
            "base_bytes": base.published_bytes,
            "base_offsets": [s.slot_offsets[0] for s in base.stages],
        }

    def info(self) -> m.JobInfo:
        now = time.monotonic()
        return m.JobInfo(
            name=self.name,
            stages=len(self.stages),
            params=self.num_params,
            step=self.step,
            ready=self.ready,
            optimizer=type(self.optimizer_spec).__name__,
            dtype=self.dtype,
            bytes=sum(self.memory_by_kind().values()),
            workers=[
                m.WorkerInfo(id=w.id, shm=w.shm, first_step=w.first_step, idle_s=now - w.last_seen)
                for w in self.workers.values()
            ],
            updates=self.updates,
            optimizer_s=self.counters.optimizer.sum,
            last_snapshot=self.last_snapshot_step,
            steps_per_s=self.counters.steps.rate(now),
            frozen=self.frozen,
            base=self.base_name,
        )

    # ---- workers -----------------------------------------------------------------------------------
    def join(self, session: bytes, msg: m.Join) -> Worker:
        if not self.ready:
            raise NotReadyError(f"job {self.name!r} is still uploading its weights")
        if any(w.session == session for w in self.workers.values()):
            raise StateError("this session already joined the job as a worker")
        if self.frozen:
            raise StateError(
                f"job {self.name!r} is a frozen base: nothing trains it; create a job on top of it "
                "(create_job(..., base=...)) and train that"
            )
        if not self.started and self.world_size is not None and msg.world_size != self.world_size:
            raise StateError(
                f"job {self.name!r} is waiting for {self.world_size} workers; this worker says world_size="
                f"{msg.world_size}: give every worker the same world_size"
            )
        slot_bytes = _align(self.max_stage_numel * 4)
        nslots = 0 if msg.reader else msg.grad_slots
        nbytes = slot_bytes * nslots
        path, buf = "", torch.empty(0, dtype=torch.uint8)
        if nslots:
            self.memory.reserve(nbytes, f"gradient ring of a worker of job {self.name!r}")
            try:
                path = create_segment(nbytes)
            except BaseException:
                self.memory.release(nbytes)
                raise
            buf = map_segment(path, nbytes)
        slots = [
            buf[k * slot_bytes : k * slot_bytes + self.max_stage_numel * 4].view(torch.float32) for k in range(nslots)
        ]
        wid = self._next_worker
        self._next_worker += 1
        w = Worker(
            id=wid,
            session=session,
            shm=msg.shm,
            # the first step no stage has begun to update: a step whose update started anywhere
            # cannot be trained by a newcomer any more (its forward needs the old weights)
            first_step=max(s.version + s.updating for s in self.stages),
            grad_path=path,
            grad_buffer=buf,
            slots=slots,
            slot_bytes=slot_bytes,
            reserved=nbytes,
            reader=msg.reader,
        )
        self.workers[wid] = w
        log.info(
            "job %r: %s %d joined at step %d (shm=%s)", self.name, "reader" if w.reader else "worker", wid, w.first_step, w.shm
        )
        if self.world_size is None:
            self.world_size = msg.world_size
        return w

    def open_barrier(self, submit: Callable[[UpdateTask], None]) -> None:
        """Start training once ``world_size`` workers have joined (checked after every join)."""
        pushers = sum(not w.reader for w in self.workers.values())
        if not self.started and self.world_size is not None and pushers >= self.world_size:
            self.started = True
            self.counters.steps.start(time.monotonic())
            log.info("job %r: %d worker(s) joined, training starts", self.name, pushers)
            for st in self.stages:
                self._maybe_update(st, submit)

    def _free_worker(self, w: Worker) -> None:
        if w.grad_path:
            unlink_segment(w.grad_path)
        self.memory.release(w.reserved)
        w.reserved = 0

    def remove_worker(self, worker_id: int, submit: Callable[[UpdateTask], None], reason: str) -> list[Outgoing]:
        """Detach a worker: drop its unfinished pushes and start updates it was holding back."""
        w = self.workers.pop(worker_id, None)
        if w is None:
            return []
        log.info("job %r: worker %d detached (%s)", self.name, worker_id, reason)
        for st in self.stages:
            if not st.updating:
                st.pending.pop(worker_id, None)  # its gradient of an unfinished step is discarded
            self._maybe_update(st, submit)
        self._free_worker(w)
        return self.skip_abandoned_step()

    def _expected(self, step: int) -> set[int]:
        return {w.id for w in self.workers.values() if w.first_step <= step and not w.reader}

    # ---- fetch / push / pull -------------------------------------------------------------------
    def fetch(self, msg: m.Fetch, identity: bytes, worker: Worker) -> Outgoing | None:
        if not self.ready:
            raise NotReadyError(f"job {self.name!r} is still uploading its weights")
        st = self.stage(msg.stage)
        t = self.read_version(msg.step)
        if t == st.version and (not st.updating or not st.single_slot):  # an update writes the other slot
            return self._weights_reply(st, t, identity, msg.id, worker.shm)
        if self.delayed_update and t == st.version - 1 and not st.updating:  # NOTE rule 5
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
        if not self.delayed_update or step < self.delay_after:
            return step
        return max(step - 1, self.base_step)

    def _weights_reply(self, st: StageState, version: int, identity: bytes, request_id: int, shm: bool) -> Outgoing:
        k = st.slot_for(version)
        base = self.base.stages[st.index] if self.base is not None else None
        reply = m.Weights(
            id=request_id,
            stage=st.index,
            step=version,
            offset=st.slot_offsets[k],
            base_offset=base.slot_offsets[0] if base is not None else None,
        )
        self.counters.served["fetch", "shm" if shm else "frames"] += st.slots[k].nbytes
        frames: list[object] = [] if shm else list(tensor_frames(st.slots[k]))
        if base is not None and not shm:  # the base's stage follows the stage's own bytes
            frames += tensor_frames(base.slots[0])
        return Outgoing(identity, reply, frames)

    def push(
        self, msg: m.Push, frames: list[zmq.Frame], identity: bytes, worker: Worker, submit: Callable[[UpdateTask], None]
    ) -> None:
        st = self.stage(msg.stage)
        where = f"gradient of stage {msg.stage} step {msg.step}"
        if worker.reader:
            raise GradientError(f"{where}: this worker joined as a reader, which never pushes")
        if msg.step < worker.first_step:
            raise StaleStepError(f"{where}: this worker joined at step {worker.first_step}")
        if msg.step != st.version or st.updating:
            raise StaleStepError(
                f"{where}: the stage is at step {st.version}{' and updating' if st.updating else ''}; "
                f"only gradients for step {st.version} are accepted"
            )
        if worker.id in st.pending:
            raise GradientError(f"{where}: this worker already pushed it")
        if msg.slot >= len(worker.slots):
            raise GradientError(f"{where}: slot {msg.slot} does not exist (the ring has {len(worker.slots)})")
        if msg.slot in worker.busy:
            raise GradientError(f"{where}: slot {msg.slot} is still in use by an earlier push")
        if msg.numel != st.spec.numel:
            raise GradientError(f"{where}: {msg.numel} elements, the stage has {st.spec.numel}")
        if msg.dtype != "float32":
            raise GradientError(f"{where}: dtype {msg.dtype}; this server takes float32 gradients")
        if worker.shm and frames:
            raise GradientError(f"{where}: a shared-memory worker sends no data frame (the slot holds it)")
        if not worker.shm:
            got = frames_nbytes(frames)
            if got != st.spec.numel * 4:
                raise GradientError(f"{where}: data frames of {got} bytes, expected {st.spec.numel * 4}")
            copy_frames_into(worker.slots[msg.slot][: st.spec.numel], frames)
        worker.busy.add(msg.slot)
        st.pending[worker.id] = PendingPush(msg.slot, identity, msg.id)
        self.counters.gradients += 1
        self.counters.gradient_bytes += st.spec.numel * 4
        self._maybe_update(st, submit)

    def _maybe_update(self, st: StageState, submit: Callable[[UpdateTask], None]) -> None:
        if st.updating or not st.pending or not self.started:
            return
        expected = self._expected(st.version)
        if not expected.issubset(st.pending):
            return
        grads = [self.workers[wid].slots[p.slot][: st.spec.numel] for wid, p in sorted(st.pending.items())]
        first = min(p.arrived_ns for p in st.pending.values())
        self._trace(f"gradients {st.index}", "gather", "gradients in", first, time.monotonic_ns(), st.index, st.version)
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
            self._trace(f"queued {st.index}", "queue", "update queue", task.submitted_ns, task.started_ns, st.index, st.version)
            self._trace(f"update {st.index}", "optimizer", task.thread, task.started_ns, end, st.index, st.version)
        if error is None:
            log.debug("job %r stage %d: step %d applied (workers %s)", self.name, st.index, st.version, sorted(pending))
            self._set_version(st, st.version + 1)
            self.counters.optimizer.observe(task.seconds)
            st.updates += 1
            st.optimizer_s += task.seconds
            st.last_optimizer_s = task.seconds
        out.extend(self._answer_waiters(st))
        return out

    def _trace(self, name: str, cat: str, lane: str, start_ns: int, end_ns: int, stage: int, step: int) -> None:
        if len(self.timeline) == self.timeline.maxlen:
            self.timeline_dropped += 1
        self.timeline.append(
            m.TraceEvent(name=name, cat=cat, lane=lane, start_ns=start_ns, dur_ns=end_ns - start_ns, stage=stage, step=step)
        )

    def timeline_since(self, since_ns: int) -> list[m.TraceEvent]:
        return [e for e in self.timeline if e.start_ns + e.dur_ns >= since_ns]

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
                self._trace(f"fetch {st.index} waited", "deferred", "deferred fetches", d.since_ns, time.monotonic_ns(), st.index, d.step)
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
            while st.version < top and not st.updating and not st.pending and not self._expected(st.version):
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
        snapshot = st.master.clone()  # the master changes in place with the next update
        self.counters.served["pull", "frames"] += snapshot.nbytes
        return Outgoing(identity, m.Master(id=request_id, stage=st.index, version=st.version), list(tensor_frames(snapshot)))

