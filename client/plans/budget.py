"""Byte-budget planners: plans for a profiled chain (:class:`~.costs.StageCosts`) whose activation
memory must stay within a number of bytes.

``min_budget`` (the least memory any plan needs), ``optimal`` (least recomputation time within a
budget: exhaustive search for short chains, the nested-schedule DP of :mod:`.nested` beyond), ``min_peak`` (the kept subset of least peak memory), ``offload``
(asynchronous multistage checkpointing to host memory, with ``offload_spacing``) and ``auto``
(the fastest plan of every planner's that fits). Separate from :mod:`.schedules` because these
read a profile of the stages' sizes and times, not only their number.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from collections.abc import Iterator

from .costs import StageCosts, plan_time
from .nested import nested_plan
from .plan import Action, Op, Plan, PlanError
from .schedules import divide_and_conquer, revolve, segments_plan, sqrt_segments, store_all
from .search import SEARCH_STAGES, exhaustive_plan
from .simulate import checked_plan, simulate


def min_budget(costs: StageCosts) -> int:
    """The least activation memory any plan needs: x_0 stays live throughout (it cannot be
    recomputed), each x_{j+1} is computed from x_j at least once, and each backward needs x_i
    and its tape. Keeping only x_0 and recomputing from it reaches this bound."""
    return _reverse_need(costs, 0, costs.n)


def optimal(costs: StageCosts, budget_bytes: int, *, resolution: int | None = None) -> Plan:
    """The plan of least recomputation time whose activation memory stays within ``budget_bytes``
    (cost and memory as :func:`~.simulate.simulate` counts them: kept inputs + the current one +
    the next one while advancing or the tape while reversing; cost = the sum over ADVANCEs of
    ``StageCosts.advance_cost``, forward seconds plus weight bytes / bandwidth).

    What it is the least over (DESIGN.md "Checkpoint plans"):

    * n <= ``SEARCH_STAGES`` (8): every schedule the executor runs, by exhaustive search
      (:func:`~.search.exhaustive_plan`, exact bytes);
    * n <= ``FLAT_STAGES`` (36): every *nested* schedule (NOTE [Nested schedules] in
      :mod:`.nested`): persistent ones (Revolve; the DP of Beaumont et al., "Optimal
      checkpointing for heterogeneous chains") and those that free a kept input before its
      stage is reversed and recompute it later. O(n^4 * L) time for L = ``resolution`` + 1
      memory levels per state (None: 256, up to 4,096 on short chains), exact when the budget spans at most ``resolution`` gcds of the
      sizes above a state's least memory (else a plan at budget B is at least as cheap as the
      best nested one at B less a few grid steps);
    * longer chains: nested schedules in which, while a block of consecutive stages is reversed
      from its first input, the other kept inputs are block starts (blocks of blocks likewise,
      at most 36 units in the top DP): about 3-6 s at n = 1,000 and 30 s at 10,000 on a
      2-core machine (BENCHMARKS.md).

    Never refuses a budget of at least :func:`min_budget` (x_0 alone reversing the chain is in
    every class above)."""
    need = min_budget(costs)
    if budget_bytes < need:
        raise PlanError(
            f"a budget of {budget_bytes} bytes cannot hold this chain: the least any plan needs is "
            f"{need} bytes (x_0, one stage's input and output, and its tape)"
        )
    n = costs.n
    with _deep_recursion(n):
        actions, cost = nested_plan(costs, budget_bytes, resolution=resolution)
    if n <= SEARCH_STAGES:
        found = exhaustive_plan(costs, budget_bytes, bound=cost)
        if found is not None and found[1] < cost:
            actions = found[0]
    sim = simulate(n, actions, state_bytes=costs.state_bytes, tape_bytes=costs.tape_bytes)
    if sim.peak_bytes > budget_bytes:
        raise AssertionError(f"optimal's plan peaks at {sim.peak_bytes} > {budget_bytes} bytes: a bug in wstream")
    return checked_plan("optimal", n, actions)


@contextlib.contextmanager
def _deep_recursion(n: int) -> Iterator[None]:
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 10 * n + 1000))
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


# ---- the checkpoint subset of least peak memory --------------------------------------------------
def min_peak(costs: StageCosts) -> Plan:
    """The checkpoint subset whose plan (:func:`segments_plan`) has the least peak activation
    memory, by an O(n^2) dynamic program over the next kept input (after Hong et al., 2025).

    With K_j the bytes kept before segment j = [a, b), reversing it peaks at
    K_j + max_i (x_{a+1} + .. + x_i + tape_i) over i in [a, b), and the forward sweep through it at
    K_j + x_j + x_{j+1} (x_a not counted twice); G(p) = x_p + min_q max(peak of [p, q), G(q))."""
    n, x, tape = costs.n, costs.state_bytes, costs.tape_bytes
    inf = math.inf
    g: list[float] = [inf] * (n + 1)
    nxt: list[int] = [n] * (n + 1)
    for p in range(n - 1, -1, -1):
        best_val, best_q = inf, n
        inner = 0  # x_{p+1} + .. + x_{q-1}
        seg = 0  # max over i in [p, q) of (x_{p+1} + .. + x_i + tape_i)
        fwd = 0  # max over j in [p, q-1) of the forward sweep's x_j + x_{j+1} (x_p is kept)
        for q in range(p + 1, n + 1):
            i = q - 1
            seg = max(seg, inner + (x[i] if i > p else 0) + tape[i])
            inner += x[i] if i > p else 0
            if q == n:
                val = seg
            else:
                fwd = max(fwd, (x[i] if i > p else 0) + x[q])
                val = max(seg, fwd, g[q])
            if val < best_val:
                best_val, best_q = val, q
        g[p] = x[p] + best_val
        nxt[p] = best_q
    bounds = [0]
    while nxt[bounds[-1]] < n:
        bounds.append(nxt[bounds[-1]])
    return segments_plan(n, bounds, "min_peak")


def auto(costs: StageCosts, budget_bytes: int) -> Plan:
    """The fastest plan, by the cost model, among every planner's whose activation memory fits
    ``budget_bytes`` (checked exactly with :func:`simulate`), ``offload`` included when the costs
    give a host bandwidth and the host is not the device. Named ``auto(<chosen>)``."""
    n = costs.n
    need = min_budget(costs)
    if budget_bytes < need:
        raise PlanError(f"a budget of {budget_bytes} bytes cannot hold this chain: the least any plan needs is {need} bytes")
    candidates = [store_all(n), sqrt_segments(n), sqrt_segments(n, recursive=True), divide_and_conquer(n), min_peak(costs)]
    candidates += [revolve(n, k) for k in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if k < n]
    candidates.append(optimal(costs, budget_bytes))  # never refuses a budget >= need
    if costs.host_bandwidth > 0 and not costs.host_is_device:  # host memory is there too: its copies run beside compute
        try:
            candidates.append(offload(costs, budget_bytes))
        except PlanError:
            pass
    fits = []
    for plan in candidates:
        peak = simulate(n, plan.actions, state_bytes=costs.state_bytes, tape_bytes=costs.tape_bytes).peak_bytes
        if peak <= budget_bytes:
            fits.append((plan_time(costs, plan), plan.advances, peak, plan.name, plan))
    if not fits:
        raise PlanError(f"no plan fits {budget_bytes} bytes (the least any plan needs is {need} bytes)")
    best = min(fits, key=lambda f: f[:4])[-1]
    return Plan(f"auto({best.name})", n, best.actions, best.advances, best.peak_slots, best.peak_states)


# ---- asynchronous multistage checkpointing: offload to host memory --------------------------------
def offload_spacing(costs: StageCosts, bandwidth: float) -> int:
    """The smallest k such that copying one stage input to the host (at ``bandwidth`` bytes/s)
    takes no longer than running k stages (each the longer of its forward and its weight fetch):
    offloading every k-th input keeps up with compute."""
    if bandwidth <= 0:
        raise PlanError(f"offload needs a host transfer bandwidth > 0 bytes/s, got {bandwidth}")
    per_stage = sum(max(costs.forward_s[i], costs.advance_cost(i) - costs.forward_s[i]) for i in range(costs.n))
    per_stage /= costs.n
    copy = max(costs.state_bytes) / bandwidth
    return max(1, math.ceil(copy / per_stage - 1e-9)) if per_stage > 0 else 1


def _reverse_need(costs: StageCosts, a: int, b: int) -> int:
    """The least memory that reverses the sub-chain [a, b) from a kept x_a (see :func:`min_budget`)."""
    x, tape = costs.state_bytes, costs.tape_bytes
    need = x[a] + tape[a] if b - a == 1 else max(x[a] + tape[a], x[a] + x[a + 1])
    for j in range(a + 1, b):
        need = max(need, x[a] + x[j] + tape[j])
        if j + 1 < b:
            need = max(need, x[a] + x[j] + x[j + 1])
    return need


def offload(
    costs: StageCosts,
    budget_bytes: int,
    bandwidth: float | None = None,
    *,
    spacing: int | None = None,
    resolution: int | None = None,
) -> Plan:
    """Asynchronous multistage checkpointing (after Kukreja, Hueckelheim and Gorman, 2018).

    Forward: one sweep that offloads every ``spacing``-th input to host memory (by default as
    often as the transfer keeps up with compute: :func:`offload_spacing`), but the last segment's
    start, which is reversed first and stays on the device. Backward: segment by
    segment from the last, the next segment's start is prefetched ahead while the current one is
    reversed in the device memory the budget leaves, by the dynamic program of :func:`optimal`
    (least recomputation time over nested schedules, weight fetches included; on equal stages it
    recomputes as Revolve does, or less). Recomputation per stage depends on the spacing and the budget only, so it is the same
    for any n."""
    n = costs.n
    bw = bandwidth if bandwidth is not None else costs.host_bandwidth
    k = spacing if spacing is not None else offload_spacing(costs, bw)
    if k < 1:
        raise PlanError(f"spacing must be >= 1, got {k}")
    starts = list(range(0, n, k))
    ends = [*starts[1:], n]
    x = costs.state_bytes
    # device memory: during the forward sweep the current and next inputs and the source of an
    # offload still copying; in backward a segment's reversal plus the next start arriving
    need = max(x[i] + x[i + 1] + x[s] for s, e in zip(starts, ends) for i in range(s, min(e, n - 1))) if n > 1 else 0
    for j, (s0, e0) in enumerate(zip(starts, ends)):
        need = max(need, _reverse_need(costs, s0, e0) + (x[starts[j - 1]] if j > 0 else 0))
    if budget_bytes < need:
        raise PlanError(
            f"a budget of {budget_bytes} bytes cannot hold the offload plan: it needs at least {need} bytes "
            "(a segment's start, the current input and the next or a tape, and the next segment's start)"
        )
    segments: dict[tuple[StageCosts, int], list[Action]] = {}  # equal segments are planned once

    def reverse(s0: int, e0: int, mem: int) -> list[Action]:
        """Segment [s0, e0) reversed by optimal's DP from the kept x_{s0}, which it frees."""
        sub = dataclasses.replace(
            costs,
            forward_s=costs.forward_s[s0:e0],
            state_bytes=costs.state_bytes[s0:e0],
            tape_bytes=costs.tape_bytes[s0:e0],
            weight_bytes=costs.weight_bytes[s0:e0] if costs.weight_bytes else (),
        )
        key = (sub, mem)
        if key not in segments:
            segments[key] = nested_plan(sub, mem, resolution=resolution)[0][1:]  # x_{s0} is kept already
        return [(op, i + s0) for op, i in segments[key]]

    actions: list[Action] = []
    last = len(starts) - 1
    for j, s0 in enumerate(starts[:last]):  # the forward sweep, offloading segment starts
        actions.append((Op.OFFLOAD, s0))
        actions.extend((Op.ADVANCE, i) for i in range(s0, ends[j]))
    actions.append((Op.SNAPSHOT, starts[last]))  # reversed first: kept on the device, never offloaded
    with _deep_recursion(k):
        for j in range(last, -1, -1):
            s0, e0 = starts[j], ends[j]
            mem = budget_bytes
            if j > 0:
                actions.append((Op.PREFETCH, starts[j - 1]))  # overlaps this segment's reversal
                mem -= x[starts[j - 1]]
            actions += reverse(s0, e0, mem)  # mem >= the segment's need: checked above
            if j < last:
                actions.append((Op.FREE_HOST, s0))
            if j > 0:
                actions.append((Op.RESTORE, starts[j - 1]))
    return checked_plan("offload", n, actions)

