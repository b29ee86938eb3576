"""Checkpoint plans: recomputation and peak memory against depth, and step time against theory.

Part 1 (no training): for chains of n = 10 .. 100,000 equal tiny stages, every planner's
recomputed forwards and peak live stage inputs, as a table and a plot (bench/out/plans.png).
Part 2 (training on this CPU): step time of each plan over store_all on a chain whose stages are
big enough to time, next to the ratio the plan's forward/backward counts predict
(forward = 1, backward = 2 units; every BACKWARD re-runs its stage with autograd).

    python bench/plans.py [--max-n 100000] [--stages 16] [--width 768] [--steps 4] [--budget-mib 16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from common import machine, parse_args, server
from wstream.client import AdamW, Client
from wstream.client.plans import (
    StageCosts,
    divide_and_conquer,
    min_peak,
    offload,
    optimal,
    revolve,
    simulate,
    sqrt_segments,
    store_all,
)


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
        "optimal(12 B)": (lambda n: optimal(uniform(n), 12), 100),
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
    args = parse_args(p, smoke=dict(max_n=100, stages=4, width=32, batch=8, steps=1, budget_mib=1))
    print(f"machine: {machine()}")
    rows = depth_table(args.max_n)
    path = plot(rows)
    if path:
        print(f"plot: {path}")
    timed_steps(args)


if __name__ == "__main__":
    main()
