"""Transfer units: runs of consecutive small stages stored, streamed, pushed and updated as one.

# NOTE [Transfer units]
# Every server stage costs a fixed amount per step whatever its size: a ``fetch`` and its reply, a
# ``push`` and its reply, a gather and an update task on the server's pool, and a wake of the
# worker's prefetch and push threads. For a GPT block that is noise; for a chain of thousands of
# 48-wide layers it is most of the step (BENCHMARKS.md, "Per-stage overhead"). So a job is created
# with ``unit_bytes`` (``"auto"``, 1 MiB, by default; None turns it off): consecutive chain stages
# are then stored on the server as one stage (a *unit*) of at least that many bytes in the compute
# dtype, and everything per server stage happens once per unit. The rules:
#   1. Units are cut greedily in chain order: a stage joins the open unit, which closes once it
#      holds ``unit_bytes``. A stage of ``unit_bytes`` or more, and a stage with buffers (whose
#      step-wise values the executor keeps per server stage: NOTE [Buffers] in executor.py), is a
#      unit of its own. A unit holds at most MAX_PARAMS_PER_STAGE entries.
#   2. A unit's layout is its stages' layouts back to back (each stage's is aligned, so the
#      offsets only shift), each parameter named ``"<chain stage>.<name>"``: exactly the keys of
#      ``Job.state_dict()``, which is therefore the same with or without units.
#   3. ``JobOptions.units`` stores how many chain stages each unit holds, so a worker that attaches
#      rebuilds the same cut from its own stages, whatever its defaults.
#   4. The checkpoint plans still run over the chain's positions (recomputation counts, memory);
#      only fetching changes: consecutive positions on one unit share one fetch, which the executor
#      keeps resident until a position on another unit needs the ring (``PlanExecutor.stage_weights``).
#      A unit's gradient is pushed once, after the backward of its lowest position, as a tied
#      stage's is (NOTE [Positions and weight stages] in stages.py).
#   5. The ``Job`` handle speaks chain stages (``specs``, ``num_stages``, ``pull_stage``,
#      ``positions``); the trainer and the server speak units.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from wstream.protocol import LayoutError, StageSpec
from wstream.protocol.layout import build_stage_spec
from wstream.protocol.messages import MAX_PARAMS_PER_STAGE


AUTO_UNIT_BYTES = 1 << 20
"""``create_job(unit_bytes="auto")``'s size (the default): stages under 1 MiB are coalesced."""


def unit_spec(first: int, specs: Sequence[StageSpec]) -> StageSpec:
    """The layout of a unit holding chain stages ``first, first + 1, ...`` laid out as ``specs``
    (rule 2): their parameters back to back, each named ``"<chain stage>.<name>"``."""
    params = [
        (f"{first + k}.{p.name}", p.shape, p.group, p.frozen, p.buffer) for k, spec in enumerate(specs) for p in spec.params
    ]
    unit = build_stage_spec(str(first), params)
    assert unit.numel == sum(s.numel for s in specs), "stage layouts do not concatenate: a bug in wstream"
    return unit


def split_unit(first: int, count: int, unit: StageSpec) -> list[StageSpec]:
    """The layouts of the ``count`` chain stages from ``first`` that ``unit`` holds (rule 2 undone)."""
    per_stage: list[list[tuple[object, ...]]] = [[] for _ in range(count)]
    for p in unit.params:
        stage, dot, name = p.name.partition(".")
        k = int(stage) - first if dot and stage.isdigit() else -1
        if not 0 <= k < count:
            raise LayoutError(f"unit {unit.name!r}: parameter {p.name!r} is not named '<stage>.<name>' for stages {first}..{first + count - 1}")
        per_stage[k].append((name, p.shape, p.group, p.frozen, p.buffer))
    return [build_stage_spec(str(first + k), params) for k, params in enumerate(per_stage)]


@dataclass(frozen=True, slots=True)
class Units:
    """Which unit (server stage) holds each chain stage. ``counts[j]``: the chain stages unit j
    holds (``JobOptions.units``)."""

    counts: tuple[int, ...]
    unit_of: tuple[int, ...] = field(init=False)
    first_of: tuple[int, ...] = field(init=False)  # per unit: its first chain stage

    def __post_init__(self) -> None:
        unit_of: list[int] = []
        first_of: list[int] = []
        for j, c in enumerate(self.counts):
            first_of.append(len(unit_of))
            unit_of.extend([j] * c)
        object.__setattr__(self, "unit_of", tuple(unit_of))
        object.__setattr__(self, "first_of", tuple(first_of))

    @property
    def stages(self) -> int:
        return len(self.unit_of)

    def chain_specs(self, unit_specs: Sequence[StageSpec]) -> list[StageSpec]:
        """Every chain stage's own layout, from the units' (``split_unit``)."""
        if len(unit_specs) != len(self.counts):
            raise LayoutError(f"{len(unit_specs)} server stages for a units list of {len(self.counts)}")
        out: list[StageSpec] = []
        for j, spec in enumerate(unit_specs):
            out.extend(split_unit(self.first_of[j], self.counts[j], spec))
        return out

    def unit_specs(self, chain_specs: Sequence[StageSpec]) -> list[StageSpec]:
        """The units' layouts from the chain stages' (``unit_spec``)."""
        if len(chain_specs) != self.stages:
            raise LayoutError(f"{len(chain_specs)} stages given; the job's units hold {self.stages}")
        return [unit_spec(f, chain_specs[f : f + c]) for f, c in zip(self.first_of, self.counts)]


def chain_layout(server_stages: Sequence[StageSpec], units: Sequence[int] | None) -> list[StageSpec]:
    """Each chain stage's layout from a job's server stages and its ``JobOptions.units``: the
    server's stages themselves without units, else each unit split (``Units.chain_specs``). Layouts
    are compared in these terms, so that a difference names the chain stage, not its unit."""
    return list(server_stages) if units is None else Units(tuple(units)).chain_specs(server_stages)


def describe_cut(units: Sequence[int] | None) -> str:
    """How a job's chain is stored on the server, in words."""
    return "one server stage per stage" if units is None else f"transfer units of {list(units)} stages"


@dataclass(slots=True)
class _Open:
    first: int
    specs: list[StageSpec] = field(default_factory=list)
    flats: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0
    nparams: int = 0


class UnitCutter:
    """Cuts a chain into units while its stages stream in (rule 1): ``add`` each stage's layout
    and flat fp32 weights in chain order; every unit that closes is returned as (its first chain
    stage, its layout, its flat weights), ready to upload; ``finish`` closes the last."""

    def __init__(self, unit_bytes: int, itemsize: int) -> None:
        if unit_bytes < 1:
            raise ValueError(f"unit_bytes must be >= 1, got {unit_bytes}")
        self.unit_bytes = unit_bytes
        self.itemsize = itemsize
        self.counts: list[int] = []
        self._open: _Open | None = None
        self._next = 0

    def add(self, spec: StageSpec, flat: torch.Tensor | None, *, has_buffers: bool) -> list[tuple[int, StageSpec, torch.Tensor | None]]:
        index = self._next
        self._next += 1
        nbytes = spec.numel * self.itemsize
        closed: list[tuple[int, StageSpec, torch.Tensor | None]] = []
        alone = has_buffers or nbytes >= self.unit_bytes
        o = self._open
        if o is not None and (alone or o.nparams + len(spec.params) > MAX_PARAMS_PER_STAGE):
            closed.append(self._close())
        if self._open is None:
            self._open = _Open(index)
        o = self._open
        o.specs.append(spec)
        if flat is not None:
            o.flats.append(flat)
        o.nbytes += nbytes
        o.nparams += len(spec.params)
        if alone or o.nbytes >= self.unit_bytes:
            closed.append(self._close())
        return closed

    def finish(self) -> list[tuple[int, StageSpec, torch.Tensor | None]]:
        return [self._close()] if self._open is not None else []

    def _close(self) -> tuple[int, StageSpec, torch.Tensor | None]:
        o = self._open
        assert o is not None
        self._open = None
        self.counts.append(len(o.specs))
        flat = (o.flats[0] if len(o.flats) == 1 else torch.cat(o.flats)) if o.flats else None
        return o.first, unit_spec(o.first, o.specs), flat
