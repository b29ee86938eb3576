"""Every wire message of the wstream protocol, one frozen typed record per op.

A message is a multipart ZeroMQ message: one msgpack header frame (a map with ``v``, ``op``,
``id`` and the op's fields) followed by the op's raw data frames, if any. The records below *are*
the schema: msgspec checks field types and the declared ranges while decoding, so a message that
decodes is a valid message. ``protocol/README.md`` is the prose specification of the same.
"""

from __future__ import annotations

import math
from typing import Annotated, ClassVar, Literal, Union

from msgspec import Meta, Struct

PROTOCOL_VERSION = 1
"""Carried in every header; a server answers any other value with ``version_mismatch``."""

# ---- bounds on everything read from the wire ------------------------------------------------
MAX_HEADER_BYTES = 64 * 2**20
MAX_STAGES = 1_000_000
MAX_PARAMS_PER_STAGE = 65_536
MAX_DIMS = 8
MAX_NUMEL = 2**40
MAX_GRAD_SLOTS = 64
MAX_STEP = 2**62
MAX_DATA_FRAMES = 1 << 16
CHUNK_BYTES = 4 * 2**20
"""Tensor bytes travel in data frames of at most this size: one 64 MiB ZeroMQ frame moves several
times slower than the same bytes in 4 MiB frames (see BENCHMARKS.md)."""

JobName = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")]
ParamName = Annotated[str, Meta(min_length=1, max_length=512)]
Token = Annotated[str, Meta(min_length=1, max_length=4096)]
SessionId = Annotated[bytes, Meta(min_length=16, max_length=16)]
RequestId = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Step = Annotated[int, Meta(ge=0, le=MAX_STEP)]
StageIndex = Annotated[int, Meta(ge=0, lt=MAX_STAGES)]
Numel = Annotated[int, Meta(ge=0, le=MAX_NUMEL)]
Dim = Annotated[int, Meta(ge=0, le=MAX_NUMEL)]
SlotIndex = Annotated[int, Meta(ge=0, lt=MAX_GRAD_SLOTS)]
Dtype = Literal["float32", "bfloat16", "float16"]

DTYPE_ITEMSIZE: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


# ---- layout and optimizer records (also part of the public client API) -----------------------
class ParamSpec(Struct, frozen=True, array_like=True):
    """One parameter of a stage: a view ``flat[offset : offset + numel(shape)].view(shape)``."""

    name: ParamName
    shape: Annotated[tuple[Dim, ...], Meta(max_length=MAX_DIMS)]
    offset: Numel


class StageSpec(Struct, frozen=True, kw_only=True):
    """The flat-buffer layout of one stage (see ``wstream.protocol.layout``)."""

    name: ParamName
    numel: Numel
    params: Annotated[list[ParamSpec], Meta(max_length=MAX_PARAMS_PER_STAGE)]


def _check_finite(name: str, value: float, *, low: float, high: float = math.inf) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{name} must be a finite number in [{low}, {high}], got {value}")


class AdamW(Struct, frozen=True, kw_only=True, tag="adamw", tag_field="kind"):
    """AdamW as ``torch.optim.AdamW`` defines it (decoupled weight decay); run fused on the server."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        _check_finite("lr", self.lr, low=0.0)
        _check_finite("betas[0]", self.betas[0], low=0.0, high=0.999999)
        _check_finite("betas[1]", self.betas[1], low=0.0, high=0.999999999)
        _check_finite("eps", self.eps, low=0.0)
        _check_finite("weight_decay", self.weight_decay, low=0.0)


class SGD(Struct, frozen=True, kw_only=True, tag="sgd", tag_field="kind"):
    """SGD with optional (Nesterov) momentum, as ``torch.optim.SGD`` defines it."""

    lr: float = 1e-2
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        _check_finite("lr", self.lr, low=0.0)
        _check_finite("momentum", self.momentum, low=0.0, high=1.0)
        _check_finite("dampening", self.dampening, low=0.0, high=1.0)
        _check_finite("weight_decay", self.weight_decay, low=0.0)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("nesterov momentum needs momentum > 0 and dampening = 0")


OptimizerSpec = Union[AdamW, SGD]


# ---- messages ----------------------------------------------------------------------------------
class Message(Struct, frozen=True, kw_only=True, tag_field="op", forbid_unknown_fields=True):
    """Header fields common to every message. ``frames`` = (min, max) data frames after it."""

    v: int = PROTOCOL_VERSION
    id: RequestId = 0
    frames: ClassVar[tuple[int, int]] = (0, 0)


# -- requests (client -> server)
class CreateJob(Message, tag="create_job"):
    """Open a new job; its stages follow one by one (``add_stage``) and ``seal`` ends creation.

    ``total_numel``, when the creator knows it, lets the server refuse a job that cannot fit before
    any weights travel."""

    name: JobName
    token: Token
    optimizer: OptimizerSpec
    dtype: Dtype = "float32"
    double_buffer: bool = False
    total_numel: Numel | None = None


class AddStage(Message, tag="add_stage"):
    """Append one stage: its layout, and its fp32 weights as the data frames."""

    frames: ClassVar[tuple[int, int]] = (1, MAX_DATA_FRAMES)
    session: SessionId
    index: StageIndex
    spec: StageSpec


class Seal(Message, tag="seal"):
    """End creation: the job becomes ready for workers. Replied with ``attached``."""

    session: SessionId


class Attach(Message, tag="attach"):
    name: JobName
    token: Token


class Join(Message, tag="join"):
    """Become a data-parallel worker. No update runs until ``world_size`` workers have joined (a
    start barrier, as a fixed world size in DDP); after that the live workers make each step."""

    session: SessionId
    shm: bool
    grad_slots: Annotated[int, Meta(ge=1, le=MAX_GRAD_SLOTS)] = 2
    world_size: Annotated[int, Meta(ge=1, le=65_536)] = 1


class Fetch(Message, tag="fetch"):
    session: SessionId
    stage: StageIndex
    step: Step


class Push(Message, tag="push"):
    frames: ClassVar[tuple[int, int]] = (0, MAX_DATA_FRAMES)
    session: SessionId
    stage: StageIndex
    step: Step
    slot: SlotIndex
    numel: Numel
    dtype: Dtype = "float32"


class Pull(Message, tag="pull"):
    session: SessionId
    stage: StageIndex


class Heartbeat(Message, tag="heartbeat"):
    session: SessionId


class Leave(Message, tag="leave"):
    session: SessionId


class DropJob(Message, tag="drop_job"):
    session: SessionId


class Status(Message, tag="status"):
    pass


class Save(Message, tag="save"):
    """Write a snapshot of the session's job at its next consistent step (at once when it is
    idle); answered with ``saved`` once the snapshot is durable on disk."""

    session: SessionId


Request = Union[CreateJob, AddStage, Seal, Attach, Join, Fetch, Push, Pull, Heartbeat, Leave, DropJob, Status, Save]


# -- replies (server -> client)
class Attached(Message, tag="attached"):
    session: SessionId
    job: JobName
    stages: list[StageSpec]
    optimizer: OptimizerSpec
    dtype: Dtype
    step: Step
    ready: bool
    published_path: str
    published_bytes: int
    slot_offsets: list[tuple[int, int]]
    """Byte offsets in the published segment of each stage's two slots (equal when single)."""
    published_dtype: Dtype
    lease_s: float


class Joined(Message, tag="joined"):
    worker: int
    step: Step
    grad_path: str
    grad_slot_bytes: int
    grad_slots: int


class Weights(Message, tag="weights"):
    """Stage weights for ``step`` are at ``offset`` in the published segment (or in the frames)."""

    frames: ClassVar[tuple[int, int]] = (0, MAX_DATA_FRAMES)
    stage: StageIndex
    step: Step
    offset: int


class Pushed(Message, tag="pushed"):
    """The gradient is consumed and ``slot`` is free again."""

    stage: StageIndex
    step: Step
    slot: SlotIndex


class Master(Message, tag="master"):
    frames: ClassVar[tuple[int, int]] = (1, MAX_DATA_FRAMES)
    stage: StageIndex
    version: Step


class Ok(Message, tag="ok"):
    pass


class Saved(Message, tag="saved"):
    step: Step
    path: str


class WorkerInfo(Struct, frozen=True, kw_only=True):
    id: int
    shm: bool
    first_step: int
    idle_s: float


class JobInfo(Struct, frozen=True, kw_only=True):
    name: str
    stages: int
    params: int
    step: int
    ready: bool
    optimizer: str
    dtype: str
    bytes: int
    workers: list[WorkerInfo]
    updates: int
    optimizer_s: float
    last_snapshot: int | None = None
    """The step of the job's newest snapshot on disk (None: none yet, or no store)."""


class StatusReply(Message, tag="status_reply"):
    protocol: int
    pid: int
    uptime_s: float
    memory_limit: int
    memory_used: int
    jobs: list[JobInfo]


class Error(Message, tag="error"):
    code: str
    message: str


Reply = Union[Attached, Joined, Weights, Pushed, Master, Ok, Saved, StatusReply, Error]


def op_of(cls: type[Message]) -> str:
    """The ``op`` string of a message class."""
    tag = cls.__struct_config__.tag
    assert isinstance(tag, str)
    return tag


REQUEST_TYPES: dict[str, type[Message]] = {
    op_of(c): c
    for c in (CreateJob, AddStage, Seal, Attach, Join, Fetch, Push, Pull, Heartbeat, Leave, DropJob, Status, Save)
}
REPLY_TYPES: dict[str, type[Message]] = {
    op_of(c): c for c in (Attached, Joined, Weights, Pushed, Master, Ok, Saved, StatusReply, Error)
}

