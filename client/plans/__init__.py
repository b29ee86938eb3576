"""Checkpoint plans: pure data describing how to run forward and backward over a chain of stages.

A chain is ``x_{i+1} = F_i(x_i)`` for stages ``0 .. n-1``; a plan is a list of actions over it
(ADVANCE, SNAPSHOT, RESTORE, FREE, BACKWARD, OFFLOAD, PREFETCH, FREE_HOST: :mod:`.plan` says what
each does). Nothing here imports torch: planners are pure functions, plans are checked by
:func:`simulate`, and the trainer is the only thing that runs them.

* :mod:`.plan` -- ``Op``, ``Action``, ``Plan``, ``PlanError``: the data every planner shares;
* :mod:`.simulate` -- ``simulate``: checks a plan and counts its recomputation and peaks;
* :mod:`.schedules` -- the count-based schedules (``store_all``, ``sqrt_segments``,
  ``divide_and_conquer``, ``revolve``, ``OnlineBisection``, ``segments_plan``);
* :mod:`.costs` -- the cost model: ``StageCosts`` and ``plan_time``;
* :mod:`.budget` -- the byte-budget planners (``optimal``, ``min_peak``, ``auto``, ``offload``);
* :mod:`.nested` -- ``optimal``'s dynamic program over nested schedules (``nested_plan``);
* :mod:`.search` -- ``exhaustive_plan``: the least-cost schedule of all, for short chains;
* :mod:`.registry` -- every schedule by name, and ``resolve`` for ``job.trainer(schedule=...)``.
"""

from __future__ import annotations

from .budget import auto, min_budget, min_peak, offload, offload_spacing, optimal
from .costs import StageCosts, plan_time
from .nested import nested_plan
from .plan import Action, Op, Plan, PlanError
from .registry import PLANNERS, SCHEDULES, Schedule, resolve
from .schedules import (
    OnlineBisection,
    beta,
    divide_and_conquer,
    revolve,
    revolve_cost,
    revolve_cost_dp,
    segments_plan,
    sqrt_segments,
    store_all,
)
from .search import exhaustive_plan
from .simulate import Simulation, simulate

__all__ = [
    "PLANNERS",
    "SCHEDULES",
    "Action",
    "OnlineBisection",
    "Op",
    "Plan",
    "PlanError",
    "Schedule",
    "Simulation",
    "StageCosts",
    "auto",
    "beta",
    "divide_and_conquer",
    "exhaustive_plan",
    "min_budget",
    "min_peak",
    "nested_plan",
    "offload",
    "offload_spacing",
    "optimal",
    "plan_time",
    "resolve",
    "revolve",
    "revolve_cost",
    "revolve_cost_dp",
    "segments_plan",
    "simulate",
    "sqrt_segments",
    "store_all",
]
