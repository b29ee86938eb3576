"""The state of one stage of a job on the server, and the update task that changes it.

A :class:`StageState` is the stage's fp32 master, its published slot(s) in the job's shared-memory
segment, its optimizer, its version and the requests waiting on it; an :class:`UpdateTask` is one
step's update of it, run on a pool thread (NOTE [Versions and who may read what] in versions.py
says when). Kept apart from :mod:`wstream.server.job` so that the pool and the byte accounting need
not know the whole job. A stage's buffers are gathered and updated here too (NOTE below).

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

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Union

import torch

from wstream.protocol import GradientError, StaleStepError
from wstream.protocol import messages as m
from wstream.protocol.frames import copy_frames_into, frames_nbytes, tensor_frames

from .optimizer import StageOptimizer
from .outgoing import Outgoing
from .snapshot import Snapshot
from .workers import Worker

SLOT_ALIGN_BYTES = 64
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def align(n: int) -> int:
    return (n + SLOT_ALIGN_BYTES - 1) // SLOT_ALIGN_BYTES * SLOT_ALIGN_BYTES


@dataclass(slots=True)
class Deferred:
    """A fetch or pull answered later, when its stage's update is done."""

    identity: bytes
    request_id: int
    step: int = 0
    shm: bool = True
    worker: Worker | None = None
    since_ns: int = field(default_factory=time.monotonic_ns)


@dataclass(slots=True)
class PendingPush:
    """A worker's gradient in its slot ``slot``, being added into the stage's accumulator."""

    slot: int
    identity: bytes
    request_id: int
    arrived_ns: int = field(default_factory=time.monotonic_ns)


@dataclass(slots=True)
class HeldPush:
    """A lone worker's gradient read in place from its slot by the stage's update (NOTE [Held
    gradient slots] in step_commit.py): ``pushed`` is answered when that update is done."""

    worker: int
    push: PendingPush
    source: torch.Tensor
    """The slot's first push-layout elements: the gradient, then the buffers' values."""
    attempt: int


@dataclass(slots=True)
class DeferredPush:
    """A push of a delayed-update job that came before its stage reached its step (NOTE [The
    step commit point] in step_commit.py, rule 6): accepted once the stage's update to it is done."""

    msg: m.Push
    frames: list[Any]
    identity: bytes
    worker: Worker


class UpdatedJob(Protocol):
    """What the pool's tasks need of their job (``wstream.server.job.Job``)."""

    name: str
    snapshot: Snapshot | None

    @property
    def attempt(self) -> int: ...


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
    waiting_push: list[DeferredPush] = field(default_factory=list)
    failed: str | None = None
    """Why the stage's last update failed (a bug in wstream): it stays at its version for good,
    so a fetch of a later version or a push is answered with this at once, not held."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held by the optimizer while it changes the stage and by a snapshot capturing it."""
    grad: torch.Tensor | None = None
    """The open step's pushes summed over workers (fp32, private): the gradient (its first
    ``grad_numel`` elements), then the stage's buffers (``push_layout``); None: nothing is pushed."""
    grad_numel: int = 0
    """Elements of ``grad`` that are the gradient (the optimizer's and the norm's part)."""
    buffers: tuple[tuple[int, int, int, bool], ...] = ()
    """Each buffer's (offset in the master, offset in ``grad``, numel, whether it counts): the
    update sets it to the workers' mean, or adds their mean increment to an integer buffer (a
    count), NOTE [Buffers] above."""
    gathered: set[int] = field(default_factory=set)
    """Workers whose gradient of the open step is in ``grad`` (their gather finished)."""
    parked: dict[int, torch.Tensor] = field(default_factory=dict)
    """Pending pushes of a multi-worker step left in their slots until the last expected one
    comes, when one gather sums them all (NOTE [Held gradient slots] in step_commit.py, rule 4):
    worker id -> its slot's push-layout elements."""
    gathering: int = 0
    """Gather tasks of this stage handed to the pool and not finished."""
    grad_lock: threading.Lock = field(default_factory=threading.Lock)
    """Held by a gather task while it adds into ``grad`` (pool threads only)."""
    acc: tuple[int, int] = (-1, 0)
    """(attempt, gradients added) of what ``grad`` holds: written by gather tasks under
    ``grad_lock``; a task of a newer attempt starts the sum again."""
    sumsq: tuple[int, int, float] | None = None
    """(attempt, gradients, squared L2 norm of ``grad``), computed by the gather task that added
    the last expected gradient (or by a :class:`NormTask`), or sent by the step's only worker
    with its push (``Push.sumsq``)."""
    held: HeldPush | None = None
    """The open or committed step's gradient when it stays in its worker's slot (NOTE [Held
    gradient slots] in step_commit.py): the update reads it there, and ``grad`` is not used."""
    updates: int = 0
    optimizer_s: float = 0.0
    last_optimizer_s: float = 0.0
    chain: tuple[int, int] | None = None
    """For a transfer unit (NOTE [Transfer units] in client/units.py): the first and last chain
    stages it holds, set when the job is sealed; None: the stage is one chain stage."""

    @property
    def what(self) -> str:
        """The stage as an error names it: ``"stage 3"``, ``"unit 3 (chain stages 300-399)"``."""
        if self.chain is None:
            return f"stage {self.index}"
        first, last = self.chain
        return f"unit {self.index} (chain stage {first})" if first == last else f"unit {self.index} (chain stages {first}-{last})"

    @property
    def span(self) -> str:
        """The stage in a timeline span's name: ``"3"``, or a unit's ``"3 (300-399)"``."""
        if self.chain is None:
            return str(self.index)
        first, last = self.chain
        return f"{self.index} ({first})" if first == last else f"{self.index} ({first}-{last})"

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
    def trained(self) -> bool:
        """Whether workers push for the stage: it has parameters that get gradients, or buffers
        (else it never gathers)."""
        return self.grad is not None

    @property
    def gradient(self) -> torch.Tensor:
        """The gradient part of ``grad`` (without the buffers' values)."""
        assert self.grad is not None
        return self.grad[: self.grad_numel]

    @property
    def single_slot(self) -> bool:
        return self.slots[0] is self.slots[1]

    def slot_for(self, version: int) -> int:
        return version % 2

    def weights_reply(
        self, version: int, identity: bytes, request_id: int, shm: bool, base: StageState | None, served: dict[tuple[str, str], int]
    ) -> Outgoing:
        """The ``weights`` of ``version`` (its slot; in data frames unless ``shm``), followed by the
        base's stage when the job has a base; the bytes are counted in ``served``."""
        k = self.slot_for(version)
        reply = m.Weights(
            id=request_id,
            stage=self.index,
            step=version,
            offset=self.slot_offsets[k],
            base_offset=base.slot_offsets[0] if base is not None else None,
        )
        served["fetch", "shm" if shm else "frames"] += self.slots[k].nbytes
        frames: list[object] = [] if shm else list(tensor_frames(self.slots[k]))
        if base is not None and not shm:  # the base's stage follows the stage's own bytes
            frames += tensor_frames(base.slots[0])
        return Outgoing(identity, reply, frames)

    def master_reply(self, identity: bytes, request_id: int, served: dict[tuple[str, str], int]) -> Outgoing:
        """The ``master`` reply of ``pull``: a copy of the fp32 master, in data frames."""
        snapshot = self.master.clone()  # the master changes in place with the next update
        served["pull", "frames"] += snapshot.nbytes
        return Outgoing(identity, m.Master(id=request_id, stage=self.index, version=self.version), list(tensor_frames(snapshot)))

    def accept_push(self, msg: m.Push, frames: list[Any], identity: bytes, worker: Worker) -> PendingPush:
        """Check a worker's gradient for this stage (NOTE [The step commit point] in step_commit.py),
        copy it into its slot when it came in data frames, and record it as pending."""
        where = f"gradient of {self.what} step {msg.step}"
        if worker.reader:
            raise GradientError(f"{where}: this worker joined as a reader, which never pushes")
        if msg.step < worker.first_step:
            raise StaleStepError(f"{where}: this worker joined at step {worker.first_step}")
        if self.grad is None:
            raise GradientError(
                f"{where}: every parameter of this stage is frozen and it has no buffer; it has nothing to push"
            )
        if msg.step != self.version or self.updating:
            raise StaleStepError(
                f"{where}: the stage is at step {self.version}{' and updating' if self.updating else ''}; "
                f"only gradients for step {self.version} are accepted"
            )
        if worker.id in self.pending or worker.id in self.gathered:
            raise GradientError(f"{where}: this worker already pushed it")
        if msg.slot >= len(worker.slots):
            raise GradientError(f"{where}: slot {msg.slot} does not exist (the ring has {len(worker.slots)})")
        if msg.slot in worker.busy:
            raise GradientError(f"{where}: slot {msg.slot} is still in use by an earlier push")
        numel = self.grad.numel()  # the push layout: frozen parameters have no gradient, buffers follow it
        if msg.numel != numel:
            raise GradientError(
                f"{where}: {msg.numel} elements, its gradient has {numel}"
                + (f" (its frozen parameters have none; the stage has {self.spec.numel})" if numel != self.spec.numel else "")
                + (f" ({self.grad_numel} of gradient, then its buffers)" if self.buffers else "")
            )
        if msg.dtype != "float32":
            raise GradientError(f"{where}: dtype {msg.dtype}; this server takes float32 gradients")
        if msg.sumsq is not None and msg.sumsq < 0:
            raise GradientError(f"{where}: a squared norm of {msg.sumsq} (it is never negative)")
        if worker.shm and frames:
            raise GradientError(f"{where}: a shared-memory worker sends no data frame (the slot holds it)")
        if not worker.shm:
            got = frames_nbytes(frames)
            if got != numel * 4:
                raise GradientError(f"{where}: data frames of {got} bytes, expected {numel * 4}")
            copy_frames_into(worker.slots[msg.slot][:numel], frames)
        worker.busy.add(msg.slot)
        pending = self.pending[worker.id] = PendingPush(msg.slot, identity, msg.id)
        return pending


@dataclass(slots=True)
class GatherTask:
    """Add workers' gradients (their slots) into the stage's accumulator, off the loop thread, in one
    pass over memory: the first gradients of an attempt are summed into it (``torch.add(a, b,
    out=grad)``: read 8 bytes and write 4 per parameter, where copying the first and adding the
    second took 20), and the task that brings the ``expected``-th gradient of its attempt also
    computes the squared norm of the sum."""

    job: UpdatedJob
    stage: StageState
    workers: tuple[int, ...]
    sources: tuple[torch.Tensor, ...]
    """Each worker's slot (its push-layout elements), in ``workers`` order."""
    attempt: int
    expected: int
    sumsq: float | None = None
    """The worker's squared norm of its gradient (``Push.sumsq``): the stage's when it is the only
    gradient expected, so that no pass over the sum is needed."""
    seconds: float = 0.0
    submitted_ns: int = field(default_factory=time.monotonic_ns)
    started_ns: int = 0
    thread: str = ""

    def run(self) -> GatherTask:
        self.started_ns = time.monotonic_ns()
        self.thread = threading.current_thread().name
        t0 = time.perf_counter()
        st = self.stage
        assert st.grad is not None
        with st.grad_lock:
            if self.attempt == self.job.attempt:  # else: a discarded attempt's, nothing to add
                attempt, count = st.acc
                if attempt != self.attempt:
                    count = 0
                sources = self.sources
                if count == 0 and len(sources) >= 2:
                    torch.add(sources[0], sources[1], out=st.grad)
                    sources = sources[2:]
                elif count == 0:
                    st.grad.copy_(sources[0])
                    sources = sources[1:]
                for source in sources:
                    st.grad.add_(source)
                count += len(self.sources)
                st.acc = (self.attempt, count)
                if count == self.expected:
                    norm = self.sumsq if count == 1 and self.sumsq is not None else squared_norm(st.gradient)
                    st.sumsq = (self.attempt, count, norm)
        self.seconds = time.perf_counter() - t0
        return self


@dataclass(slots=True)
class NormTask:
    """The squared norm of a stage whose last expected gradient came without a task knowing it
    was the last (a worker that had pushed nothing left the step)."""

    job: UpdatedJob
    stage: StageState
    attempt: int
    seconds: float = 0.0

    def run(self) -> NormTask:
        t0 = time.perf_counter()
        st = self.stage
        assert st.grad is not None
        with st.grad_lock:
            attempt, count = st.acc
            if attempt == self.attempt == self.job.attempt:
                st.sumsq = (attempt, count, squared_norm(st.gradient))
        self.seconds = time.perf_counter() - t0
        return self


def squared_norm(grad: torch.Tensor) -> float:
    """||grad||^2 as ``torch.nn.utils.clip_grad_norm_`` measures it (a float32 L2 norm), squared
    in float64 so that stages add up without overflow."""
    return float(torch.linalg.vector_norm(grad)) ** 2


@dataclass(slots=True)
class UpdateTask:
    """One stage's update of a committed step, run off the loop thread: the optimizer on the
    accumulated gradient (divided by ``grad_scale``: the number of workers over the clipping
    factor) at learning rate ``lr``, the buffers set to the ``workers``' mean, then publication of
    the new weights. ``apply`` False (a skipped step, or a stage with nothing to train) only
    publishes, so the version can move on."""

    job: UpdatedJob
    stage: StageState
    grad_scale: float = 1.0
    lr: float | None = None
    apply: bool = True
    workers: int = 1
    source: torch.Tensor | None = None
    """The step's gradient (then the buffers) when it is read in place from a held slot; None:
    the stage's accumulator ``grad``."""
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
            if self.apply and st.grad is not None:
                grad = st.grad if self.source is None else self.source
                st.optimizer.step(grad[: st.grad_numel], grad_scale=None if self.grad_scale == 1.0 else self.grad_scale, lr=self.lr)
                for master_at, at, n, counts in st.buffers:  # the workers' mean (the sum divided: exact for W = 1)
                    target = st.master[master_at : master_at + n]
                    if counts:
                        target.add_(grad[at : at + n] / self.workers)
                    else:
                        torch.div(grad[at : at + n], self.workers, out=target)
            target = st.slots[st.slot_for(st.version + 1)]
            if target is not st.master:
                target.copy_(st.master)
        self.seconds = time.perf_counter() - t0
        return self


PoolTask = Union[UpdateTask, GatherTask, NormTask]
"""What the loop hands the optimizer pool."""


def stage_bytes(numel: int, state: int, dtype: str, double_buffer: bool, *, grad_numel: int) -> tuple[int, int]:
    """(published bytes in shared memory, private bytes) one stage of ``numel`` elements holds
    (see DESIGN.md, "Memory accounting"): ``state`` bytes of optimizer state
    (``optimizer.state_nbytes``, of the trained elements only) and ``grad_numel`` elements of the
    step's gradient accumulator (the gradient layout; 0 for a frozen base's stage)."""
    published = (2 if double_buffer else 1) * align(numel * m.DTYPE_ITEMSIZE[dtype])
    private = state + grad_numel * 4
    if double_buffer or dtype != "float32":  # the fp32 master is not the published copy
        private += numel * 4
    return published, private
