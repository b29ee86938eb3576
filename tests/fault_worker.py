"""A worker that signals itself at one chosen point of one step: for the step-commit tests.

Usage: python fault_worker.py ADDRESS JOBS TOKEN MODEL STEPS OUT.json [--at KIND:K --in-step S]
       [--signal KILL|STOP] [--world-size W]

JOBS: one job name, or several separated by commas, trained to STEPS one after the other (a
replacement finishing the jobs whose worker was killed, in one process).

``--at action:K`` stops before the K-th plan action of step S runs (forward, recompute, keep, free
or backward); ``push:K`` just after the K-th gradient push of step S has reached the server (its
reply came; a held slot's, answered only after the step's updates, is waited for 2 s at most); ``commit:0`` just after the step's commit was sent. ``KILL`` ends the
process there (a replacement finishes the job); ``STOP`` freezes it (heartbeat included) until the
test sends SIGCONT, after which it reconnects and finishes the job itself (``Trainer.fit``).
Every step trains on ``models.batch(MODEL, step)``, so any process finishing the job trains the
same data a crash-free run does.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))

import models  # noqa: E402

from wstream.client import Client  # noqa: E402
from wstream.client.executor import PlanExecutor  # noqa: E402
from wstream.client.push import GradientPusher  # noqa: E402


class Fault:
    """Counts the chosen kind of event during step ``step`` and signals the process at the K-th."""

    def __init__(self, at: str, step: int, sig: int) -> None:
        kind, k = at.split(":")
        self.kind, self.k, self.step, self.sig = kind, int(k), step, sig
        self.seen = 0
        self.fired = False

    def event(self, kind: str, step: int, before: Any = None) -> None:
        if self.fired or kind != self.kind or step != self.step:
            return
        if self.seen == self.k:
            self.fired = True
            if before is not None:
                before()
            os.kill(os.getpid(), self.sig)  # SIGSTOP returns here once SIGCONT comes
        self.seen += 1


def install(fault: Fault) -> None:
    """Hook the worker's own parts (in this process only) so the fault lands where asked."""
    execute, push = PlanExecutor.execute, GradientPusher.push
    run_actions = PlanExecutor.run_actions
    commit = getattr(GradientPusher, "commit", None)  # absent before the step commit point
    in_run = [False]  # inside run_actions, which counts its actions itself

    def hooked_execute(self: PlanExecutor, run: Any, op: Any, i: int, loss_fn: Any, **kw: Any) -> None:
        if not in_run[0]:
            fault.event("action", run.step)
        execute(self, run, op, i, loss_fn, **kw)

    def hooked_run_actions(self: PlanExecutor, run: Any, actions: Any, loss_fn: Any, taped: frozenset[int] = frozenset()) -> None:
        # runs of ADVANCEs go in one loop, not through execute: the plan is cut before the K-th
        # action, and the fault lands between the two parts
        k = fault.k - fault.seen if fault.kind == "action" and run.step == fault.step and not fault.fired else -1
        in_run[0] = True
        try:
            if 0 <= k < len(actions):
                run_actions(self, run, actions[:k], loss_fn, frozenset(a for a in taped if a < k))
                fault.seen = fault.k
                fault.event("action", run.step)
                run_actions(self, run, actions[k:], loss_fn, frozenset(a - k for a in taped if a >= k))
            else:
                run_actions(self, run, actions, loss_fn, taped)
                if fault.kind == "action" and run.step == fault.step:
                    fault.seen += len(actions)
        finally:
            in_run[0] = False

    def sent(pusher: GradientPusher) -> None:
        deadline = time.monotonic() + 10
        while pusher._unsent and time.monotonic() < deadline:  # the sender thread took it out
            time.sleep(0.001)

    def received(pusher: GradientPusher, stage: int) -> None:
        """The push of ``stage`` reached the server. Taken out by the sender thread is not enough:
        ZeroMQ sends from its own thread, and a kill at once could drop it (the server then saw no
        push of the step). Its reply says the server has it; a held slot is answered only after
        its update (after a commit that will not come), so that wait ends after 2 s."""
        sent(pusher)
        deadline = time.monotonic() + 2
        while any(e.stage == stage for e in list(pusher._outstanding.values())) and time.monotonic() < deadline:
            time.sleep(0.001)

    def hooked_push(self: GradientPusher, stage: int, step: int, *args: Any) -> None:
        push(self, stage, step, *args)
        fault.event("push", step, lambda: received(self, stage))

    def hooked_commit(self: GradientPusher, step: int) -> None:
        commit(self, step)
        fault.event("commit", step, lambda: sent(self))

    PlanExecutor.execute = hooked_execute  # type: ignore[method-assign]
    PlanExecutor.run_actions = hooked_run_actions  # type: ignore[method-assign]
    GradientPusher.push = hooked_push  # type: ignore[method-assign]
    if commit is not None:
        GradientPusher.commit = hooked_commit  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("address", "job", "token", "model"):
        p.add_argument(name)
    p.add_argument("steps", type=int)
    p.add_argument("out")
    p.add_argument("--at", default="")
    p.add_argument("--in-step", type=int, default=1)
    p.add_argument("--signal", default="KILL", choices=["KILL", "STOP"])
    p.add_argument("--world-size", type=int, default=1)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s worker %(process)d %(levelname)s %(message)s")
    if args.at:
        install(Fault(args.at, args.in_step, signal.SIGKILL if args.signal == "KILL" else signal.SIGSTOP))
    with torch.device("meta"):
        stages = models.BUILDERS[args.model]()
    report: dict[str, Any] = {}
    with Client(args.address, timeout=10) as client:
        for name in args.job.split(","):
            job = client.attach_job(name, token=args.token, stages=stages)
            with job.trainer(world_size=args.world_size, reconnect_s=60) as trainer:
                losses = trainer.fit(lambda t: models.batch(args.model, t), models.loss_fn, steps=args.steps)
                report[name] = {"losses": {str(k): v for k, v in losses.items()}, "reconnects": trainer.reconnects,
                                "step": trainer.step_index, "step_ring": trainer.connection.step_ring}
    with open(args.out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
