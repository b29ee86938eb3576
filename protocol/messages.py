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

from .lr_schedules import Constant, Schedule

PROTOCOL_VERSION = 11
"""Carried in every header; a server answers any other value with ``version_mismatch``.
docs/protocol.md lists what changed in each version."""

# ---- bounds on everything read from the wire ------------------------------------------------
MAX_HEADER_BYTES = 64 * 2**20
MAX_STAGES = 1_000_000
MAX_PARAMS_PER_STAGE = 65_536
MAX_UNITS = 1 << 20
"""The most server stages a ``JobOptions.units`` list may describe."""
MAX_CHAIN_STAGES = 2**32
"""The most chain stages a job's ``units`` may add up to (and so one entry may hold)."""
MAX_DIMS = 8
MAX_NUMEL = 2**40
MAX_GRAD_SLOTS = 64
MAX_STEP = 2**62
MAX_DATA_FRAMES = 1 << 16
MAX_TRACE_EVENTS = 65_536
MAX_PARAM_GROUPS = 1024
"""At most this many entries in ``JobOptions.param_groups`` (a parameter's ``group`` is 0..this)."""
CHUNK_BYTES = 4 * 2**20
"""Tensor bytes travel in data frames of at most this size: one 64 MiB ZeroMQ frame moves several
times slower than the same bytes in 4 MiB frames (see BENCHMARKS.md)."""

JobName = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"\A[A-Za-z0-9_.\-]+\Z")]
"""msgspec searches for a pattern (``re.search``): ``\\A...\\Z`` anchors the whole string, where
``^...$`` would let a trailing newline through."""
ParamName = Annotated[str, Meta(min_length=1, max_length=512)]
Token = Annotated[str, Meta(min_length=1, max_length=4096)]
SessionId = Annotated[bytes, Meta(min_length=16, max_length=16)]
Nonce = Annotated[bytes, Meta(min_length=32, max_length=32)]
"""The server's half of a handshake, from a ``challenge`` reply."""
ClientNonce = Annotated[bytes, Meta(min_length=16, max_length=64)]
"""The client's half of a handshake, chosen at random by the client."""
Proof = Annotated[bytes, Meta(min_length=32, max_length=32)]
Mac = Annotated[bytes, Meta(max_length=32)]
"""HMAC-SHA256 of a signed request; empty only while it is being computed (the server refuses an
unsigned request with ``auth_failed``)."""
Seq = Annotated[int, Meta(ge=0, le=2**63 - 1)]
"""Per-session message counter of a signed request (> 0 on the wire; 0 only before signing)."""
FrameCount = Annotated[int, Meta(ge=0, le=1 << 16)]
MAX_REQUEST_ID = 2**63 - 1
RequestId = Annotated[int, Meta(ge=0, le=MAX_REQUEST_ID)]
Step = Annotated[int, Meta(ge=0, le=MAX_STEP)]
StageIndex = Annotated[int, Meta(ge=0, lt=MAX_STAGES)]
Numel = Annotated[int, Meta(ge=0, le=MAX_NUMEL)]
Dim = Annotated[int, Meta(ge=0, le=MAX_NUMEL)]
SlotIndex = Annotated[int, Meta(ge=0, lt=MAX_STAGES)]  # a step ring has a slot per stage (Join.step_ring)
Dtype = Literal["float32", "bfloat16", "float16"]

DTYPE_ITEMSIZE: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
BufferDtype = Literal["", "float32", "bfloat16", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"]
"""A ``ParamSpec.buffer``: "" for a parameter, else the dtype of the module's buffer."""


# ---- layout and optimizer records (also part of the public client API) -----------------------
class ParamSpec(Struct, frozen=True, array_like=True):
    """One parameter of a stage: a view ``flat[offset : offset + numel(shape)].view(shape)``.

    ``group``, ``frozen`` and ``buffer`` are trailing fields with defaults, so ``[name, shape,
    offset]`` (a manifest written before they existed) still decodes; they are always encoded."""

    name: ParamName
    shape: Annotated[tuple[Dim, ...], Meta(max_length=MAX_DIMS)]
    offset: Numel
    group: Annotated[int, Meta(ge=0, le=MAX_PARAM_GROUPS)] = 0
    """The optimizer settings it is updated with: 0 the job's optimizer as given, k >= 1
    ``JobOptions.param_groups[k - 1]``'s overrides of it."""
    frozen: bool = False
    """Not trained: no gradient is pushed for it and it has no optimizer state, but it is a weight
    like any other (published, snapshotted, pulled, exported). Its stage's gradient leaves it out
    (``wstream.protocol.layout.grad_layout``)."""
    buffer: BufferDtype = ""
    """Not a parameter but a module's (persistent) buffer, such as BatchNorm's running statistics,
    of this dtype (protocol 6). It is stored and streamed with the stage like a frozen parameter
    (``frozen`` is true) and its value is in the fp32 master (an integer buffer exactly, below
    2**24); a worker's real forward may update it, and the push carries its new value after the
    gradient (``wstream.protocol.layout.push_layout``), applied at the step's commit."""


class StageSpec(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The flat-buffer layout of one stage (see ``wstream.protocol.layout``)."""

    name: ParamName
    numel: Numel
    params: Annotated[list[ParamSpec], Meta(max_length=MAX_PARAMS_PER_STAGE)]


def _check_finite(name: str, value: float, *, low: float, high: float = math.inf) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{name} must be a finite number in [{low}, {high}], got {value}")


def _check_clip(value: float | None) -> None:
    # A norm of 0 would zero every gradient, and nan or inf would clip nothing or poison all.
    real = isinstance(value, (int, float)) and not isinstance(value, bool)
    if value is not None and not (real and math.isfinite(value) and value > 0):  # type: ignore[arg-type]
        raise ValueError(f"clip_grad_norm must be a finite number > 0 (or None), got {value!r}")


class AdamW(Struct, frozen=True, kw_only=True, tag="adamw", tag_field="kind", forbid_unknown_fields=True):
    """AdamW as ``torch.optim.AdamW`` defines it (decoupled weight decay); run fused on the server."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    schedule: Schedule = Constant()
    """Evaluated by the server each step: the lr of (0-based) step t is ``lr * schedule.factor(t)``
    (``wstream.protocol.lr_schedules``). The default keeps ``lr`` throughout."""
    clip_grad_norm: float | None = None
    """Clip the global gradient norm of every step to this, exactly as
    ``torch.nn.utils.clip_grad_norm_`` over all of the job's parameters, of the gradient the
    optimizer sees (the mean of the workers'); None: no clipping."""

    def __post_init__(self) -> None:
        _check_finite("lr", self.lr, low=0.0)
        _check_finite("betas[0]", self.betas[0], low=0.0, high=0.999999)
        _check_finite("betas[1]", self.betas[1], low=0.0, high=0.999999999)
        _check_finite("eps", self.eps, low=0.0)
        _check_finite("weight_decay", self.weight_decay, low=0.0)
        _check_clip(self.clip_grad_norm)


class SGD(Struct, frozen=True, kw_only=True, tag="sgd", tag_field="kind", forbid_unknown_fields=True):
    """SGD with optional (Nesterov) momentum, as ``torch.optim.SGD`` defines it."""

    lr: float = 1e-2
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    schedule: Schedule = Constant()
    """Evaluated by the server each step: the lr of (0-based) step t is ``lr * schedule.factor(t)``
    (``wstream.protocol.lr_schedules``). The default keeps ``lr`` throughout."""
    clip_grad_norm: float | None = None
    """Clip the global gradient norm of every step to this, exactly as
    ``torch.nn.utils.clip_grad_norm_`` over all of the job's parameters, of the gradient the
    optimizer sees (the mean of the workers'); None: no clipping."""

    def __post_init__(self) -> None:
        _check_finite("lr", self.lr, low=0.0)
        _check_finite("momentum", self.momentum, low=0.0, high=1.0)
        _check_finite("dampening", self.dampening, low=0.0, high=1.0)
        _check_finite("weight_decay", self.weight_decay, low=0.0)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("nesterov momentum needs momentum > 0 and dampening = 0")
        _check_clip(self.clip_grad_norm)


OptimizerSpec = Union[AdamW, SGD]


class GroupSpec(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A parameter group: settings that replace the optimizer's own for the parameters whose
    ``ParamSpec.group`` points at it (as a ``torch.optim`` param group does)."""

    name: Annotated[str, Meta(min_length=1, max_length=128)]
    """A label (unique in the job) for messages and for ``create_job(exist_ok=True)``."""
    weight_decay: float | None = None
    """The group's weight decay; None: the optimizer's."""
    lr_scale: float = 1.0
    """The group's learning rate is the optimizer's (or a step's) times this."""

    def __post_init__(self) -> None:
        if not 1 <= len(self.name) <= 128:
            raise ValueError(f"a parameter group's name must have 1 to 128 characters, got {self.name!r}")
        where = f"parameter group {self.name!r}: "
        if self.weight_decay is not None:
            _check_finite(where + "weight_decay", self.weight_decay, low=0.0)
        _check_finite(where + "lr_scale", self.lr_scale, low=0.0)


Units = Annotated[list[Annotated[int, Meta(ge=1, le=MAX_CHAIN_STAGES)]], Meta(max_length=MAX_UNITS)]
"""A ``units`` list (``JobOptions.units``, ``Seal.units``): chain stages per server stage."""


class JobOptions(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a job trains, fixed when it is created. Declared here once: ``create_job`` sends it,
    ``attached`` returns it, a snapshot's manifest stores it, and the ``Job`` objects of the
    server and of the client hold it (protocol 3; before, each listed these fields again)."""

    optimizer: OptimizerSpec = AdamW()
    """The update the server runs on each stage's fp32 master weights."""
    dtype: Dtype = "float32"
    """The compute dtype: workers receive the weights in it and run forward and backward in it."""
    double_buffer: bool = False
    """Two published slots per stage even where one would do (fp32, synchronous): a fetch of the
    next step never waits for the update of the last."""
    delayed_update: bool = False
    """One-step delayed parameter update: step t reads the weights of step t - 1, so the update of
    step t - 1 runs while step t computes (implies two published slots)."""
    delay_after: Step = 0
    """With ``delayed_update``: steps before this one are synchronous (a warm-up)."""
    frozen: bool = False
    """A frozen base: weights only (no optimizer state, no workers), read by the jobs created on
    top of it with ``base``; counted once in the memory account however many use it."""
    base: JobName | None = None
    """Train on top of this frozen job: stage i of the new job holds only its trainable
    parameters, and its workers read stage i of the base for the rest."""
    param_groups: Annotated[list[GroupSpec], Meta(max_length=MAX_PARAM_GROUPS)] = []
    """Parameter groups: a parameter whose ``ParamSpec.group`` is k >= 1 is updated with
    ``param_groups[k - 1]``'s weight decay and learning-rate scale."""
    units: Units | None = None
    """Coalesced stages (protocol 7): the server's stage j holds ``units[j]`` consecutive stages of
    the creator's chain, their parameters named ``"<chain stage>.<name>"`` (NOTE [Transfer units] in
    ``client/units.py``). None: one server stage per chain stage. Only the clients read it; the
    server checks at ``seal`` that it has one entry per stage. A creator gives it in ``seal``."""

    def __post_init__(self) -> None:
        if self.delay_after and not self.delayed_update:
            raise ValueError(f"delay_after={self.delay_after} means nothing without delayed_update=True")
        check_units(self.units)
        if len(self.param_groups) > MAX_PARAM_GROUPS:
            raise ValueError(f"{len(self.param_groups)} parameter groups, more than the limit of {MAX_PARAM_GROUPS}")
        seen: set[str] = set()
        for g in self.param_groups:
            if g.name in seen:
                raise ValueError(f"parameter group names must be unique; {g.name!r} appears more than once")
            seen.add(g.name)


def check_units(units: list[int] | None) -> None:
    """A ``units`` list adds up to at most MAX_CHAIN_STAGES chain stages (replies carry the sum)."""
    if units is not None and sum(units) > MAX_CHAIN_STAGES:
        raise ValueError(f"units add up to {sum(units)} chain stages, more than the limit of {MAX_CHAIN_STAGES}")


# ---- messages ----------------------------------------------------------------------------------
class Message(Struct, frozen=True, kw_only=True, tag_field="op", forbid_unknown_fields=True):
    """Header fields common to every message. ``frames`` = (min, max) data frames after it."""

    v: int = PROTOCOL_VERSION
    id: RequestId = 0
    frames: ClassVar[tuple[int, int]] = (0, 0)


class SessionMessage(Message, kw_only=True):
    """A request made in a session: signed with the session's key (NOTE [Signed requests] in
    ``protocol/auth.py``). ``seq`` is unique per session across all of its sockets."""

    session: SessionId
    seq: Seq = 0
    mac: Mac = b""


# -- requests (client -> server)
class Hello(Message, tag="hello"):
    """Ask for a fresh single-use nonce (answered with ``challenge``) to attach or create with."""


class CreateJob(Message, tag="create_job"):
    """Open a new job; its stages follow one by one (``add_stage``) and ``seal`` ends creation.

    The token travels in clear here, once (the server must learn the job's secret); ``nonce`` (from
    a ``challenge``) and ``client_nonce`` derive the returned session's key as ``attach`` does.
    ``total_numel``, when the creator knows it, lets the server refuse a job that cannot fit before
    any weights travel, and hold its size from then on; ``trained_numel`` (protocol 11), the part of
    it that gets gradients (parameters that require them, and buffers), which alone has optimizer
    state and an accumulator: without it every element is counted as trained."""

    name: JobName
    token: Token
    nonce: Nonce
    client_nonce: ClientNonce
    options: JobOptions
    total_numel: Numel | None = None
    trained_numel: Numel | None = None
    base_proof: Proof | None = None
    """With ``options.base``: :func:`wstream.protocol.auth.base_proof` with the base's token."""
    admin_proof: Proof | None = None
    """On a server with an admin secret (required there): :func:`wstream.protocol.auth.create_proof`
    with the admin secret, over ``name`` and the two nonces. Ignored by a server without one."""


class AddStage(SessionMessage, tag="add_stage"):
    """Append one stage: its layout, and its fp32 weights as the data frames (``nframes`` of them,
    a count the signature covers)."""

    frames: ClassVar[tuple[int, int]] = (1, MAX_DATA_FRAMES)
    index: StageIndex
    spec: StageSpec
    nframes: FrameCount = 0


class Seal(SessionMessage, tag="seal"):
    """End creation: the job becomes ready for workers. Replied with ``attached``."""

    units: Units | None = None
    """Protocol 7: the job's ``JobOptions.units``, known only once the chain is cut (a creator that
    streams its stages from a generator learns it at the end); it replaces the options' field."""


class Attach(Message, tag="attach"):
    """Prove knowledge of the job's token without sending it: ``proof`` is
    :func:`wstream.protocol.auth.attach_proof` over a ``challenge`` nonce and ``client_nonce``."""

    name: JobName
    nonce: Nonce
    client_nonce: ClientNonce
    proof: Proof


class AdminAttach(Message, tag="admin_attach"):
    """As ``attach``, with the server's admin secret (:func:`wstream.protocol.auth.admin_proof`)."""

    nonce: Nonce
    client_nonce: ClientNonce
    proof: Proof


class Join(SessionMessage, tag="join"):
    """Become a data-parallel worker. No update runs until ``world_size`` workers have joined (a
    start barrier, as a fixed world size in DDP); after that the live workers make each step."""

    shm: bool
    grad_slots: Annotated[int, Meta(ge=1, le=MAX_GRAD_SLOTS)] = 2
    world_size: Annotated[int, Meta(ge=1, le=65_536)] = 1
    reader: bool = False
    """A worker that fetches weights but never pushes: a rank whose gradients reach the server
    through another rank (reduced over torch.distributed first). It has no gradient ring, no step
    waits for it and it does not count towards ``world_size``."""
    step_ring: bool = False
    """Ask for a *step ring*: one slot per stage, each of that stage's push size, so that every
    push of a step can be held in place until its update (NOTE [Held gradient slots] in
    server/step_commit.py, rule 5). Granted to a lone shared-memory worker (``world_size`` 1, no
    other worker pushing) when the memory limit has room for it; otherwise
    the worker gets ``grad_slots`` slots as usual (``Joined`` says which). Protocol 8."""


class Fetch(SessionMessage, tag="fetch"):
    stage: StageIndex
    step: Step


class Push(SessionMessage, tag="push"):
    frames: ClassVar[tuple[int, int]] = (0, MAX_DATA_FRAMES)
    stage: StageIndex
    step: Step
    slot: SlotIndex
    numel: Numel
    dtype: Dtype = "float32"
    nframes: FrameCount = 0
    sumsq: float | None = None
    """The squared L2 norm of the slot's gradient part (its first ``grad_layout(stage).numel``
    elements, buffers left out), as the worker measured it: ``squared_norm`` of those fp32
    elements (``wstream.protocol.grad_norm``: fp32 dots of pieces summed in float64), or nan/inf
    when the gradient is not finite. When this worker is the only one the step waits for, the server takes this
    float as the stage's share of the global norm instead of reading the gradient again (protocol
    7; None: the server measures it); the server may then read the gradient from the slot in place
    until the stage's update (NOTE [Held gradient slots] in server/step_commit.py) and answer ``pushed``
    only then."""


class Commit(SessionMessage, tag="commit"):
    """This worker has pushed every gradient of ``step``: answer with ``committed`` once the step
    commits (every expected worker's gradient of every trained stage is in, the global gradient
    norm is known and the updates are queued), or with an error when the step is discarded (a
    worker that had pushed part of it left: see NOTE [The step commit point] in server/step_commit.py).
    Sent on the same socket as the pushes, after them."""

    step: Step


class Pull(SessionMessage, tag="pull"):
    """A stage's fp32 master weights: of the session's job, or with an admin session of ``job``."""

    stage: StageIndex
    job: JobName | None = None


class AwaitStep(SessionMessage, tag="await_step"):
    """Answer with ``step_reached`` once every stage of the job (the session's own, or with an
    admin session ``job``) holds the weights after ``step`` steps: each is at version ``step`` or
    beyond, so the updates of every step before it are applied (NOTE [Versions and who may read
    what] in server/versions.py). At once when the job is there already; ``stale_step`` for a step
    more than one past the step the job gathers (so a wait ends within two steps); an error when
    a stage's update fails or the job is dropped. Moves no weights: how a caller knows the updates of the
    steps it trained are done (before an export, an evaluation, the end of a timed block)."""

    step: Step
    job: JobName | None = None


class Describe(SessionMessage, tag="describe"):
    """The stage layouts of a job (``job`` with an admin session; else the session's own), to name
    the tensors ``pull`` returns. Answered with ``layout``."""

    job: JobName | None = None


class Heartbeat(SessionMessage, tag="heartbeat"):
    pass


class Leave(SessionMessage, tag="leave"):
    pass


class DropJob(SessionMessage, tag="drop_job"):
    """Delete a job: ``job`` with an admin session (any job), or the session's own job (see the
    admin rule in ``protocol/README.md``)."""

    job: JobName | None = None


class Status(Message, tag="status"):
    """The server's status; ``job``: only that job's line (an unknown name gives no line)."""

    job: JobName | None = None


class Save(SessionMessage, tag="save"):
    """Write a snapshot of a job at its next consistent step (at once when it is idle); answered
    with ``saved`` once the snapshot is durable on disk. ``job`` as for ``drop_job``."""

    job: JobName | None = None


class SetSchedule(SessionMessage, tag="set_schedule"):
    """Change a live job's base learning rate and/or its schedule, from its next commit on (``job``
    as for ``drop_job``: an admin session names any job). Answered with ``ok``; the job's options
    (``attached``, snapshots) hold the new values from then on."""

    job: JobName | None = None
    lr: float | None = None
    schedule: Schedule | None = None

    def __post_init__(self) -> None:
        if self.lr is not None:
            _check_finite("lr", self.lr, low=0.0)


class Shutdown(SessionMessage, tag="shutdown"):
    """Stop the server cleanly, as SIGTERM does (admin sessions only); answered with ``ok`` first."""


class Timeline(SessionMessage, tag="timeline"):
    """The server's side of the session's job's timeline: events that ended at or after
    ``since_ns`` (the server's monotonic clock; 0: all it keeps). Answered with ``timeline_reply``."""

    since_ns: Annotated[int, Meta(ge=0)] = 0


Request = Union[
    Hello, CreateJob, AddStage, Seal, Attach, AdminAttach, Join, Fetch, Push, Commit, Pull, Heartbeat, Leave, DropJob,
    Status, Save, SetSchedule, Shutdown, Timeline, Describe, AwaitStep,
]
_REQUESTS: tuple[type[Message], ...] = Request.__args__  # type: ignore[attr-defined]


# -- replies (server -> client)
class Challenge(Message, tag="challenge"):
    """A fresh nonce for one ``attach``, ``admin_attach`` or ``create_job``; it expires after the
    server's nonce lifetime (30 s by default)."""

    nonce: Nonce


class AdminAttached(Message, tag="admin_attached"):
    session: SessionId


class Attached(Message, tag="attached"):
    session: SessionId
    job: JobName
    stages: list[StageSpec]
    options: JobOptions
    step: Step
    ready: bool
    published_path: str
    published_bytes: int
    slot_offsets: list[tuple[int, int]]
    """Byte offsets in the published segment of each stage's two slots (equal when single)."""
    published_dtype: Dtype
    lease_s: float
    base_stages: list[StageSpec] = []
    """The base's stage layouts (the parameters a stage may read from the base)."""
    base_path: str = ""
    """The base's published segment; stage i's base weights are at ``base_offsets[i]``."""
    base_bytes: int = 0
    base_offsets: list[int] = []
    compute_threads: int = 0
    """torch threads the server's updates run on (0: not said). A worker on the server's host keeps
    its own to the cores left (NOTE [Threads of a co-located server] in server/threads.py)."""
    server_pid: int = 0
    """The server's process id: a worker in the same process (an in-process server) shares its
    thread pool and changes nothing."""
    incarnation: Annotated[bytes, Meta(max_length=64)] = b""
    """Protocol 9: the job's identity, made at its creation and kept across server restarts: a
    job dropped and created again under its name has another, and a worker of the old one that
    reconnects is refused instead of training the new one."""


class Joined(Message, tag="joined"):
    """The worker's id, the step it trains first, and its gradient ring: ``grad_slots`` slots of
    ``grad_slot_bytes`` each in the segment ``grad_path`` (shared-memory workers), or, for a step
    ring (``Join.step_ring`` granted), slot k (for stage k, pushed only there) of stage k's push
    size at byte ``grad_slot_offsets[k]`` of a segment of ``grad_ring_bytes``."""

    worker: int
    step: Step
    grad_path: str
    grad_slot_bytes: int
    grad_slots: int
    grad_slot_offsets: list[int] = []
    grad_ring_bytes: int = 0


class Weights(Message, tag="weights"):
    """Stage weights for ``step`` are at ``offset`` in the published segment (or in the frames)."""

    frames: ClassVar[tuple[int, int]] = (0, MAX_DATA_FRAMES)
    stage: StageIndex
    step: Step
    offset: int
    base_offset: int | None = None
    """For a job with a base: where the base's stage is in the base's segment (frames workers get
    its bytes as the frames after the stage's own)."""


class Pushed(Message, tag="pushed"):
    """The gradient is taken and ``slot`` is free again: added into the stage's accumulator for
    the step (the update itself waits for the step's commit: see ``commit``), or, for a slot the
    server held (NOTE [Held gradient slots] in server/step_commit.py), read by the stage's update, which
    is done."""

    stage: StageIndex
    step: Step
    slot: SlotIndex


class Committed(Message, tag="committed"):
    """Step ``step`` committed: its updates are queued (fetches of ``step + 1`` wait for them).
    ``grad_norm``: the global L2 norm of the step's gradient (the mean over workers, before
    clipping; ``inf``/``nan`` when not finite); ``lr``: the base learning rate the step's update
    uses; ``skipped``: the norm was not finite, so no stage was updated (weights and optimizer
    state unchanged, as a loss scaler skips a step); ``clip``: the factor every gradient was
    multiplied by (1.0 when not clipped)."""

    step: Step
    grad_norm: float
    lr: float
    skipped: bool = False
    clip: float = 1.0


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
    """The stages of the chain the job was made from (``Job.num_stages`` on a client), whether the
    server holds them one each or cut into transfer units (``units``). While the job is created
    (not ``ready``): the server stages uploaded so far (how many chain stages units hold is told by
    the seal)."""
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
    steps_per_s: float = 0.0
    """Steps completed per second over the last 30 s (0 before training starts; added in version 2,
    absent from older servers' replies)."""
    frozen: bool = False
    base: str | None = None
    grad_norm: float | None = None
    """The global gradient norm (before clipping) of the newest committed step (version 4)."""
    lr: float | None = None
    """The base learning rate of the newest committed step's update (version 4)."""
    skipped_steps: int = 0
    """Steps committed without an update because their gradient norm was not finite."""
    discarded_steps: int = 0
    """Step attempts thrown away because a worker that had pushed part of them left."""
    waiting: str | None = None
    """What the job's open step waits for on its workers, in words ("waiting for 1 of 2 workers to
    join ..." or "step 7: waiting for the gradients of worker 3 ..."); None when nothing waits on a
    worker. Workers quote it when a wait of theirs lasts."""
    units: int | None = None
    """How many server stages (transfer units, ``JobOptions.units``) hold the ``stages``; None: one
    server stage per stage, or a job not sealed yet whose creator gave no units in its options (the
    client gives them at the seal), or a server from before this field, whose ``stages`` counted
    server stages. Per-stage metrics and the stage numbers of fetches, pushes and timelines count these."""


class Layout(Message, tag="layout"):
    """``stages``: the job's server stages; ``units``: its ``JobOptions.units`` (how many chain
    stages each server stage holds; None: one each), so that an export names chain stages; and
    its parameter groups."""

    job: JobName
    stages: list[StageSpec]
    step: Step
    units: list[int] | None = None
    param_groups: Annotated[list[GroupSpec], Meta(max_length=MAX_PARAM_GROUPS)] = []
    """The job's ``JobOptions.param_groups`` (since protocol 10), so that an export made with the
    admin secret records them as one made with the job's token does."""


class TraceEvent(Struct, frozen=True, kw_only=True, array_like=True):
    """One span of server work for a job: ``name`` on ``lane`` (a thread, or a kind of wait), from
    ``start_ns`` (server monotonic clock) for ``dur_ns``."""

    name: str
    cat: str
    lane: str
    start_ns: int
    dur_ns: int
    stage: int
    step: int


class TimelineReply(Message, tag="timeline_reply"):
    """``now_ns``: the server's monotonic clock when it answered (to align the two clocks);
    ``events``: the newest ``MAX_TRACE_EVENTS`` at most, oldest first; ``dropped``: older ones the
    server no longer kept."""

    now_ns: int
    events: list[TraceEvent]
    dropped: int = 0


class StatusReply(Message, tag="status_reply"):
    protocol: int
    pid: int
    uptime_s: float
    memory_limit: int
    memory_used: int
    jobs: list[JobInfo]


class StepReached(Message, tag="step_reached"):
    """Every stage of the job holds the weights after ``step`` steps (the job's step when
    answered: the one ``await_step`` asked for, or later)."""

    step: Step


class Error(Message, tag="error"):
    code: str
    message: str


Reply = Union[
    Challenge, Attached, AdminAttached, Joined, Weights, Pushed, Committed, Master, Ok, Saved, StatusReply, TimelineReply, Layout,
    StepReached, Error,
]
_REPLIES: tuple[type[Message], ...] = Reply.__args__  # type: ignore[attr-defined]


def op_of(cls: type[Message]) -> str:
    """The ``op`` string of a message class."""
    tag = cls.__struct_config__.tag
    assert isinstance(tag, str)
    return tag


REQUEST_TYPES: dict[str, type[Message]] = {op_of(c): c for c in _REQUESTS}
REPLY_TYPES: dict[str, type[Message]] = {op_of(c): c for c in _REPLIES}

