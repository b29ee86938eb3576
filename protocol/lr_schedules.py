"""Learning-rate schedules as wire data: what multiplies an optimizer's base lr at each step.

A schedule travels inside the optimizer record (``AdamW.schedule``, ``SGD.schedule`` in
``messages.py``) and is evaluated by the server, so it must be plain data that both ends read the
same way: a frozen msgspec record per kind, tagged by ``kind``, with no torch in it. Each has
``factor(step)``, the multiplier of the base lr at optimizer step ``step``, 0-based: step 0 is
the first update, as ``torch.optim.lr_scheduler.LambdaLR(opt, f)`` applies ``f(0)`` to the first
``optimizer.step()``. ``lr_at(schedule, lr, step)`` is the lr of that step.

Where Hugging Face transformers (``transformers.optimization``) has a closed form, the schedule
is that closed form; a departure is named in the record's docstring. Schedules give a *ratio* of
the base lr, never an absolute lr, so a per-group lr multiplier applied later scales the whole
curve, floor included.

Validation is in ``__post_init__``, which msgspec also runs while decoding, so a bad value from
the wire is a ``msgspec.ValidationError`` naming the field, and a value built in Python is a
``ValueError``. This module must not import ``messages.py`` (``messages.py`` imports it).
"""

from __future__ import annotations

import bisect
import math
from typing import Annotated, Union

from msgspec import Meta, Struct

MAX_COUNT = 2**62
"""Step counts are bounded as steps are on the wire (``messages.MAX_STEP``, not imported: this
module is below ``messages.py``)."""
MAX_POINTS = 65_536
"""At most this many milestones or interpolation points in one schedule (a bound on what a header
may make the server hold)."""

Count = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
"""A number of optimizer steps (or a step index): an integer in [0, 2^62]."""
Points = Annotated[list[Count], Meta(max_length=MAX_POINTS)]


# ---- checks (run by __post_init__, in Python and while decoding) ------------------------------
def _check_count(name: str, value: object) -> None:
    # bool is an int in Python, but never a count; a float (even 10.0) would not decode as one.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        raise ValueError(f"{name} must be an integer in [0, {MAX_COUNT}], got {value!r}")


def _check_real(name: str, value: object, *, low: float = 0.0, high: float = math.inf) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (ok and math.isfinite(value) and low <= value <= high):  # type: ignore[arg-type]
        raise ValueError(f"{name} must be a finite number in [{low}, {high}], got {value!r}")


def _check_increasing(name: str, values: object) -> None:
    if not isinstance(values, list) or len(values) > MAX_POINTS:
        raise ValueError(f"{name} must be a list of at most {MAX_POINTS} steps, got {values!r}")
    for k, v in enumerate(values):
        _check_count(f"{name}[{k}]", v)
    for k in range(1, len(values)):
        if values[k] <= values[k - 1]:
            raise ValueError(f"{name} must be strictly increasing, got {name}[{k - 1}] = {values[k - 1]} "
                             f"then {name}[{k}] = {values[k]}")


def _check_warmup_total(warmup_steps: int, total_steps: int) -> None:
    _check_count("warmup_steps", warmup_steps)
    _check_count("total_steps", total_steps)
    if total_steps < warmup_steps:
        raise ValueError(f"total_steps must be >= warmup_steps ({warmup_steps}), got {total_steps}")


def _warmup(step: int, warmup_steps: int) -> float:
    """HF's linear warmup from 0: ``step / max(1, warmup_steps)``."""
    return float(step) / float(max(1, warmup_steps))


# ---- the schedules -----------------------------------------------------------------------------
class _Schedule(Struct, frozen=True, kw_only=True, tag_field="kind", forbid_unknown_fields=True):
    """Options common to every schedule record: frozen, keyword-only, tagged ``kind``, strict."""


class Constant(_Schedule, tag="constant"):
    """The base lr at every step (factor 1): the default, no schedule."""

    def factor(self, step: int) -> float:
        """1.0 at every step."""
        _check_count("step", step)
        return 1.0


class _WarmupToFloor(_Schedule):
    """A linear warmup from 0, then a decay from 1 to ``min_lr_ratio`` at ``total_steps``: the
    fields, checks and floor of :class:`WarmupCosine` and :class:`WarmupLinear`, which differ only
    in the shape of the decay (``_decay``: 1 at the end of the warmup, 0 at ``total_steps``)."""

    warmup_steps: Count
    total_steps: Count
    """The step at which the factor reaches ``min_lr_ratio`` (warmup included)."""
    min_lr_ratio: float = 0.0
    """The floor, as a fraction of the base lr, in [0, 1]."""

    def __post_init__(self) -> None:
        _check_warmup_total(self.warmup_steps, self.total_steps)
        _check_real("min_lr_ratio", self.min_lr_ratio, high=1.0)

    def factor(self, step: int) -> float:
        """The multiplier of the base lr at 0-based optimizer step ``step``."""
        _check_count("step", step)
        if step < self.warmup_steps:
            return _warmup(step, self.warmup_steps)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * self._decay(step)

    def _decay(self, step: int) -> float:
        raise NotImplementedError


class WarmupCosine(_WarmupToFloor, tag="warmup_cosine"):
    """Linear warmup from 0, then half a cosine from 1 down to ``min_lr_ratio`` at ``total_steps``.

    HF ``get_cosine_with_min_lr_schedule_with_warmup(num_cycles=0.5, min_lr_rate=min_lr_ratio)``:
    step < warmup: ``step / max(1, warmup)``; else with ``progress = (step - warmup) /
    max(1, total - warmup)``: ``min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + cos(pi *
    progress))``. One departure: ``progress`` is clamped to 1, so steps past ``total_steps`` stay
    at the floor (HF's cosine climbs back up there).

    The floor is a ratio of the base lr (HF's ``min_lr_rate``), not an absolute ``min_lr``: a
    per-group lr multiplier then scales the floor with the rest of the curve.
    """

    def _decay(self, step: int) -> float:
        progress = min(1.0, float(step - self.warmup_steps) / float(max(1, self.total_steps - self.warmup_steps)))
        return 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupLinear(_WarmupToFloor, tag="warmup_linear"):
    """Linear warmup from 0, then a straight line from 1 down to ``min_lr_ratio`` at ``total_steps``.

    HF ``get_linear_schedule_with_warmup``: step < warmup: ``step / max(1, warmup)``; else
    ``max(0, (total - step) / max(1, total - warmup))``, here mapped onto [min_lr_ratio, 1] as
    the cosine's floor is: ``min_lr_ratio + (1 - min_lr_ratio) * that``. So the line ends at the
    floor exactly at ``total_steps`` and stays there (a clamp at the floor would instead reach it
    early and leave ``total_steps`` meaning nothing); with ``min_lr_ratio = 0`` it is HF's.
    The floor is a ratio of the base lr, for the reason given under ``WarmupCosine``.
    """

    def _decay(self, step: int) -> float:
        return max(0.0, float(self.total_steps - step) / float(max(1, self.total_steps - self.warmup_steps)))


class InverseSqrt(_Schedule, tag="inverse_sqrt"):
    """Linear warmup from 0, then decay as one over the square root of the steps since.

    HF ``get_inverse_sqrt_schedule``: step < warmup: ``step / max(1, warmup)``; else
    ``1 / sqrt((step - warmup + timescale) / timescale)``, which is 1 at the end of warmup and
    halves every time ``step - warmup + timescale`` quadruples.
    """

    warmup_steps: Count
    timescale: Count | None = None
    """Steps of the decay's time scale, >= 1. None is HF's default: ``warmup_steps``, or 10,000
    when there is no warmup (a time scale of 0 would divide by zero)."""

    def __post_init__(self) -> None:
        _check_count("warmup_steps", self.warmup_steps)
        if self.timescale is not None:
            _check_count("timescale", self.timescale)
            if self.timescale < 1:
                raise ValueError(f"timescale must be >= 1 (or None), got {self.timescale}")

    def factor(self, step: int) -> float:
        """The multiplier of the base lr at 0-based optimizer step ``step``."""
        _check_count("step", step)
        if step < self.warmup_steps:
            return _warmup(step, self.warmup_steps)
        timescale = self.timescale if self.timescale is not None else (self.warmup_steps or 10_000)
        return 1.0 / math.sqrt((step - self.warmup_steps + timescale) / timescale)


class MultiStep(_Schedule, tag="multi_step"):
    """Multiply by ``gamma`` at each milestone: ``gamma ** (number of milestones <= step)``.

    ``torch.optim.lr_scheduler.MultiStepLR(opt, milestones, gamma)``, whose closed form this is
    (a milestone at step m first lowers the lr of update m; a milestone 0 lowers it from the start).
    """

    milestones: Points
    """Steps, strictly increasing."""
    gamma: float = 0.1
    """The multiplier per milestone, > 0 (above 1 raises the lr)."""

    def __post_init__(self) -> None:
        _check_increasing("milestones", self.milestones)
        _check_real("gamma", self.gamma)
        if self.gamma <= 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma!r}")
        try:  # the factor after the last milestone must be a number: the server multiplies by it
            last = self.gamma ** len(self.milestones)
        except OverflowError:
            last = math.inf
        if not math.isfinite(last):
            raise ValueError(f"gamma ** len(milestones) overflows: gamma = {self.gamma!r}, {len(self.milestones)} milestones")

    def factor(self, step: int) -> float:
        """The multiplier of the base lr at 0-based optimizer step ``step``."""
        _check_count("step", step)
        return float(self.gamma ** bisect.bisect_right(self.milestones, step))


class Piecewise(_Schedule, tag="piecewise"):
    """Piecewise linear through the points ``(steps[k], factors[k])``, flat outside them.

    Before ``steps[0]`` the factor is ``factors[0]``, after ``steps[-1]`` it is ``factors[-1]``
    (as ``numpy.interp``): any curve the other kinds do not cover, given as a few knots.
    """

    steps: Points
    """At least one step, strictly increasing."""
    factors: Annotated[list[float], Meta(max_length=MAX_POINTS)]
    """The factor at each of ``steps`` (finite, >= 0), as many as ``steps``."""

    def __post_init__(self) -> None:
        _check_increasing("steps", self.steps)
        if not self.steps:
            raise ValueError("steps must hold at least one point, got []")
        if not isinstance(self.factors, list) or len(self.factors) != len(self.steps):
            raise ValueError(f"factors must be a list as long as steps ({len(self.steps)}), got {self.factors!r}")
        for k, f in enumerate(self.factors):
            _check_real(f"factors[{k}]", f)

    def factor(self, step: int) -> float:
        """The multiplier of the base lr at 0-based optimizer step ``step``."""
        _check_count("step", step)
        k = bisect.bisect_right(self.steps, step)  # steps[k - 1] <= step < steps[k]
        if k == 0:
            return float(self.factors[0])
        if k == len(self.steps):
            return float(self.factors[-1])
        s0, s1 = self.steps[k - 1], self.steps[k]
        f0, f1 = self.factors[k - 1], self.factors[k]
        return f0 + (f1 - f0) * ((step - s0) / (s1 - s0))


class Warmup(_Schedule, tag="warmup"):
    """A linear warmup put in front of another schedule, which starts after it at its own step 0.

    Step s < ``steps``: ``start_factor + (1 - start_factor) * s / steps``; step s >= ``steps``:
    ``then.factor(s - steps)``. ``then`` may be any schedule but another ``Warmup``: a warmup of
    a warmup is one warmup, and keeping the union flat bounds a schedule's nesting on the wire.
    """

    steps: Count
    """Updates of warmup (0: none, ``then`` from the first update)."""
    then: WarmupBody
    """The schedule after warmup, shifted to start at step ``steps``."""
    start_factor: float = 0.0
    """The factor of the first update, in [0, 1] (torch's ``LinearLR`` has the same argument)."""

    def __post_init__(self) -> None:
        _check_count("steps", self.steps)
        _check_real("start_factor", self.start_factor, high=1.0)
        if isinstance(self.then, Warmup) or not isinstance(self.then, _BODY_TYPES):
            raise ValueError(f"then must be a schedule other than Warmup, got {self.then!r}")

    def factor(self, step: int) -> float:
        """The multiplier of the base lr at 0-based optimizer step ``step``."""
        _check_count("step", step)
        if step < self.steps:
            return self.start_factor + (1.0 - self.start_factor) * step / self.steps
        return self.then.factor(step - self.steps)


WarmupBody = Union[Constant, WarmupCosine, WarmupLinear, InverseSqrt, MultiStep, Piecewise]
"""What ``Warmup.then`` may be: every schedule but ``Warmup``."""
_BODY_TYPES = (Constant, WarmupCosine, WarmupLinear, InverseSqrt, MultiStep, Piecewise)

Schedule = Union[Constant, WarmupCosine, WarmupLinear, InverseSqrt, MultiStep, Piecewise, Warmup]
"""Any schedule record; decode one with ``msgspec.msgpack.decode(data, type=Schedule)``."""


def lr_at(schedule: Schedule, base_lr: float, step: int) -> float:
    """The lr of 0-based optimizer step ``step``: ``base_lr * schedule.factor(step)``, the value
    ``LambdaLR(opt, schedule.factor)`` sets in a param group of lr ``base_lr`` for that update."""
    return base_lr * schedule.factor(step)
