"""The state of one stage of a job on the server.

A :class:`StageState` is the stage's fp32 master, its published slot(s) in the job's shared-memory
segment, its optimizer, its version, the gradients of the open step and the requests waiting on
it; the pool's tasks that gather into it and update it are in :mod:`wstream.server.pool_tasks`.
Kept apart from :mod:`wstream.server.job` so that the pool and the byte accounting need not know
the whole job. A stage's buffers are gathered and updated with it (NOTE below).

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
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from wstream.protocol import GradientError, MemoryLimitError, StaleStepError, format_bytes
from wstream.protocol import messages as m
from wstream.protocol.frames import copy_frames_into, frames_nbytes, tensor_frames

from .optimizer import StageOptimizer
from .outgoing import Outgoing
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


SharedCopy = tuple[int, "weakref.ref[Any]"]
"""A copy of one version of a tensor that replies share: (version, weak reference to its bytes)."""

REPLY_COPIES_STAGES = 8
"""Copies that replies not yet sent may hold alive, per job, in bytes of its largest stage copied,
or twice the job's weights (a reader prefetching every stage at once), whichever is more."""


class ReplyCopies:
    """The bytes of one job's weight copies that replies hold until ZeroMQ has sent them (``pull``,
    a reader's ``fetch`` in data frames): a peer that asks and never reads keeps each alive in the
    server's send queue, outside the memory limit (found by review: 16 MiB a step). At most
    :data:`REPLY_COPIES_STAGES` times the largest copy made so far; past that a new copy is refused
    (:class:`MemoryLimitError`) until replies are read. Copies go when their frames are sent,
    from ZeroMQ's thread: hence the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.nbytes = 0
        self.largest = 0
        self.weights = 0
        """The job's weights in bytes (fp32), set as its stages are added."""
        self.made = 0
        self.refused = 0

    def admit(self, nbytes: int, what: str) -> None:
        with self._lock:
            self.largest = max(self.largest, nbytes)
            budget = max(REPLY_COPIES_STAGES * self.largest, 2 * self.weights)
            if self.nbytes and self.nbytes + nbytes > budget:
                self.refused += 1
                raise MemoryLimitError(
                    f"{what}: replies not read yet hold {format_bytes(self.nbytes)} of this job's weight copies "
                    f"(at most {REPLY_COPIES_STAGES} of its largest stage or twice its weights, {format_bytes(budget)}): "
                    "the peer that asked for them must read its replies before asking again"
                )
            self.nbytes += nbytes
            self.made += 1

    def _gone(self, nbytes: int) -> None:
        with self._lock:
            self.nbytes -= nbytes

    def held_by(self, owner: object, nbytes: int) -> None:
        """``owner`` holds ``nbytes`` admitted: they are given back when it goes."""
        weakref.finalize(owner, self._gone, nbytes)


def shared_copy_frames(
    cached: SharedCopy | None, version: int, source: torch.Tensor, copies: ReplyCopies, what: str
) -> tuple[list[object], SharedCopy]:
    """Data frames of a copy of ``source`` (holding ``version``): the ``cached`` copy while a reply
    still queued keeps it alive and it is of that version, else a new one, if ``copies`` admits it.
    The frames keep the copy's bytes (a NumPy array) alive while they wait to be sent: that is what
    is shared."""
    if cached is not None and cached[0] == version:
        owner = cached[1]()
        if owner is not None:
            return list(tensor_frames(torch.from_numpy(owner))), cached
    copies.admit(source.nbytes, what)
    frames: list[object] = list(tensor_frames(source.clone()))
    owner = frames[0].obj  # type: ignore[attr-defined]
    copies.held_by(owner, source.nbytes)
    return frames, (version, weakref.ref(owner))


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
    pulled: SharedCopy | None = None
    """The copy of the master that ``pull`` replies of one version share (its version and a weak
    reference: it lives while a reply's frames wait to be sent)."""
    served_copy: SharedCopy | None = None
    """The same for a reader's ``weights`` replies in data frames: a copy of one version."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held by the optimizer while it changes the stage and by a snapshot capturing it."""
    grad: torch.Tensor | None = None
    """The open step's pushes summed over workers (fp32, private): the gradient (its first
    ``grad_numel`` elements), then the stage's buffers (``push_layout``); None: nothing is pushed."""
    exact_ints: tuple[tuple[int, int, int], ...] = ()
    """The integer buffers a 16-bit published copy holds as int32 values, written after every
    publication (NOTE [Integer buffers in a 16-bit published copy] in protocol/layout.py)."""
    grad_numel: int = 0
    """Elements of ``grad`` that are the gradient (the optimizer's and the norm's part)."""
    buffers: tuple[tuple[int, int, int, bool], ...] = ()
    """Each buffer's (offset in the master, offset in ``grad``, numel, whether it counts): the
    update sets it to the workers' mean, or adds their mean increment to an integer buffer (a
    count), NOTE [Buffers] above."""
    gathered: set[int] = field(default_factory=set)
    """Workers whose gradient of the open step is in ``grad`` (their gather finished)."""
    parked: dict[int, tuple[torch.Tensor, float | None]] = field(default_factory=dict)
    """Pending pushes of a multi-worker step left in their slots until the last expected one
    comes, when one gather sums them all (NOTE [Held gradient slots] in step_commit.py, rule 4):
    worker id -> its slot's push-layout elements and the push's ``sumsq``."""
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
    def chain_stages(self) -> str:
        """The chain stages it holds: ``"3"``, or a unit's ``"300-399"``."""
        first, last = self.chain or (self.index, self.index)
        return str(first) if first == last else f"{first}-{last}"

    @property
    def what(self) -> str:
        """The stage as an error names it: ``"stage 3"``, ``"unit 3 (chain stages 300-399)"``."""
        if self.chain is None:
            return f"stage {self.index}"
        plural = "s" if self.chain[0] != self.chain[1] else ""
        return f"unit {self.index} (chain stage{plural} {self.chain_stages})"

    @property
    def span(self) -> str:
        """The stage in a timeline span's name: ``"3"``, or a unit's ``"3 (300-399)"``."""
        return str(self.index) if self.chain is None else f"{self.index} ({self.chain_stages})"

    def capture(self, previous: bool = False) -> dict[str, torch.Tensor]:
        """Copies of what a snapshot keeps of this stage (call with ``lock`` held); ``previous``:
        the published copy of the version before too (a delayed job's, NOTE [Consistent snapshots]
        rule 5 in snapshot.py)."""
        out = {"master": self.master.clone()}
        for k, v in self.optimizer.state_tensors().items():
            out[f"opt.{k}"] = v.clone()
        if previous and not self.single_slot:
            out["previous"] = self.slots[self.slot_for(self.version - 1)].clone()
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
        self, version: int, identity: bytes, request_id: int, shm: bool, base: StageState | None, served: dict[tuple[str, str], int],
        *, copy: ReplyCopies | None = None,
    ) -> Outgoing:
        """The ``weights`` of ``version`` (its slot; in data frames unless ``shm``), followed by the
        base's stage when the job has a base; the bytes of both are counted in ``served``. ``copy``
        (the job's copies): the frames are a copy of the version, not the slot itself (a reader's:
        NOTE [Versions and who may read what] rule 8), one per version for all its replies still
        queued, as ``pull``'s."""
        k = self.slot_for(version)
        reply = m.Weights(
            id=request_id,
            stage=self.index,
            step=version,
            offset=self.slot_offsets[k],
            base_offset=base.slot_offsets[0] if base is not None else None,
        )
        frames: list[object] = []
        if not shm:
            if copy is not None:
                frames, self.served_copy = shared_copy_frames(self.served_copy, version, self.slots[k], copy, f"fetch of {self.what}")
            else:
                frames = list(tensor_frames(self.slots[k]))
        if base is not None and not shm:  # the base's stage follows the stage's own bytes
            frames += tensor_frames(base.slots[0])
        # (counted once served: a copy refused is not) the base's stage too, to this job, whose worker fetched it
        served["fetch", "shm" if shm else "frames"] += self.slots[k].nbytes + (base.slots[0].nbytes if base is not None else 0)
        return Outgoing(identity, reply, frames)

    def master_reply(self, identity: bytes, request_id: int, served: dict[tuple[str, str], int], copies: ReplyCopies) -> Outgoing:
        """The ``master`` reply of ``pull``: a copy of the fp32 master, in data frames."""
        # the master changes in place with the next update: a copy, one per version for all the
        # replies still waiting to be sent, as many as ``copies`` admits
        frames, self.pulled = shared_copy_frames(self.pulled, self.version, self.master, copies, f"pull of {self.what}")
        served["pull", "frames"] += self.master.nbytes
        return Outgoing(identity, m.Master(id=request_id, stage=self.index, version=self.version), frames)

    def check_push(self, msg: m.Push, frames: list[Any], worker: Worker) -> None:
        """The checks of a push that do not depend on where the stage is: who pushes, into which
        slot, how much, in what (a delayed job's push that comes early is checked before it is held)."""
        where = f"gradient of {self.what} step {msg.step}"
        if worker.reader:
            raise GradientError(f"{where}: this worker joined as a reader, which never pushes")
        if msg.step < worker.first_step:
            raise StaleStepError(f"{where}: this worker joined at step {worker.first_step}")
        if self.grad is None:
            raise GradientError(
                f"{where}: every parameter of this stage is frozen and it has no buffer; it has nothing to push"
            )
        if msg.slot >= len(worker.slots):
            raise GradientError(f"{where}: slot {msg.slot} does not exist (the ring has {len(worker.slots)})")
        if worker.slot_offsets and msg.slot != self.index:
            raise GradientError(f"{where}: slot {msg.slot} of a step ring, whose slot {self.index} is this stage's")
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
        if not worker.shm and frames_nbytes(frames) != numel * 4:
            raise GradientError(f"{where}: data frames of {frames_nbytes(frames)} bytes, expected {numel * 4}")

    def accept_push(self, msg: m.Push, frames: list[Any], identity: bytes, worker: Worker) -> PendingPush:
        """Check a worker's gradient for this stage (NOTE [The step commit point] in step_commit.py),
        copy it into its slot when it came in data frames, and record it as pending."""
        self.check_push(msg, frames, worker)
        where = f"gradient of {self.what} step {msg.step}"
        if msg.step != self.version or self.updating:
            raise StaleStepError(
                f"{where}: the stage is at step {self.version}{' and updating' if self.updating else ''}; "
                f"only gradients for step {self.version} are accepted"
            )
        if worker.id in self.pending or worker.id in self.gathered:
            raise GradientError(f"{where}: this worker already pushed it")
        if msg.slot in worker.busy:
            raise GradientError(f"{where}: slot {msg.slot} is still in use by an earlier push")
        if not worker.shm:
            assert self.grad is not None  # (check_push)
            copy_frames_into(worker.slots[msg.slot][: self.grad.numel()], frames)
        worker.busy.add(msg.slot)
        pending = self.pending[worker.id] = PendingPush(msg.slot, identity, msg.id)
        return pending


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
