"""``optimal`` against an exhaustive search over every schedule the executor runs (issue 18).

The search here is the tests' own (not :mod:`wstream.client.plans.search`): Dijkstra over every
state (kept inputs, current input, next stage to reverse) with every action :func:`simulate`
accepts, its optimum replayed through :func:`simulate` to check cost and memory. Chain counts
scale with $WSTREAM_OPTIMAL_CHAINS (default 1000: a few tens of seconds).
"""

from __future__ import annotations

import copy
import heapq
import math
import os
import random

import pytest
import torch
from torch import nn

import wstream.client.plans.nested as nested
from wstream.client import AdamW, Client
from wstream.client.plans import (
    Action,
    Op,
    StageCosts,
    auto,
    min_budget,
    optimal,
    plan_time,
    revolve,
    simulate,
    store_all,
)
from wstream.client.plans.nested import nested_plan

CHAINS = int(os.environ.get("WSTREAM_OPTIMAL_CHAINS", "1000"))


def oracle(costs: StageCosts, budget: int) -> tuple[float, list[Action]]:
    """The least cost of any schedule the executor accepts within ``budget`` bytes, and one such
    schedule (starting with SNAPSHOT 0; inf and [] when none fits). Moves: ADVANCE the current
    input below the next stage to reverse, BACKWARD it at that stage, SNAPSHOT it, RESTORE or
    FREE any kept input: what simulate() allows, less what can only add memory: ADVANCE n-1
    before any backward (x_n is of no use to any action) and keeping x_i past BACKWARD i (no
    action can use it then: it is freed with the BACKWARD)."""
    n, x, tape = costs.n, costs.state_bytes, costs.tape_bytes
    kept_bytes = [sum(x[i] for i in range(n) if m >> i & 1) for m in range(1 << n)]
    start = (1, 0, n - 1)
    best = {start: 0.0}
    parent: dict[tuple[int, int, int], tuple[tuple[int, int, int], Action]] = {}
    heap = [(0.0, 0, start)]
    tie = 0
    while heap:
        cost, _, state = heapq.heappop(heap)
        if cost > best[state]:
            continue
        kept, cur, nb = state
        if nb < 0:
            actions: list[Action] = []
            while state != start:
                state, action = parent[state]
                if action[0] == Op.BACKWARD and state[0] >> action[1] & 1:
                    actions.append((Op.FREE, action[1]))
                actions.append(action)
            return cost, [(Op.SNAPSHOT, 0), *reversed(actions)]
        live = kept_bytes[kept] + (x[cur] if cur >= 0 and not kept >> cur & 1 else 0)
        moves: list[tuple[float, tuple[int, int, int], Action]] = []
        if 0 <= cur < nb and live + x[cur + 1] <= budget:
            moves.append((costs.advance_cost(cur), (kept, cur + 1, nb), (Op.ADVANCE, cur)))
        if cur == nb and live + tape[cur] <= budget:
            moves.append((0.0, (kept & ~(1 << nb), -1, nb - 1), (Op.BACKWARD, cur)))
        if cur >= 0 and not kept >> cur & 1:
            moves.append((0.0, (kept | 1 << cur, cur, nb), (Op.SNAPSHOT, cur)))
        for k in range(nb + 1):
            if kept >> k & 1:
                moves.append((0.0, (kept, k, nb), (Op.RESTORE, k)))
                moves.append((0.0, (kept & ~(1 << k), cur, nb), (Op.FREE, k)))
        for dc, nxt, action in moves:
            if cost + dc < best.get(nxt, math.inf):
                best[nxt] = cost + dc
                parent[nxt] = (state, action)
                tie += 1
                heapq.heappush(heap, (cost + dc, tie, nxt))
    return math.inf, []


def replayed(costs: StageCosts, actions: list[Action] | tuple[Action, ...]) -> tuple[float, int]:
    """(cost, peak bytes) of ``actions`` as simulate() replays them."""
    sim = simulate(costs.n, actions, state_bytes=costs.state_bytes, tape_bytes=costs.tape_bytes)
    return sum(costs.advance_cost(i) for op, i in actions if op == Op.ADVANCE), sim.peak_bytes


def store_all_peak(costs: StageCosts) -> int:
    return replayed(costs, store_all(costs.n).actions)[1]


def persistent(actions: tuple[Action, ...] | list[Action]) -> bool:
    """Whether every kept input stays kept until its own stage is reversed."""
    reversed_ = set()
    for op, i in actions:
        if op == Op.BACKWARD:
            reversed_.add(i)
        elif op == Op.FREE and i not in reversed_:
            return False
    return True


SHAPES = ("uniform", "random", "spiky", "growing", "shrinking", "big-tapes", "streamed")


def chain(rng: random.Random, n: int, shape: str) -> StageCosts:
    """A random chain of one of several shapes (sizes small, so the memory grid is exact)."""
    fwd = tuple(rng.choice((0.5, 1.0, 1.5, 3.0)) for _ in range(n))
    if shape == "uniform":
        s = rng.randint(1, 3)
        return StageCosts(forward_s=(1.0,) * n, state_bytes=(s,) * n, tape_bytes=(rng.randint(0, 3),) * n)
    if shape == "spiky":
        xs = tuple(rng.choice((1, 1, 1, 5)) for _ in range(n))
        return StageCosts(fwd, xs, tuple(rng.choice((0, 1, 1, 9)) for _ in range(n)))
    if shape in ("growing", "shrinking"):
        xs = tuple(sorted((rng.randint(1, 6) for _ in range(n)), reverse=shape == "shrinking"))
        return StageCosts(fwd, xs, tuple(rng.randint(0, 4) for _ in range(n)))
    if shape == "big-tapes":
        return StageCosts(fwd, tuple(rng.randint(1, 3) for _ in range(n)), tuple(rng.randint(2, 12) for _ in range(n)))
    xs = tuple(rng.randint(1, 6) for _ in range(n))
    tapes = tuple(rng.randint(0, 8) for _ in range(n))
    if shape == "streamed":  # weight fetches make some stages dear to recompute
        return StageCosts(fwd, xs, tapes, weight_bytes=tuple(rng.choice((0, 0, 4, 40)) for _ in range(n)), bandwidth=4.0)
    return StageCosts(fwd, xs, tapes)


def test_optimal_and_its_dp_equal_the_exhaustive_search_over_every_executor_schedule() -> None:
    rng = random.Random(18)
    cases = nonpersistent = 0
    for t in range(CHAINS):
        n = rng.choice((1, 2, 3, 4, 4, 5, 5, 5, 6, 6, 6, 7))
        costs = chain(rng, n, SHAPES[t % len(SHAPES)])
        low = min_budget(costs)
        top = store_all_peak(costs)
        for budget in sorted({low, rng.randint(low, max(low, top))}):
            want, schedule = oracle(costs, budget)
            assert want < math.inf, (costs, budget)  # min_budget is reachable
            cost, peak = replayed(costs, schedule)  # the search's optimum replays as it says
            assert cost == pytest.approx(want) and peak <= budget
            plan = optimal(costs, budget)
            cost, peak = replayed(costs, plan.actions)
            assert peak <= budget, (costs, budget)
            assert cost == pytest.approx(want, rel=1e-12), (costs, budget, plan.actions)
            dp_actions, dp_cost = nested_plan(costs, budget)  # the DP alone (optimal also searches)
            cost, peak = replayed(costs, dp_actions)
            assert cost == pytest.approx(dp_cost, rel=1e-12) and peak <= budget
            assert dp_cost == pytest.approx(want, rel=1e-12), (costs, budget, dp_actions)
            nonpersistent += not persistent(plan.actions)
            cases += 1
    assert cases >= CHAINS
    assert nonpersistent >= cases // 100  # the schedules a persistent DP cannot make do occur


def coprime_sizes(rng: random.Random, n: int, lo: int, hi: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Input and tape sizes whose gcd is 1 (so no exact grid coarser than a byte exists)."""
    while True:
        xs = tuple(rng.randint(lo, hi) for _ in range(n))
        tapes = tuple(rng.randint(0, 2 * hi) for _ in range(n))
        if math.gcd(*xs, *tapes) == 1:
            return xs, tapes


def test_min_budget_is_never_refused_with_sizes_of_no_common_divisor() -> None:
    rng = random.Random(106136)
    for t in range(max(40, CHAINS // 5)):
        n = rng.choice((1, 2, 3, 4, 5, 6, 8)) if t % 25 else rng.randint(30, 64)  # long ones: blocks
        xs, tapes = coprime_sizes(rng, n, 10_000, 1_000_000)
        costs = StageCosts(tuple(rng.uniform(0.1, 3.0) for _ in range(n)), xs, tapes)
        low = min_budget(costs)
        for budget in (low, low + rng.randint(1, 999))[: 1 + (t % 3 == 0)]:
            plan = optimal(costs, budget)  # never raises
            assert replayed(costs, plan.actions)[1] <= budget
            if n <= 6:  # exact bytes, whatever the grid: optimal searches every schedule here
                assert plan_time(costs, plan) == pytest.approx(oracle(costs, budget)[0], rel=1e-12)
            if n <= 8:  # the DP alone too: every state's least memory is exact
                assert replayed(costs, nested_plan(costs, budget)[0])[1] <= budget


def test_rounding_costs_at_most_what_the_exact_grid_finds_plus_the_loss_it_is_allowed() -> None:
    """With sizes of no common divisor the DP's grid is coarser than a byte: its plans still fit,
    never beat the exact optimum, and at budget B cost no more than the exact DP's at B minus the
    few grid steps its rounding can lose (NOTE [Nested schedules])."""
    rng = random.Random(5)
    for _ in range(max(40, CHAINS // 10)):
        n = rng.randint(3, 10)
        xs, tapes = coprime_sizes(rng, n, 30, 300)
        costs = StageCosts(tuple(rng.uniform(0.5, 2.0) for _ in range(n)), xs, tapes)
        low, top = min_budget(costs), store_all_peak(costs)
        budget = rng.randint(low, top)
        resolution = rng.choice((4, 16, 64))
        actions, cost = nested_plan(costs, budget, resolution=resolution)
        exact_actions, exact = nested_plan(costs, budget, resolution=10**5)  # a unit of 1 byte
        assert replayed(costs, actions)[1] <= budget and replayed(costs, exact_actions)[1] <= budget
        assert cost >= exact - 1e-9
        # the coarsest grid of any state: its least memory is at least one stage's input + tape
        unit = max(1, -(-(budget - min(x + t for x, t in zip(xs, tapes))) // resolution))
        # each state's memory is rounded down to its grid once per level of the recursion (< 3n)
        less = budget - (3 * n + 2) * unit
        if less >= low:
            assert cost <= nested_plan(costs, less, resolution=10**5)[1] + 1e-9


def test_blocks_never_beat_the_flat_dp_and_their_plans_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans over blocks are nested schedules of a narrower class: never cheaper than the DP over
    every stage (both exact here), and always within the budget."""
    rng = random.Random(36)
    for t in range(max(8, CHAINS // 100)):
        n = rng.randint(10, 20)
        costs = chain(rng, n, SHAPES[t % len(SHAPES)])
        low, top = min_budget(costs), store_all_peak(costs)
        for budget in (low, rng.randint(low, top), top):
            _, flat = nested_plan(costs, budget)
            with monkeypatch.context() as m:
                m.setattr(nested, "FLAT_STAGES", 4)
                m.setattr(nested, "GROUP", 3)
                actions, blocks = nested_plan(costs, budget)
            cost, peak = replayed(costs, actions)
            assert peak <= budget and cost == pytest.approx(blocks)
            assert blocks >= flat - 1e-9
            if budget == top:
                assert blocks == pytest.approx(plan_time(costs, store_all(n)))  # every input fits


def test_long_chains_plan_within_budget_and_auto_takes_optimal_where_it_is_cheaper() -> None:
    rng = random.Random(1000)
    n = 80
    xs, tapes = coprime_sizes(rng, n, 1000, 4000)
    costs = StageCosts(tuple(rng.uniform(0.5, 2.0) for _ in range(n)), xs, tapes)
    low, top = min_budget(costs), store_all_peak(costs)
    for budget in (low, low + (top - low) // 20, top):
        plan = optimal(costs, budget)
        cost, peak = replayed(costs, plan.actions)
        assert peak <= budget
        assert cost <= plan_time(costs, revolve(n, 1)) + 1e-9  # x_0 alone is in its class
        if budget == top:
            assert cost == pytest.approx(plan_time(costs, store_all(n)))
        picked = auto(costs, budget)  # optimal is among its candidates
        assert plan_time(costs, picked) <= cost + 1e-9


# ---- the executor runs what optimal makes ------------------------------------------------------
WIDTH = 8


def test_a_non_persistent_plan_trains_to_plain_pytorch_weights(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 18's chain as the profile: the plan frees x_1 before BACKWARD 1 and recomputes it;
    training through it gives plain PyTorch's weights, and store_all's bit for bit."""
    import wstream.client.trainer as trainer_module

    real = trainer_module.measure_profile
    unit = 4 * WIDTH * 4  # one stage input: 4 rows of WIDTH fp32

    def profile(*args, **kwargs) -> StageCosts:  # noqa: ANN002, ANN003
        real(*args, **kwargs)  # measured as ever (RNG forked, nothing pushed), then replaced
        return StageCosts((1.0,) * 4, tuple(unit * s for s in (1, 1, 2, 1)), tuple(unit * t for t in (0, 0, 2, 2)))

    monkeypatch.setattr(trainer_module, "measure_profile", profile)

    def stages() -> list[nn.Module]:
        torch.manual_seed(0)
        return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)]

    g = torch.Generator().manual_seed(7)
    data = [(torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)) for _ in range(3)]
    results = {}
    for schedule, kw in (("store_all", {}), ("optimal", {"memory_budget": 5 * unit})):
        job = client.create_job(f"np-{schedule}", stages(), optimizer=AdamW(lr=1e-2), token="t")
        with job.trainer(schedule=schedule, **kw) as trainer:
            losses = [trainer.step(x, y, torch.nn.functional.mse_loss) for x, y in data]
            plan = trainer.plan
        results[schedule] = (job.state_dict(), losses, plan)
    state, losses, plan = results["optimal"]
    assert plan is not None and plan.advances == 5 and not persistent(plan.actions)
    base_state, base_losses, _ = results["store_all"]
    assert losses == base_losses
    assert all(torch.equal(state[k], base_state[k]) for k in base_state)
    ref = nn.Sequential(*copy.deepcopy(stages()))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
    want = ref.state_dict()
    assert state.keys() == want.keys()
    assert max((state[k] - want[k]).abs().max().item() for k in want) <= 1e-6


# ---- the two cases ----------------------------------------------------------------------
def test_regression_a_freed_checkpoint_recomputed_later_saves_an_advance() -> None:
    """Keeping x_1 through BACKWARD 3, freeing it before BACKWARD 2 (x_2 + tape_2 fill the budget)
    and recomputing it from x_0 takes 5 advances; a plan that keeps every checkpoint until its own
    stage is reversed cannot keep x_1 at all and takes 6."""
    costs = StageCosts(forward_s=(1.0,) * 4, state_bytes=(1, 1, 2, 1), tape_bytes=(0, 0, 2, 2))
    plan = optimal(costs, 5)
    assert plan.advances == 5
    assert plan_time(costs, plan) == 5.0
    assert simulate(4, plan.actions, state_bytes=costs.state_bytes, tape_bytes=costs.tape_bytes).peak_bytes <= 5
    assert oracle(costs, 5)[0] == 5.0
    assert nested_plan(costs, 5)[1] == 5.0  # the DP finds it, not only the search


def test_regression_the_least_budget_is_accepted_with_sizes_of_no_common_divisor() -> None:
    costs = StageCosts((1, 1), (35278, 28516), (22533, 42342))
    assert min_budget(costs) == 106136
    plan = optimal(costs, 106136)
    sim = simulate(2, plan.actions, state_bytes=costs.state_bytes, tape_bytes=costs.tape_bytes)
    assert sim.peak_bytes <= 106136
    assert plan.advances == 1
