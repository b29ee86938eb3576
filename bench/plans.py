"""Checkpoint plans: recomputation and peak memory against depth, ``optimal``'s planner time and
losses, and step time against theory.

Part 1 (no training): for chains of n = 10 .. 100,000 equal tiny stages, every planner's
recomputed forwards and peak live stage inputs, as a table and a plot (bench/out/plans.png).
Part 2 (no training; ``--part planner`` alone): ``optimal`` on heterogeneous chains: planner time
at n = 100, 1,000, 10,000 for a few budgets, its cost against the count-based planners; the
rounding loss of its memory grid (against exact bytes); what blocks lose on long chains; what
freeing a checkpoint early gains over persistent schedules.
Part 3 (training on this CPU): step time of each plan over store_all on a chain whose stages are
big enough to time, next to the ratio the plan's forward/backward counts predict
(forward = 1, backward = 2 units; every BACKWARD re-runs its stage with autograd).

    python bench/plans.py [--part all|depth|planner|training] [--max-n 100000]
        [--planner-ns 100,1000,10000] [--stages 16] [--width 768] [--steps 4] [--budget-mib 16]
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from common import machine, parse_args, server
from wstream.client import AdamW, Client
import random

import wstream.client.plans.nested as nested
from wstream.client.plans import (
    StageCosts,
    divide_and_conquer,
    min_budget,
    min_peak,
    offload,
    optimal,
    plan_time,
    revolve,
    revolve_cost,
    simulate,
    sqrt_segments,
    store_all,
)
from wstream.client.plans.nested import nested_plan
from wstream.client.plans.search import exhaustive_plan


def uniform(n: int) -> StageCosts:
    """n equal tiny stages: unit time, unit input, unit tape (for the cost-based planners)."""
    return StageCosts(forward_s=(1.0,) * n, state_bytes=(1,) * n, tape_bytes=(1,) * n)

OUT = Path(__file__).parent / "out"


def depth_table(max_n: int) -> dict[str, list[tuple[int, int, int]]]:
    ns = [n for n in (10, 30, 100, 300, 1000, 3000, 10_000, 30_000, 100_000) if n <= max_n]
    # (planner, largest n it is run at: the DPs are O(n^2) and O(n^3 * units) in Python)
    planners = {
        "store_all": (store_all, None),
        "sqrt": (sqrt_segments, None),
        "dnc": (divide_and_conquer, None),
        "revolve(8)": (lambda n: revolve(n, 8), None),
        "min_peak": (lambda n: min_peak(uniform(n)), 3000),
        "optimal(12 B)": (lambda n: optimal(uniform(n), 12), 1000),
        "offload(12 B, k=4)": (lambda n: offload(uniform(n), 12, 0.25), None),
    }
    rows: dict[str, list[tuple[int, int, int]]] = {name: [] for name in planners}
    print("recomputed forwards / peak live stage inputs; offload also keeps n/4 inputs in host memory")
    print(f"{'n':>8} " + " ".join(f"{name:>24}" for name in planners))
    for n in ns:
        cells = []
        for name, (plan_of, limit) in planners.items():
            if limit is not None and n > limit:
                cells.append(f"{'-':>24}")
                continue
            plan = plan_of(n)
            peak = simulate(n, plan.actions).peak_states
            rows[name].append((n, plan.advances, peak))
            cells.append(f"{plan.advances:>14,} / {peak:>7,}")
        print(f"{n:>8,} " + " ".join(cells))
    return rows


def plot(rows: dict[str, list[tuple[int, int, int]]]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: pip install -e '.[bench]' for the plot)")
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, pts in rows.items():
        ns = [p[0] for p in pts]
        a.loglog(ns, [p[2] for p in pts], marker="o", label=name)
        b.loglog(ns, [max(p[1], 1) / p[0] for p in pts], marker="o", label=name)
    a.set(xlabel="stages n", ylabel="peak live stage inputs", title="activation memory")
    b.set(xlabel="stages n", ylabel="recomputed forwards / n", title="recomputation per stage")
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    OUT.mkdir(exist_ok=True)
    path = OUT / "plans.png"
    fig.savefig(path, dpi=110)
    return path


# ---- part 2: optimal's planner time and losses -------------------------------------------------
MIB = 1 << 20


def hetero(n: int, seed: int) -> StageCosts:
    """n stages of random forward time (0.5-2 s), input (1-4 MiB) and tape (1-8 MiB) sizes, in
    bytes of no common divisor (so the memory grid is never exact)."""
    rng = random.Random(seed)
    return StageCosts(
        forward_s=tuple(rng.uniform(0.5, 2.0) for _ in range(n)),
        state_bytes=tuple(rng.randint(MIB, 4 * MIB) | 1 for _ in range(n)),
        tape_bytes=tuple(rng.randint(MIB, 8 * MIB) for _ in range(n)),
    )


def peak(costs: StageCosts, plan) -> int:  # noqa: ANN001
    return simulate(costs.n, plan.actions, state_bytes=costs.state_bytes, tape_bytes=costs.tape_bytes).peak_bytes


def best_count_based(costs: StageCosts, budget: int) -> tuple[float, str]:
    """The cheapest plan of the planners that ignore sizes, among those that fit."""
    n = costs.n
    plans = [store_all(n), sqrt_segments(n), sqrt_segments(n, recursive=True), divide_and_conquer(n)]
    # (revolve with few slots on a long chain is tens of millions of actions: not built past 100 n)
    plans += [revolve(n, k) for k in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if k < n and revolve_cost(n, k) <= 100 * n]
    fits = [(plan_time(costs, p), p.name if p.name != "revolve" else f"revolve({p.peak_slots})") for p in plans
            if peak(costs, p) <= budget]
    return min(fits) if fits else (math.inf, "-")


def planner_times(ns: list[int]) -> None:
    print("\noptimal on heterogeneous chains (hetero(n)): planner time, cost / least possible cost"
          " (each stage once), and the best count-based plan that fits")
    print(f"{'n':>7} {'budget':>14} {'time s':>7} {'optimal':>8} {'best other':>22}")
    for n in ns:
        costs = hetero(n, n)
        low, top = min_budget(costs), peak(costs, store_all(n))
        least = plan_time(costs, store_all(n))
        budgets = [("min", low), ("min+2%", low + (top - low) // 50), ("min+10%", low + (top - low) // 10),
                   ("min+30%", low + 3 * (top - low) // 10)]
        for label, budget in budgets[n > 2000 :]:  # at the least budget a long chain's plan is ~n^2/2 advances
            t0 = time.perf_counter()
            plan = optimal(costs, budget)
            took = time.perf_counter() - t0
            assert peak(costs, plan) <= budget
            other, name = best_count_based(costs, budget)
            print(f"{n:>7,} {label:>14} {took:>7.2f} {plan_time(costs, plan) / least:>8.2f} "
                  f"{other / least:>12.2f} {name:>9}", flush=True)


def rounding_loss(chains: int) -> None:
    """The memory grid's loss: plan cost / the exact optimum, sizes of no common divisor."""
    print("\nrounding loss of the memory grid: cost / exact optimum, sizes of no common divisor")
    rng = random.Random(256)
    rows: dict[str, list[float]] = {}
    for _ in range(chains):
        n = rng.choice((4, 6, 8))  # exact: every schedule, by exhaustive search in bytes
        xs = tuple(rng.randint(10_000, 1_000_000) | 1 for _ in range(n))
        costs = StageCosts(tuple(rng.uniform(0.5, 2) for _ in range(n)), xs, tuple(rng.randint(0, 2_000_000) for _ in range(n)))
        low, top = min_budget(costs), peak(costs, store_all(n))
        for label, budget in (("at min_budget", low), ("+1% of the range", low + (top - low) // 100),
                              ("random budget", rng.randint(low, top))):
            found = exhaustive_plan(costs, budget)
            assert found is not None
            for name, res in (("DP, 256 levels", 256), ("DP, default levels", None)):
                rows.setdefault(f"n 4-8, {name}, {label}", []).append(nested_plan(costs, budget, resolution=res)[1] / found[1])
            rows.setdefault(f"n 4-8, optimal, {label}", []).append(plan_time(costs, optimal(costs, budget)) / found[1])
    for _ in range(max(1, chains // 3)):  # exact: the DP with a grid of one byte (sizes of hundreds)
        m = 16
        xs = tuple(rng.randint(100, 600) | 1 for _ in range(m))
        costs = StageCosts(tuple(rng.uniform(0.5, 2) for _ in range(m)), xs, tuple(rng.randint(0, 1200) for _ in range(m)))
        low, top = min_budget(costs), peak(costs, store_all(m))
        budget = rng.randint(low, low + (top - low) // 2)
        _, exact = nested_plan(costs, budget, resolution=10**6)
        for name, res in (("DP, 64 levels", 64), ("DP, 256 levels", 256), ("optimal (1,640 levels)", None)):
            rows.setdefault(f"n 16, {name}, random budget", []).append(nested_plan(costs, budget, resolution=res)[1] / exact)
    print(f"{'chains':<50} {'cases':>5} {'median':>7} {'90th':>7} {'worst':>7} {'exact':>6}")
    for label, r in rows.items():
        r.sort()
        print(f"{label:<50} {len(r):>5} {statistics.median(r):>7.4f} {r[int(0.9 * (len(r) - 1))]:>7.4f} {r[-1]:>7.4f}"
              f" {sum(v < 1 + 1e-9 for v in r) / len(r):>6.0%}")


def persistent_cost(costs: StageCosts, budget: int) -> float:
    """The least cost of a persistent schedule (every kept input kept until its own stage is
    reversed; the DP optimal had before issue 18), exact bytes: reverse [a, b) from the kept x_a
    directly (b = a + 1) or advance to k, keep x_k, reverse [k, b) beside x_a, then [a, k)."""
    x, tape = costs.state_bytes, costs.tape_bytes
    pre = [0.0]
    for i in range(costs.n):
        pre.append(pre[-1] + costs.advance_cost(i))

    @functools.lru_cache(maxsize=None)
    def best(a: int, b: int, mem: int) -> float:
        if b - a == 1:
            return 0.0 if x[a] + tape[a] <= mem else math.inf
        out, peak = math.inf, x[a] + x[a + 1]
        for k in range(a + 1, b):
            if k > a + 1:
                peak = max(peak, x[a] + x[k - 1] + x[k])
            if peak > mem:
                break
            out = min(out, pre[k] - pre[a] + best(k, b, mem - x[a]) + best(a, k, mem))
        return out

    return best(0, costs.n, budget)


def class_losses(chains: int, long_n: int) -> None:
    """What blocks lose against the DP over every stage, and what freeing a checkpoint before its
    stage gains over persistent schedules (both exact: small sizes, one-byte grid)."""
    rng = random.Random(36)
    blocks: list[float] = []
    gains: list[float] = []
    for _ in range(chains):
        n = long_n
        xs = tuple(rng.randint(1, 8) for _ in range(n))
        costs = StageCosts(tuple(rng.uniform(0.5, 2) for _ in range(n)), xs, tuple(rng.randint(0, 16) for _ in range(n)))
        low, top = min_budget(costs), peak(costs, store_all(n))
        budget = rng.randint(low, low + (top - low) // 3)
        _, production = nested_plan(costs, budget)  # n > FLAT_STAGES: blocks
        old = nested.FLAT_STAGES
        nested.FLAT_STAGES = n
        try:
            _, flat = nested_plan(costs, budget)
        finally:
            nested.FLAT_STAGES = old
        blocks.append(production / flat)
        m = 16
        sub = StageCosts(costs.forward_s[:m], costs.state_bytes[:m], costs.tape_bytes[:m])
        lo2, top2 = min_budget(sub), peak(sub, store_all(m))
        b2 = rng.randint(lo2, lo2 + (top2 - lo2) // 3)
        pers = persistent_cost(sub, b2)
        _, nest = nested_plan(sub, b2)
        gains.append(nest / pers)
    for label, r in ((f"blocks at n = {long_n} / every stage", blocks), ("nested / persistent, n = 16", gains)):
        r.sort()
        print(f"{label:<40} {len(r):>4} chains: median {statistics.median(r):.3f}, best {r[0]:.3f}, worst {r[-1]:.3f}")


def planner_part(args: argparse.Namespace) -> None:
    if args.planner_ns:
        planner_times([int(v) for v in args.planner_ns.split(",")])
    rounding_loss(args.loss_chains)
    print("\nclass losses (budgets between min_budget and a third of the way to store_all's peak):")
    class_losses(max(1, args.loss_chains // 5), args.long_n)


def units(plan) -> int:  # noqa: ANN001
    return plan.advances + plan.n + 2 * plan.n


def timed_steps(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    width, n = args.width, args.stages

    def stages() -> list[nn.Module]:
        torch.manual_seed(0)
        return [nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)) for _ in range(n)]

    x, y = torch.randn(args.batch, width), torch.randn(args.batch, width)
    budget = f"{args.budget_mib}MiB"
    cases = [
        ("store_all", {}),
        ("sqrt", {}),
        ("dnc", {}),
        ("revolve", {"slots": 4}),
        ("revolve", {"slots": 2}),
        ("min_peak", {}),
        ("optimal", {"memory_budget": budget}),
        ("auto", {"memory_budget": budget}),
        ("offload", {"memory_budget": budget}),
    ]
    with server("--memory-limit", "16GiB") as address, Client(address) as client:
        trainers = []
        for k, (schedule, kw) in enumerate(cases):
            job = client.create_job(f"plan{k}", stages(), optimizer=AdamW(lr=1e-4), token="b")
            trainers.append(job.trainer(schedule=schedule, **kw))
        times: list[list[float]] = [[] for _ in cases]
        for tr in trainers:
            tr.step(x, y, torch.nn.functional.mse_loss)  # warm-up (and the profiling pass)
        for _ in range(args.steps):  # interleaved, so drift hits every plan alike
            for k, tr in enumerate(trainers):
                t0 = time.perf_counter()
                tr.step(x, y, torch.nn.functional.mse_loss)
                times[k].append(time.perf_counter() - t0)
        base = statistics.median(times[0])
        base_units = units(trainers[0].plan)
        print(f"\n{n} stages of width {width}, batch {args.batch}: store_all {base * 1e3:.0f} ms/step")
        print(f"{'plan':<22} {'recomputed':>10} {'peak states':>11} {'act. MiB':>8} {'measured':>9} {'theory':>7} {'off by':>7}")
        for (schedule, kw), tr, ts in zip(cases, trainers, times):
            label = tr.plan.name + (f"({kw['slots']})" if "slots" in kw else "")
            label += f" <= {args.budget_mib} MiB" if "memory_budget" in kw else ""
            measured = statistics.median(ts) / base
            theory = units(tr.plan) / base_units
            mib = tr.plan_summary()["peak_activation_bytes_measured"] / 2**20
            print(
                f"{label:<22} {tr.plan.advances:>10} {tr.plan.peak_states:>11} {mib:>8.1f} {measured:>9.2f} "
                f"{theory:>7.2f} {(measured / theory - 1) * 100:>+6.1f}%"
            )
        for tr in trainers:
            tr.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-n", type=int, default=100_000)
    p.add_argument("--stages", type=int, default=16)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--budget-mib", type=int, default=16, help="memory budget of the budgeted schedules")
    p.add_argument("--part", choices=("all", "depth", "planner", "training"), default="all")
    p.add_argument("--planner-ns", default="100,1000,10000", help="chain lengths of optimal's planner times")
    p.add_argument("--loss-chains", type=int, default=60, help="random chains per rounding-loss row")
    p.add_argument("--long-n", type=int, default=48, help="chain length of the blocks-against-flat comparison")
    args = parse_args(
        p,
        smoke=dict(max_n=100, stages=4, width=32, batch=8, steps=1, budget_mib=1, planner_ns="40,60", loss_chains=3,
                   long_n=38),
    )
    print(f"machine: {machine()}")
    if args.part in ("all", "depth"):
        rows = depth_table(args.max_n)
        path = plot(rows)
        if path:
            print(f"plot: {path}")
    if args.part in ("all", "planner"):
        planner_part(args)
    if args.part in ("all", "training"):
        timed_steps(args)


if __name__ == "__main__":
    main()
