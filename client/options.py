"""A trainer's options, declared once: small frozen dataclasses with a docstring under every field.

``Job.trainer(device, checkpointing=Checkpointing(...), transport=Transport(...), ...)`` takes them;
the flat keywords it has always taken (``job.trainer(schedule="dnc", prefetch=1)``) still work:
:func:`trainer_options` maps each onto the one field of the same name, by a table derived from
``dataclasses.fields`` (so an option is declared, and documented, only here). Giving a group
both as a dataclass and by a flat keyword is an error naming both.

Why four groups: ``Checkpointing`` is what a step keeps and recomputes (its ``preserve_rng`` is
there because it is what makes a recomputation replay the forward's random numbers, as in
``torch.utils.checkpoint``); ``Transport`` is how weights and gradients move; ``Precision`` how
gradients are scaled; ``Parallelism`` how data-parallel ranks combine their gradients.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from wstream.protocol import parse_size
from wstream.protocol.messages import MAX_GRAD_SLOTS

from .loss_scale import LossScale
from .plans import Plan, StageCosts
from .plans.registry import check as check_schedule
from .plans.registry import resolve as resolve_schedule


def _check_type(group: str, name: str, value: Any, kinds: tuple[type, ...], *, optional: bool = False) -> None:
    """``value`` is one of ``kinds`` (None too when ``optional``); a bool is not taken for a number
    (``shm="no"`` turned shared memory on, ``prefetch=1.5`` failed deep in a thread)."""
    if value is None and optional:
        return
    numeric = bool not in kinds and isinstance(value, bool)
    if numeric or not isinstance(value, kinds):
        want = " or ".join(k.__name__ for k in kinds) + (" or None" if optional else "")
        raise TypeError(f"{group}.{name} must be {want}, got {value!r}")


def _check_real(group: str, name: str, value: Any, *, low: float) -> None:
    _check_type(group, name, value, (int, float))
    if not math.isfinite(value) or value < low:
        raise ValueError(f"{group}.{name} must be a finite number >= {low:g}, got {value!r}")


@dataclass(kw_only=True, slots=True, frozen=True)
class Checkpointing:
    """Which stage inputs a step keeps, and what it recomputes (the checkpoint plan)."""

    schedule: str = "store_all"
    """The checkpoint plan: ``"store_all"`` (keep every stage input), ``"sqrt"``,
    ``"sqrt_recursive"``, ``"dnc"`` (bisection) or ``"revolve"`` (binomial, with ``slots`` kept
    stage inputs), or ``"optimal"`` with ``memory_budget``: the least recomputation time within
    that much activation memory, planned from a profile of the first batch (and again for a batch larger in any dimension,
    or another number of micro-batches); ``"auto"`` with
    ``memory_budget``: the fastest of all planners' plans that fits, by the same profile
    (``plan_summary()["schedule"]`` says which); or ``"min_peak"``: the kept subset of least peak
    memory; or ``"offload"`` with ``memory_budget``: every k-th stage input goes to host memory as
    fast as the copy keeps up (k from the profile), Revolve within segments. Gradients are the
    same for every plan."""
    slots: int | None = None
    """Stage inputs ``"revolve"`` keeps (None: ceil(log2 n)); only for that schedule."""
    memory_budget: int | str | None = None
    """Activation memory (bytes or "64MiB") of ``"optimal"``, ``"auto"`` and ``"offload"``, which
    need it; stored as bytes. Separate from ``Transport.weight_budget``."""
    preserve_rng: bool = True
    """A recomputation replays the random numbers of the stage's first run (same dropout masks),
    and the RNG ends where plain training leaves it."""
    early_stop: bool | None = None
    """Keep a stage's graph from its last forward before its backward, where the plan holds that
    forward's input and output anyway, so that the backward's recomputation stops before the
    stage's last operation, as ``torch.utils.checkpoint`` does (NOTE [Taped forwards and early
    stop] in ``wstream.client.plans.taping``). None: for stages of at least 4 Mi parameter
    elements (``client/taped.py``: it costs ~0.1 ms of Python per stage, and saves the last
    operation's time); True: every stage the plan allows; False: never."""

    def __post_init__(self) -> None:
        _check_type("Checkpointing", "schedule", self.schedule, (str,))
        _check_type("Checkpointing", "slots", self.slots, (int,), optional=True)
        _check_type("Checkpointing", "preserve_rng", self.preserve_rng, (bool,))
        _check_type("Checkpointing", "early_stop", self.early_stop, (bool,), optional=True)
        if self.memory_budget is not None:
            object.__setattr__(self, "memory_budget", parse_size(self.memory_budget))
        check_schedule(self.schedule, slots=self.slots, budget_bytes=self.memory_budget)  # type: ignore[arg-type]

    def planner(self, n: int) -> tuple[Plan | None, Callable[[StageCosts], Plan] | None]:
        """The plan for a chain of ``n`` positions, or (a profiled schedule) the function that
        makes it from the first step's profile: exactly one of the two is not None."""
        return resolve_schedule(self.schedule, n, slots=self.slots, budget_bytes=self.memory_budget)  # type: ignore[arg-type]


@dataclass(kw_only=True, slots=True, frozen=True)
class Transport:
    """How weights reach the worker and gradients leave it."""

    prefetch: int | None = None
    """Stages fetched ahead of compute: at most ``prefetch + 1`` stages' weights are held at once
    (None: 2, or what ``weight_budget`` allows)."""
    weight_budget: int | str | None = None
    """Instead of ``prefetch``: device memory (bytes or "8GiB") for the weight ring, which holds
    floor(budget / largest stage) stages (at least 2, at most one per stage) and never more; it is
    separate from ``Checkpointing.memory_budget`` (activations); DESIGN.md "GPU data path" says
    why. Stored as bytes."""
    shm: bool | None = None
    """Map the server's shared memory (None: when it can be mapped, else receive weights as data
    frames)."""
    zero_copy: bool | None = None
    """A CPU worker on shared memory computes directly on read-only views of the server's published
    weights instead of copying each stage into its ring (None: whenever possible). Safe because a
    stage is updated only after every worker has pushed its gradient, i.e. after its last use of
    those weights (DESIGN.md)."""
    grad_slots: int = 2
    """Gradients in flight to the server (the ring's slots, each the size of the largest stage)."""
    step_ring: bool | None = None
    """Ask for a slot per stage instead (``Join.step_ring``): every gradient of a step is then read
    in place by its update, none copied on the server (NOTE [Held gradient slots] rule 5 in
    server/step_commit.py), for shared memory the size of the model's gradient. The server grants
    it to a lone worker (``world_size`` 1, no other worker pushing) when
    its memory limit has room, else gives ``grad_slots`` slots. None: ask on a CPU worker on the
    server's host; a GPU worker would page-lock the whole ring, so there it waits for its figure
    (BENCHMARKS.md, "GPU") and is asked for with True."""
    reconnect_s: float = 300.0
    """When the server restarts (from its snapshots) or detaches this worker, the trainer attaches
    and joins again, retrying with backoff for this long (0: raise at once)."""
    cpu_threads: int | None = None
    """torch threads of this process while it is a worker on the server's host. None: at most the
    cores the server leaves (its threads are in the ``attached`` reply), so the two do not spin
    against each other (NOTE [Threads of a co-located server] in server/threads.py); a worker on
    another host is left alone."""

    def __post_init__(self) -> None:
        for name in ("prefetch", "cpu_threads"):
            _check_type("Transport", name, getattr(self, name), (int,), optional=True)
        for name in ("shm", "zero_copy", "step_ring"):
            _check_type("Transport", name, getattr(self, name), (bool,), optional=True)
        _check_type("Transport", "grad_slots", self.grad_slots, (int,))
        if not 1 <= self.grad_slots <= MAX_GRAD_SLOTS:
            raise ValueError(f"Transport.grad_slots must be 1..{MAX_GRAD_SLOTS}, got {self.grad_slots}")
        _check_real("Transport", "reconnect_s", self.reconnect_s, low=0.0)
        if self.prefetch is not None and self.weight_budget is not None:
            raise ValueError("give prefetch= or weight_budget= (the ring's depth follows from the budget), not both")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.prefetch is not None and self.prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {self.prefetch}")
        if self.weight_budget is not None:
            object.__setattr__(self, "weight_budget", parse_size(self.weight_budget))

    @property
    def depth(self) -> int:
        """``prefetch``, or its default 2 (a ``weight_budget`` sizes the ring instead)."""
        return 2 if self.prefetch is None else self.prefetch


@dataclass(kw_only=True, slots=True, frozen=True)
class Precision:
    """How gradients are kept in range (the compute dtype is the job's ``dtype``)."""

    loss_scale: LossScale | bool | None = None
    """Dynamic loss scaling of the gradients (NOTE [Per-stage loss scaling] in
    ``wstream.client.loss_scale``): None scales a float16 job with ``LossScale()`` and no other;
    ``True``/a ``LossScale(...)`` scales any job; ``False`` never. Unlike GradScaler no step is
    skipped: a stage whose gradient overflows runs again at a lower scale."""

    def __post_init__(self) -> None:
        _check_type("Precision", "loss_scale", self.loss_scale, (LossScale, bool), optional=True)


@dataclass(kw_only=True, slots=True, frozen=True)
class Parallelism:
    """How data-parallel workers combine their gradients."""

    world_size: int = 1
    """Data-parallel workers to wait for before the first update (every worker of the job passes
    the same number); later, each step is the mean over the live workers."""
    reduce: str = "server"
    """``"server"`` (each worker pushes, the server averages over ``world_size`` workers) or
    ``"allreduce"`` (ranks of an initialized ``torch.distributed`` group average each stage's
    gradient among themselves and rank 0 alone pushes; leave ``world_size=1``). See
    ``wstream.client.distributed``."""

    def __post_init__(self) -> None:
        _check_type("Parallelism", "world_size", self.world_size, (int,))
        if self.world_size < 1:
            raise ValueError(f"Parallelism.world_size must be >= 1, got {self.world_size}")
        if self.reduce not in ("server", "allreduce"):
            raise ValueError(f"reduce must be 'server' or 'allreduce', got {self.reduce!r}")
        if self.reduce == "allreduce" and self.world_size != 1:
            raise ValueError(
                "with reduce='allreduce' the ranks reduce among themselves and rank 0 alone pushes: leave "
                f"world_size at 1 (the server sees one worker), got {self.world_size}"
            )


@dataclass(slots=True, frozen=True)
class TrainerOptions:
    """Every group of a trainer's options."""

    checkpointing: Checkpointing
    transport: Transport
    precision: Precision
    parallelism: Parallelism


GROUPS: dict[str, type] = {
    "checkpointing": Checkpointing,
    "transport": Transport,
    "precision": Precision,
    "parallelism": Parallelism,
}
"""Each group's keyword in ``Job.trainer``, and its dataclass."""

FLAT: dict[str, str] = {f.name: group for group, cls in GROUPS.items() for f in dataclasses.fields(cls)}
"""Each flat keyword ``Job.trainer`` takes -> the group whose field of that name it sets."""


def trainer_options(groups: dict[str, Any], flat: dict[str, Any]) -> TrainerOptions:
    """The options of ``Job.trainer(**groups, **flat)``: each group as given, or made from the flat
    keywords of its fields (the defaults for the rest)."""
    for name in flat:
        if name not in FLAT:
            raise TypeError(f"Job.trainer() got an unexpected keyword argument {name!r}")
    made: dict[str, Any] = {}
    for group, cls in GROUPS.items():
        given = groups.get(group)
        mine = {name: value for name, value in flat.items() if FLAT[name] == group}
        if given is not None and mine:
            raise ValueError(f"give {group}= or the keyword{'s' if len(mine) > 1 else ''} {', '.join(mine)}=, not both")
        if given is not None and not isinstance(given, cls):
            raise TypeError(f"{group}= takes a {cls.__name__}, got {type(given).__name__}")
        made[group] = given if given is not None else cls(**mine)
    return TrainerOptions(**made)
