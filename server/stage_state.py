"""The state of one stage of a job on the server, and the update task that changes it.

A :class:`StageState` is the stage's fp32 master, its published slot(s) in the job's shared-memory
segment, its optimizer, its version and the requests waiting on it; an :class:`UpdateTask` is one
step's update of it, run on a pool thread (NOTE [Versions and who may read what] in job.py says
when). Kept apart from :mod:`wstream.server.job` so that the pool and the byte accounting need not
know the whole job.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

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
    """A worker's gradient in its slot ``slot``, waiting for the stage's update."""

    slot: int
    identity: bytes
    request_id: int
    arrived_ns: int = field(default_factory=time.monotonic_ns)


class UpdatedJob(Protocol):
    """What an :class:`UpdateTask` needs of its job (``wstream.server.job.Job``)."""

    name: str
    snapshot: Snapshot | None

    def finish_update(self, task: UpdateTask, error: BaseException | None) -> list[Outgoing]: ...


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

    def accept_push(self, msg: m.Push, frames: list[Any], identity: bytes, worker: Worker) -> None:
        """Check a worker's gradient for this stage (NOTE [Versions and who may read what] in
        job.py, rules 1 and 4), copy it into its slot when it came in data frames, and record it
        as pending."""
        where = f"gradient of stage {msg.stage} step {msg.step}"
        if worker.reader:
            raise GradientError(f"{where}: this worker joined as a reader, which never pushes")
        if msg.step < worker.first_step:
            raise StaleStepError(f"{where}: this worker joined at step {worker.first_step}")
        if msg.step != self.version or self.updating:
            raise StaleStepError(
                f"{where}: the stage is at step {self.version}{' and updating' if self.updating else ''}; "
                f"only gradients for step {self.version} are accepted"
            )
        if worker.id in self.pending:
            raise GradientError(f"{where}: this worker already pushed it")
        if msg.slot >= len(worker.slots):
            raise GradientError(f"{where}: slot {msg.slot} does not exist (the ring has {len(worker.slots)})")
        if msg.slot in worker.busy:
            raise GradientError(f"{where}: slot {msg.slot} is still in use by an earlier push")
        numel = self.optimizer.layout.numel  # groups: the gradient leaves frozen parameters out
        if msg.numel != numel:
            raise GradientError(
                f"{where}: {msg.numel} elements, stage {self.index}'s gradient has {numel}"
                + (f" (its frozen parameters have none; the stage has {self.spec.numel})" if numel != self.spec.numel else "")
            )
        if msg.dtype != "float32":
            raise GradientError(f"{where}: dtype {msg.dtype}; this server takes float32 gradients")
        if worker.shm and frames:
            raise GradientError(f"{where}: a shared-memory worker sends no data frame (the slot holds it)")
        if not worker.shm:
            got = frames_nbytes(frames)
            if got != numel * 4:  # groups: of the gradient layout
                raise GradientError(f"{where}: data frames of {got} bytes, expected {numel * 4}")
            copy_frames_into(worker.slots[msg.slot][:numel], frames)
        worker.busy.add(msg.slot)
        self.pending[worker.id] = PendingPush(msg.slot, identity, msg.id)


@dataclass(slots=True)
class UpdateTask:
    """Work for the optimizer pool; ``run`` executes off the loop thread."""

    job: UpdatedJob
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
            # groups: the mean of the gradients (of the gradient layout's numel), summed in place
            # into the first and divided by their number inside the fused kernel
            n = st.optimizer.layout.numel
            grad = self.grads[0][:n]
            for other in self.grads[1:]:
                grad.add_(other[:n])
            st.optimizer.step(grad, grad_scale=len(self.grads) if len(self.grads) > 1 else None)
            target = st.slots[st.slot_for(st.version + 1)]
            if target is not st.master:
                target.copy_(st.master)
        self.seconds = time.perf_counter() - t0
        return self


def stage_bytes(numel: int, state: int, dtype: str, double_buffer: bool) -> tuple[int, int]:
    """(published bytes in shared memory, private bytes) one stage of ``numel`` elements holds,
    with ``state`` bytes of optimizer state (``optimizer.state_nbytes``; see DESIGN.md)."""
    private = state  # groups: of the trained elements only (was numel * bytes per element)
    if double_buffer:
        return 2 * align(numel * m.DTYPE_ITEMSIZE[dtype]), private + numel * 4
    return align(numel * 4), private
