"""Checkpoint planners against proven optima, closed forms and exhaustive search."""

from __future__ import annotations

import dataclasses
import heapq
import math
import random

import pytest

from wstream.client.plans import (
    Op,
    PlanError,
    divide_and_conquer,
    revolve,
    revolve_cost,
    revolve_cost_dp,
    simulate,
    sqrt_segments,
    store_all,
)


def exhaustive_search(n: int, advance_cost, fits) -> float:  # noqa: ANN001
    """The least total ADVANCE cost of any valid plan, by Dijkstra over every reachable
    (kept, current, next stage to reverse) state; independent of the planners. ``fits(kept,
    current, extra)`` says whether a state plus ``extra`` (None: a snapshot is being added) is
    allowed; ``advance_cost(i)`` prices ADVANCE i."""
    start = (frozenset(), 0, n - 1)
    best = {start: 0.0}
    heap = [(0.0, 0, start)]
    tie = 0
    while heap:
        cost, _, state = heapq.heappop(heap)
        kept, cur, nb = state
        if nb == -1:
            return cost
        if cost > best[state]:
            continue
        moves = []
        if cur is not None and cur < nb and fits(kept, cur, ("next", cur + 1)):
            moves.append((advance_cost(cur), (kept, cur + 1, nb)))
        if cur is not None and cur == nb and fits(kept, cur, ("tape", cur)):
            moves.append((0.0, (kept, None, nb - 1)))
        if cur is not None and cur not in kept and fits(kept | {cur}, cur, None):
            moves.append((0.0, (kept | {cur}, cur, nb)))
        for k in kept:
            if k <= nb and fits(kept, k, ("none", k)):
                moves.append((0.0, (kept, k, nb)))
            moves.append((0.0, (kept - {k}, cur, nb)))
        for dc, nxt in moves:
            if cost + dc < best.get(nxt, math.inf) - 1e-12:
                best[nxt] = cost + dc
                tie += 1
                heapq.heappush(heap, (cost + dc, tie, nxt))
    return math.inf


def exhaustive_min_advances(n: int, slots: int) -> int:
    """The fewest ADVANCEs of any plan keeping at most ``slots`` states (Griewank and Walther)."""
    return int(exhaustive_search(n, lambda i: 1.0, lambda kept, cur, extra: len(kept) <= slots))


def test_revolve_reaches_the_closed_form_for_every_n_up_to_300_and_slots_up_to_12() -> None:
    for n in range(1, 301):
        for s in range(1, 13):
            plan = revolve(n, s)  # every plan is also replayed by simulate() when built
            assert plan.advances == revolve_cost(n, s), (n, s)
            assert plan.peak_slots <= s, (n, s)


def test_revolve_takes_thousands_of_slots_on_a_long_chain() -> None:
    # the right branch of the split nests once per slot: a recursive planner overflowed Python's stack
    plan = revolve(20_000, 3_000)
    assert plan.advances == revolve_cost(20_000, 3_000) and plan.peak_slots <= 3_000


@pytest.mark.parametrize(
    ("n", "s", "p"), [(10, 2, 20), (10, 3, 15), (20, 3, 45), (20, 5, 33), (16, 4, 27), (20, 6, 32), (1000, 11, 3545)]
)
def test_revolve_spot_values(n: int, s: int, p: int) -> None:
    assert revolve_cost(n, s) == p
    assert revolve(n, s).advances == p


def test_closed_form_equals_the_recurrence() -> None:
    for n in range(1, 41):
        for s in range(1, 7):
            assert revolve_cost(n, s) == revolve_cost_dp(n, s), (n, s)
    assert revolve_cost(1, 3) == 0
    assert all(revolve_cost(n, 1) == n * (n - 1) // 2 for n in range(1, 50))
    assert all(revolve_cost(n, s) == n - 1 for n in range(2, 30) for s in range(n - 1, n + 3))


@pytest.mark.parametrize("n", range(1, 8))
@pytest.mark.parametrize("s", range(1, 5))
def test_revolve_is_optimal_by_exhaustive_search(n: int, s: int) -> None:
    assert exhaustive_min_advances(n, s) == revolve_cost(n, s) == revolve(n, s).advances


def test_bisection_costs() -> None:
    for k in range(0, 11):
        n = 2**k
        plan = divide_and_conquer(n)
        assert plan.advances == n // 2 * k
        assert plan.peak_states == k + 1
    big = divide_and_conquer(1000)
    assert (big.advances, big.peak_states) == (4932, 11)
    for n in range(1, 200):
        plan = divide_and_conquer(n)
        assert plan.peak_states <= math.ceil(math.log2(n)) + 1
        assert plan.advances <= n * math.ceil(math.log2(max(n, 2)))


def test_store_all_is_the_minimum_recomputation() -> None:
    for n in range(1, 50):
        plan = store_all(n)
        assert plan.advances == n - 1
        if n <= 6:
            assert exhaustive_min_advances(n, n) == n - 1
        assert plan.peak_slots == n - 1
        assert plan.fetch_order() == list(range(n)) + list(range(n - 2, -1, -1))


def test_sqrt_segments() -> None:
    for n in (1, 2, 3, 7, 10, 64, 100, 1000):
        plan = sqrt_segments(n)
        k = max(1, math.ceil(math.sqrt(n)))
        seg = math.ceil(n / k)
        assert plan.peak_states <= k + seg + 1
        # first sweep to the last segment, then each segment again but its last stage
        assert plan.advances <= 2 * (n - 1)
    assert sqrt_segments(1000).peak_states < 70 < store_all(1000).peak_states
    # the recursive variant trades recomputation for memory
    rec, flat = sqrt_segments(4096, recursive=True), sqrt_segments(4096)
    assert rec.peak_states < flat.peak_states and rec.advances > flat.advances

    def kept(n: int) -> int:  # the docstring's sqrt n + n^(1/4) + ...: its recursion, one input per level
        k = max(1, math.ceil(math.sqrt(n)))
        return 2 if n <= 2 else k + kept(math.ceil(n / k))

    for n in (16, 100, 1000, 10_000):  # found by review: the docstring said O(log n) memory
        rec = sqrt_segments(n, recursive=True)
        assert math.sqrt(n) <= rec.peak_slots <= kept(n), (n, rec.peak_slots, kept(n))
        assert rec.advances <= n * (math.log2(math.log2(n)) + 1), (n, rec.advances)
    with pytest.raises(PlanError, match="segments"):
        sqrt_segments(10, segments=11)


def test_simulate_rejects_invalid_plans() -> None:
    with pytest.raises(PlanError, match="current state is 1, not 0"):
        simulate(3, [(Op.ADVANCE, 0), (Op.ADVANCE, 0)])
    with pytest.raises(PlanError, match="not kept"):
        simulate(2, [(Op.RESTORE, 0)])
    with pytest.raises(PlanError, match="next stage to reverse is 1"):
        simulate(2, [(Op.BACKWARD, 0)])
    with pytest.raises(PlanError, match="not reversed"):
        simulate(2, [(Op.ADVANCE, 0), (Op.BACKWARD, 1)])
    with pytest.raises(PlanError, match="outside the chain"):
        simulate(2, [(Op.ADVANCE, 5)])


def test_peak_bytes_follow_state_sizes() -> None:
    sizes = [10, 20, 30, 40]
    sim = simulate(4, store_all(4).actions, state_bytes=sizes, tape_bytes=[5] * 4)
    assert sim.peak_bytes == 10 + 20 + 30 + 40 + 5  # all inputs kept + the last stage's tape
    low = simulate(4, revolve(4, 1).actions, state_bytes=sizes, tape_bytes=[5] * 4)
    assert low.peak_bytes < sim.peak_bytes


# ---- heterogeneous chains under a byte budget ---------------------------------------------------
from wstream.client.plans import StageCosts, min_budget, optimal, plan_time  # noqa: E402


def exhaustive_min_time(costs: StageCosts, budget: int) -> float:
    """Least recomputation time of any plan whose memory, as simulate() counts it, fits ``budget``."""
    x, tape = costs.state_bytes, costs.tape_bytes

    def fits(kept, cur, extra) -> bool:  # noqa: ANN001
        live = sum(x[k] for k in kept) + (x[cur] if cur is not None and cur not in kept else 0)
        if extra is not None:
            live += {"next": x, "tape": tape}.get(extra[0], [0] * costs.n)[extra[1]]
        return live <= budget

    return exhaustive_search(costs.n, costs.advance_cost, fits)


def random_chain(rng: random.Random, n: int) -> StageCosts:
    return StageCosts(
        forward_s=tuple(rng.choice([0.5, 1.0, 1.5, 3.0]) for _ in range(n)),
        state_bytes=tuple(rng.randint(1, 4) for _ in range(n)),
        tape_bytes=tuple(rng.randint(0, 3) for _ in range(n)),
        weight_bytes=tuple(rng.randint(0, 8) for _ in range(n)),
        bandwidth=4.0,
    )


def test_optimal_equals_exhaustive_search_on_random_chains() -> None:
    rng = random.Random(2026)
    checked = 0
    for _ in range(60):
        n = rng.randint(1, 6)
        costs = random_chain(rng, n)
        low = min_budget(costs)
        for budget in sorted({low, low + 1, low + 3, sum(costs.state_bytes) + max(costs.tape_bytes)}):
            plan = optimal(costs, budget, resolution=budget)  # unit of 1 byte: exact
            sim = simulate(n, plan.actions, state_bytes=costs.state_bytes, tape_bytes=costs.tape_bytes)
            assert sim.peak_bytes <= budget
            assert plan_time(costs, plan) == pytest.approx(exhaustive_min_time(costs, budget)), (costs, budget)
            checked += 1
    assert checked > 150


def test_min_budget_is_exact_and_refusals_name_it() -> None:
    rng = random.Random(7)
    for _ in range(40):
        costs = random_chain(rng, rng.randint(1, 6))
        low = min_budget(costs)
        assert exhaustive_min_time(costs, low) < math.inf
        assert exhaustive_min_time(costs, low - 1) == math.inf
        with pytest.raises(PlanError, match=f"least any plan needs is {low} bytes"):
            optimal(costs, low - 1)


def test_optimal_prefers_recomputing_cheap_stages() -> None:
    """Two stages cost 100x the others: the plan keeps their outputs instead of re-running them."""
    n = 12
    fwd = tuple(100.0 if i in (3, 8) else 1.0 for i in range(n))
    costs = StageCosts(forward_s=fwd, state_bytes=(1,) * n, tape_bytes=(0,) * n)
    plan = optimal(costs, 5, resolution=5)
    reruns = [i for op, i in plan.actions if op == Op.ADVANCE]
    assert reruns.count(3) == 1 and reruns.count(8) == 1  # only the unavoidable first pass
    uniform = optimal(StageCosts(forward_s=(1.0,) * n, state_bytes=(1,) * n, tape_bytes=(0,) * n), 5, resolution=5)
    assert plan_time(costs, plan) < plan_time(costs, uniform)


def test_weight_traffic_counts_in_the_cost() -> None:
    """With streamed weights a heavy stage is expensive to re-run even when its compute is cheap."""
    n = 8
    light = StageCosts(forward_s=(1.0,) * n, state_bytes=(1,) * n, tape_bytes=(0,) * n)
    heavy = StageCosts(
        forward_s=(1.0,) * n, state_bytes=(1,) * n, tape_bytes=(0,) * n,
        weight_bytes=tuple(1000 if i == 2 else 0 for i in range(n)), bandwidth=10.0,
    )
    plan = optimal(heavy, 4, resolution=4)
    assert [i for op, i in plan.actions if op == Op.ADVANCE].count(2) == 1
    # revolve with 2 slots fits the same 4 bytes but runs stage 2 twice
    other = revolve(n, 2)
    assert simulate(n, other.actions, state_bytes=heavy.state_bytes, tape_bytes=heavy.tape_bytes).peak_bytes <= 4
    assert [i for op, i in other.actions if op == Op.ADVANCE].count(2) == 2
    assert plan_time(light, optimal(light, 4, resolution=4)) <= plan_time(light, other)
    assert plan_time(heavy, plan) < plan_time(heavy, other)


from wstream.client.plans import min_peak, segments_plan  # noqa: E402


def test_min_peak_equals_exhaustive_search_over_checkpoint_subsets() -> None:
    import itertools

    rng = random.Random(99)
    for _ in range(80):
        n = rng.randint(1, 9)
        costs = random_chain(rng, n)

        def peak(plan) -> int:  # noqa: ANN001
            return simulate(n, plan.actions, state_bytes=costs.state_bytes, tape_bytes=costs.tape_bytes).peak_bytes

        brute = min(
            peak(segments_plan(n, [0, *rest]))
            for r in range(n)
            for rest in itertools.combinations(range(1, n), r)
        )
        assert peak(min_peak(costs)) == brute, costs


def test_min_peak_keeps_few_inputs_on_uniform_chains() -> None:
    n = 100
    costs = StageCosts(forward_s=(1.0,) * n, state_bytes=(1,) * n, tape_bytes=(1,) * n)
    plan = min_peak(costs)
    peak = simulate(n, plan.actions, state_bytes=costs.state_bytes, tape_bytes=costs.tape_bytes).peak_bytes
    store = simulate(n, store_all(n).actions, state_bytes=costs.state_bytes, tape_bytes=costs.tape_bytes).peak_bytes
    assert peak <= 2 * math.isqrt(n) + 2 < store  # the sqrt(n) shape, found by the DP


def test_auto_picks_the_fastest_plan_that_fits() -> None:
    from wstream.client.plans import auto

    rng = random.Random(5)
    for _ in range(30):
        n = rng.randint(1, 12)
        costs = random_chain(rng, n)
        low = min_budget(costs)
        for budget in (low, low + 4, 10**6):
            plan = auto(costs, budget)
            sim = simulate(n, plan.actions, state_bytes=costs.state_bytes, tape_bytes=costs.tape_bytes)
            assert sim.peak_bytes <= budget
            assert plan.name.startswith("auto(")
            if budget == 10**6:  # everything fits: nothing beats keeping every input
                assert plan_time(costs, plan) == pytest.approx(plan_time(costs, store_all(n)))
            if n <= 6:  # and never slower than the proven optimum (it is among the candidates)
                assert plan_time(costs, plan) == pytest.approx(exhaustive_min_time(costs, budget))


def test_offload_overhead_is_constant_in_n_and_device_memory_bounded() -> None:
    from wstream.client.plans import offload, offload_spacing

    per_stage = []
    for n in (64, 256, 1024, 4096):
        costs = StageCosts(forward_s=(1.0,) * n, state_bytes=(4,) * n, tape_bytes=(4,) * n)
        assert offload_spacing(costs, bandwidth=1.0) == 4  # a 4-byte copy takes 4 stages
        plan = offload(costs, 32, 1.0)
        sim = simulate(n, plan.actions, state_bytes=costs.state_bytes, tape_bytes=costs.tape_bytes)
        assert sim.peak_bytes <= 32  # the device budget, whatever n
        assert sim.peak_host_bytes == 4 * (math.ceil(n / 4) - 1)  # every 4th input on the host but the last segment's
        per_stage.append(plan.advances / n)
    assert max(per_stage) <= 2.0  # bounded by a constant (k = 4, 4 device slots) ...
    assert max(per_stage[1:]) - min(per_stage[1:]) < 0.02  # ... and flat in n past the edge effect
    # a faster link offloads more often and recomputes less
    costs = StageCosts(forward_s=(1.0,) * 256, state_bytes=(4,) * 256, tape_bytes=(4,) * 256)
    assert offload(costs, 32, 4.0).advances < offload(costs, 32, 1.0).advances
    with pytest.raises(PlanError, match="needs at least 16 bytes"):
        offload(costs, 15, 1.0)


def test_offload_reads_back_every_input_it_offloads() -> None:
    """The last segment's start stays on the device (its reversal comes first): a copy to the host
    that is never read back would be a wasted transfer and host memory every step."""
    from wstream.client.plans import Op, offload

    for n in (1, 2, 3, 5, 8, 13):
        costs = StageCosts(forward_s=(1.0,) * n, state_bytes=(4,) * n, tape_bytes=(4,) * n)
        for k in range(1, n + 2):
            plan = offload(costs, 10**6, spacing=k)
            offloaded = [i for op, i in plan.actions if op == Op.OFFLOAD]
            prefetched = [i for op, i in plan.actions if op == Op.PREFETCH]
            freed = [i for op, i in plan.actions if op == Op.FREE_HOST]
            assert sorted(offloaded) == sorted(prefetched) == sorted(freed), (n, k)
            assert offloaded == list(range(0, n, k))[:-1]
            sim = simulate(n, plan.actions, state_bytes=costs.state_bytes, tape_bytes=costs.tape_bytes)
            assert sim.peak_host_bytes == 4 * len(offloaded)


def test_auto_never_offloads_where_the_host_is_the_device() -> None:
    """On a CPU worker an offloaded input is a second copy in the same memory, which the budget
    does not count: ``auto`` must choose among the plans that keep within it."""
    from wstream.client.plans import auto

    n = 256
    costs = StageCosts(forward_s=(1.0,) * n, state_bytes=(4,) * n, tape_bytes=(4,) * n, host_bandwidth=4.0)
    assert auto(costs, 24).name == "auto(offload)"
    same_memory = dataclasses.replace(costs, host_is_device=True)
    assert same_memory.for_micro_batches(2).host_is_device
    assert auto(same_memory, 24).name != "auto(offload)"


def test_offload_prices_weight_fetches_and_fits_its_budget_on_random_chains() -> None:
    from wstream.client.plans import offload

    rng = random.Random(7)
    cheaper = 0
    for _ in range(40):
        n = rng.randint(2, 40)
        fwd = tuple(rng.choice((1.0, 2.0, 3.0)) for _ in range(n))
        xs = tuple(rng.choice((2, 4)) for _ in range(n))
        tapes = tuple(rng.choice((2, 4)) for _ in range(n))
        weights = tuple(rng.choice((0, 0, 40)) for _ in range(n))  # some stages cost a big fetch
        priced = StageCosts(forward_s=fwd, state_bytes=xs, tape_bytes=tapes, weight_bytes=weights, bandwidth=4.0)
        blind = StageCosts(forward_s=fwd, state_bytes=xs, tape_bytes=tapes)
        budget = rng.randint(14, 24)  # tight: segments must recompute
        k = rng.randint(2, 10)
        try:
            plan = offload(priced, budget, spacing=k)
        except PlanError as exc:
            assert "needs at least" in str(exc)
            continue
        sim = simulate(n, plan.actions, state_bytes=xs, tape_bytes=tapes)
        assert sim.peak_bytes <= budget
        # counting fetches never makes the plan slower under the costs that include them ...
        blind_time = plan_time(priced, offload(blind, budget, spacing=k))
        assert plan_time(priced, plan) <= blind_time + 1e-9
        cheaper += plan_time(priced, plan) < blind_time - 1e-9
    assert cheaper >= 5  # ... and often makes it faster (a planner blind to fetches would tie)


def test_auto_takes_offload_when_host_memory_makes_a_tight_budget_cheaper() -> None:
    from wstream.client.plans import auto

    n = 256
    costs = StageCosts(forward_s=(1.0,) * n, state_bytes=(4,) * n, tape_bytes=(4,) * n, host_bandwidth=4.0)
    plan = auto(costs, 24)  # room for a handful of inputs: in-device plans recompute a lot
    assert plan.name == "auto(offload)"
    blind = auto(StageCosts(forward_s=(1.0,) * n, state_bytes=(4,) * n, tape_bytes=(4,) * n), 24)
    assert plan_time(costs, plan) < plan_time(costs, blind)  # the best without host memory is slower
    assert simulate(n, plan.actions, state_bytes=costs.state_bytes, tape_bytes=costs.tape_bytes).peak_bytes <= 24
