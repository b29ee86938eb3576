"""``optimal`` against an exhaustive search over every schedule the executor runs (issue 18)."""

from __future__ import annotations

from wstream.client.plans import StageCosts, min_budget, optimal, plan_time, simulate


def test_regression_a_freed_checkpoint_recomputed_later_saves_an_advance() -> None:
    """Keeping x_1 through BACKWARD 3, freeing it before BACKWARD 2 (x_2 + tape_2 fill the budget)
    and recomputing it from x_0 takes 5 advances; a plan that keeps every checkpoint until its own
    stage is reversed cannot keep x_1 at all and takes 6."""
    costs = StageCosts(forward_s=(1.0,) * 4, state_bytes=(1, 1, 2, 1), tape_bytes=(0, 0, 2, 2))
    plan = optimal(costs, 5)
    assert plan.advances == 5
    assert plan_time(costs, plan) == 5.0
    assert simulate(4, plan.actions, state_bytes=costs.state_bytes, tape_bytes=costs.tape_bytes).peak_bytes <= 5


def test_regression_the_least_budget_is_accepted_with_sizes_of_no_common_divisor() -> None:
    costs = StageCosts((1, 1), (35278, 28516), (22533, 42342))
    assert min_budget(costs) == 106136
    plan = optimal(costs, 106136)
    sim = simulate(2, plan.actions, state_bytes=costs.state_bytes, tape_bytes=costs.tape_bytes)
    assert sim.peak_bytes <= 106136
    assert plan.advances == 1
