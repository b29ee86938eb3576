"""Every checkpoint schedule by name: what ``job.trainer(schedule=...)`` accepts, what each one takes
(``slots``, a byte budget) and how it builds its plan.

A schedule builds its plan either from the chain's length ``n`` before any batch runs (the
count-based ones of :mod:`.schedules`), or from a profile of the first batch
(:class:`~.costs.StageCosts`; the planners of :mod:`.budget`). :func:`resolve` checks a request
against the entry and returns the one or the other. Kept apart from the planners so that a new
schedule is one entry here and ``Job.trainer`` holds no list of names.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass

from .budget import auto, min_peak, offload, optimal
from .costs import StageCosts
from .plan import Plan
from .schedules import divide_and_conquer, revolve, sqrt_segments, store_all


@dataclass(frozen=True, slots=True)
class Schedule:
    """One schedule ``job.trainer(schedule=name)`` accepts. Exactly one builder is given."""

    name: str
    description: str
    """One line for a reader choosing among schedules."""
    _: KW_ONLY
    takes_slots: bool = False
    """Whether ``slots=`` (kept stage inputs) applies; only with ``from_n``."""
    from_n: Callable[[int, int | None], Plan] | None = None
    """Builds the plan from the chain's length and ``slots`` (None: the schedule's default)."""
    from_profile: Callable[[StageCosts], Plan] | None = None
    """Builds the plan from a profile of the first batch."""
    from_budget: Callable[[StageCosts, int], Plan] | None = None
    """Builds the plan from a profile of the first batch and a budget of activation bytes."""

    def __post_init__(self) -> None:
        builders = [b for b in (self.from_n, self.from_profile, self.from_budget) if b is not None]
        if len(builders) != 1:
            raise ValueError(f"schedule {self.name!r} needs exactly one of from_n, from_profile, from_budget")
        if self.takes_slots and self.from_n is None:
            raise ValueError(f"schedule {self.name!r}: slots= goes with a plan built from n")

    @property
    def needs_budget(self) -> bool:
        """Whether ``memory_budget=`` is required (and allowed)."""
        return self.from_budget is not None


def _revolve(n: int, slots: int | None = None) -> Plan:
    return revolve(n, slots if slots is not None else max(1, math.ceil(math.log2(max(n, 2)))))


SCHEDULES: dict[str, Schedule] = {
    s.name: s
    for s in (
        Schedule("store_all", "keep every stage input (n-1 advances, the least)", from_n=lambda n, slots=None: store_all(n)),
        Schedule("sqrt", "keep ceil(sqrt n) segment inputs (Chen et al.)", from_n=lambda n, slots=None: sqrt_segments(n)),
        Schedule("sqrt_recursive", "sqrt, split again", from_n=lambda n, slots=None: sqrt_segments(n, recursive=True)),
        Schedule("dnc", "bisection: O(log n) memory", from_n=lambda n, slots=None: divide_and_conquer(n)),
        Schedule("revolve", "binomial: least recomputation for `slots` kept inputs", takes_slots=True, from_n=_revolve),
        Schedule("optimal", "least recomputation time within the byte budget, from a profile", from_budget=optimal),
        Schedule("auto", "the fastest of every planner's plans that fits the byte budget", from_budget=auto),
        Schedule("min_peak", "the kept subset of least peak activation memory, from a profile", from_profile=min_peak),
        Schedule("offload", "every k-th input to host memory as fast as the copy keeps up", from_budget=offload),
    )
}
"""Schedules by name, in the order ``Job.trainer``'s docstring lists them."""

PLANNERS: dict[str, Callable[[int, int | None], Plan]] = {
    s.name: s.from_n for s in SCHEDULES.values() if s.from_n is not None
}
"""Planners by schedule name for the schedules built from n alone: ``PLANNERS[name](n, slots)``."""


def check(schedule: str, *, slots: int | None = None, budget_bytes: int | None = None) -> Schedule:
    """The registry entry of ``schedule``, once its arguments fit it. Raises ``ValueError`` for an
    unknown name, ``slots`` on a schedule that takes none, or a budget given to a schedule without
    one (or missing on one that needs it)."""
    entry = SCHEDULES.get(schedule)
    if entry is None:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {sorted(SCHEDULES)}")
    if slots is not None and not entry.takes_slots:
        with_slots = " or ".join(f"schedule={s.name!r}" for s in SCHEDULES.values() if s.takes_slots)
        raise ValueError(f"slots= applies to {with_slots}, not {schedule!r}")
    if (budget_bytes is not None) != entry.needs_budget:
        budgeted = tuple(s.name for s in SCHEDULES.values() if s.needs_budget)
        raise ValueError(f"memory_budget= goes with schedule in {budgeted} (and they need it)")
    return entry


def resolve(
    schedule: str, n: int, *, slots: int | None = None, budget_bytes: int | None = None
) -> tuple[Plan | None, Callable[[StageCosts], Plan] | None]:
    """Check ``job.trainer``'s schedule arguments (:func:`check`) and return ``(plan,
    from_profile)``: the plan of a chain of ``n`` stages when the schedule needs no profile, else
    the function that plans from the first batch's profile (exactly one is not None). Raises
    :class:`~.plan.PlanError` when no plan can be built."""
    entry = check(schedule, slots=slots, budget_bytes=budget_bytes)
    if entry.from_n is not None:
        return entry.from_n(n, slots), None
    if entry.from_budget is not None:
        build, budget = entry.from_budget, budget_bytes
        assert budget is not None
        return None, lambda costs: build(costs, budget)
    return None, entry.from_profile
