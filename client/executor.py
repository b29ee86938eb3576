"""The plan executor: runs a checkpoint plan's actions on the stages of one step.

The step is driven by a checkpoint plan (:mod:`wstream.client.plans`): untaped ADVANCEs move the
current stage input forward, SNAPSHOT/RESTORE/FREE keep and reuse inputs, OFFLOAD/PREFETCH/FREE_HOST
move them through host memory, and each BACKWARD re-runs one stage with autograd from its input,
pushes its gradient and passes dx_i down (``backward.py``: :class:`StageBackward`, this class's
base). The weights of every compute action are fetched in the plan's order by the prefetch
thread; :meth:`PlanExecutor.weights_of` is the one place a stage's weights are taken from it and
given back (forward, recomputation, backward, and the trainer's ``forward`` and profile).

The plan's chain is one of *positions*; each runs on a weight stage, usually its own, sometimes
an earlier one (a tied head: NOTE [Positions and weight stages] in ``stages.py``).

# NOTE [Buffers]
# A stage's persistent buffers (BatchNorm's running statistics and count) are stored and streamed
# with its weights (``ParamSpec.buffer``). A module updates them in place while it runs in train
# mode, and the executor runs a position more than once per step (recomputation, the backward's
# rerun, a loss-scaling retry), so:
#   1. A position's *real* forward of micro-batch j is its first run on it in the step: its first
#      ADVANCE, or its BACKWARD when it was never advanced (the chain's last position under
#      store_all). Only real forwards update the step's buffers: ``run.buffers[stage]``, copies of
#      the fetched ones made at the stage's first real forward (the published weights are never
#      written), updated micro-batch after micro-batch as gradient accumulation would.
#   2. Every other run gets a fresh copy of the buffers that position's real forward of j started
#      from (``run.buffers_before``), so it computes what the real forward computed (BatchNorm in
#      train mode normalizes with the batch's statistics either way) and its updates are dropped.
#   3. The buffers go to the server in the stage's push, after its gradient (``push_layout``): a
#      floating-point (or boolean) buffer's new value, an integer buffer's increment over the step (a count
#      stays exact in the fp32 master even where the published bf16 copy would round it). They
#      are applied at the step's commit, with the update: atomic with the step like the weights.
#      With several workers the job keeps their mean (NOTE [Buffers] in server/stage_state.py).
#   4. ``Trainer.forward`` and the profile run on copies too: they never change the job.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from wstream.protocol.layout import push_layout

from .backward import LossFn, StageBackward, grad_inputs_of
from .boundary import Boundary, join_lanes, lanes_of, output_boundary
from .distributed import AllReduceGradients, flat_spec
from .loss_scale import LossScaler
from .offload import HostMover
from .plan_run import PlanRun
from .plans import Op
from .prefetch import Fetched, Prefetcher
from .push import GradientPusher
from .rng import StageRng
from .stages import Buffers, StageRunner
from .taped import taped_forward, tapes
from .timeline import Tracer



class Streams(Protocol):
    """Where the executor takes weights from and sends gradients to (a ``WorkerConnection``; its
    prefetcher and pusher are new ones after a reconnect, so they are read at each use)."""

    @property
    def prefetcher(self) -> Prefetcher: ...

    @property
    def pusher(self) -> GradientPusher: ...


class PlanExecutor(StageBackward):
    """Runs plan actions for one worker: forward, recomputation, backward and activation moves."""

    def __init__(
        self,
        runners: list[StageRunner],
        streams: Streams,
        *,
        device: torch.device,
        rng: StageRng,
        scaler: LossScaler | None = None,
        allreduce: AllReduceGradients | None = None,
        early_stop: bool | None = None,
    ) -> None:
        self.runners = runners  # one per chain position
        # positions whose forward may be taped where the plan allows (NOTE [Taped forwards and early
        # stop] in plans/taping.py): not with loss scaling, whose retries run the stage again
        self.tapes = [scaler is None and tapes(r, early_stop) for r in runners]
        self.first_use: dict[int, int] = {}  # weight stage -> its lowest position (its push follows that backward)
        for position, runner in enumerate(runners):
            self.first_use.setdefault(runner.stage, position)
        # the lowest position with a trained parameter (a loop's body is every position): input
        # gradients are needed only above it, and positions below it have no backward to run
        self.lowest_trained = next((p for p, r in enumerate(runners) if r.trains), None)
        self._streams = streams
        self.device = device
        self.rng = rng
        self.scaler = scaler
        self.allreduce = allreduce  # ranks that all-reduce each stage's gradient (client/distributed.py)
        self.reader = allreduce is not None and allreduce.rank != 0  # a rank that pushes nothing
        self.tracer: Tracer | None = None  # set while ``Trainer.trace`` records a timeline
        self._mover: HostMover | None = None
        self._resident: Fetched | None = None  # the last fetch, kept while positions on its stage follow
        # the prefetcher whose memory (ring, mapping) the positions' kept leaves view (NOTE [Kept leaves])
        self._leaves_from: Prefetcher | None = None

    def stages_of(self, positions: list[int]) -> list[int]:
        """The weight stages to fetch for a plan's compute positions (its ``fetch_order``): one
        per run of consecutive positions on one stage, which share a fetch (``stage_weights``)."""
        out: list[int] = []
        for p in positions:
            stage = self.runners[p].stage
            if not out or out[-1] != stage:
                out.append(stage)
        return out

    def weights_of(
        self, stage: int, held: dict[int, tuple[torch.Tensor, torch.Tensor | None]] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stage ``stage``'s weights and its frozen base's (if any), for the next compute: held
        for the whole step (a loop body, in ``held``), or the prefetcher's next fetch. A fetch
        stays *resident* while the next computes are on the same stage (the positions of a
        transfer unit, NOTE [Transfer units] in units.py; ``stages_of`` fetches such a run once),
        and goes back to the ring when a compute needs another stage or at :meth:`end_fetches`.
        After a compute that raises, the step's abort frees the buffer (the prefetcher's
        ``reset`` frees every buffer; :meth:`forget_resident`)."""
        if held is not None and stage in held:
            return held[stage]
        resident = self._resident
        if resident is None or resident.stage != stage:
            prefetcher = self._streams.prefetcher
            if prefetcher is not self._leaves_from:  # a new ring and mapping (a reconnect): NOTE [Kept leaves]
                self._forget_leaves()
                self._leaves_from = prefetcher
            if resident is not None:
                self._resident = None
                prefetcher.release(resident)
            resident = self._resident = prefetcher.get(stage)
        return resident.weights, resident.base

    @contextlib.contextmanager
    def stage_weights(
        self, stage: int, held: dict[int, tuple[torch.Tensor, torch.Tensor | None]] | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """:meth:`weights_of` as a block's context (the trainer's ``forward`` and the profile)."""
        yield self.weights_of(stage, held)

    def end_fetches(self) -> None:
        """The step's (or forward's) last compute is done: give the resident fetch back. The
        positions keep their leaves for the next step (NOTE [Kept leaves] in stages.py)."""
        resident, self._resident = self._resident, None
        if resident is not None:
            self._streams.prefetcher.release(resident)

    def forget_resident(self) -> None:
        """After an abort: the prefetcher's ``reset`` freed every buffer, the resident one too; a
        reconnect may follow, so no position keeps leaves of this prefetcher's memory."""
        self._resident = None
        self._forget_leaves()

    def _forget_leaves(self) -> None:
        """No position keeps leaves viewing the memory they were cut from (NOTE [Kept leaves])."""
        self._leaves_from = None
        for runner in self.runners:
            runner.forget_leaves()

    def close(self) -> None:
        self._forget_leaves()
        if self._mover is not None:
            self._mover.close()

    def execute(self, run: PlanRun, op: Op, i: int, loss_fn: LossFn, *, tape: bool = False) -> None:
        """Run one action; ``tape``: an ADVANCE the plan lets keep its graph (``run_actions``)."""
        if op == Op.ADVANCE:
            assert run.current is not None and run.current[0] == i, "plan out of step: a bug in wstream"
            runner = run.runner_at(i)
            if run.k == 1 and self.tracer is None and not runner.has_buffers:  # the common case, lean
                self._advance_run(run, ((op, i),), 0, frozenset((0,)) if tape else frozenset())
                return
            weights, base = self.weights_of(runner.stage, run.held)
            first = i not in run.advanced
            run.advanced.add(i)
            outs: list[Boundary] = []
            taped = tape and self.tapes[i]
            with self._span(run, ("forward " if first else "recompute ") + str(i), "forward" if first else "recompute", i):
                for j, lane in enumerate(lanes_of(run.current[1], run.k)):  # stage-major: every micro-batch
                    if taped:  # each micro-batch's graph kept for the BACKWARD (runner.simple: no buffers)
                        outs.append(self._taped(run, runner, weights, lane, i, j))
                        continue
                    buffers = self._buffers(run, runner, weights, i, j, real=first)
                    with torch.no_grad(), self.rng.around(run.rng, i, j):
                        outs.append(output_boundary(runner(weights, lane, base, buffers)))
            run.set_current(i + 1, join_lanes(outs))
        elif op == Op.SNAPSHOT:
            assert run.current is not None and run.current[0] == i
            run.keep(i)
        elif op == Op.RESTORE:
            run.restore(i)
        elif op == Op.FREE:
            run.free(i)
        elif op == Op.OFFLOAD:
            assert run.current is not None and run.current[0] == i
            run.host[i] = self._host_mover().to_host(run.current[1])
        elif op == Op.PREFETCH:
            run.arrive(i, self._host_mover().to_device(run.host[i]))
        elif op == Op.FREE_HOST:
            run.host.pop(i).result()  # never drop memory a copy may still be writing
        else:
            assert run.current is not None and run.current[0] == i
            self._backward_stage(run, i, loss_fn)

    def run_actions(
        self, run: PlanRun, actions: Sequence[tuple[Op, int]], loss_fn: LossFn, taped: frozenset[int] = frozenset()
    ) -> None:
        """Execute a plan's ``actions`` in order: each run of consecutive ADVANCEs that can go
        the lean way (one micro-batch, no timeline, stages without buffers) in one loop
        (:meth:`_advance_run`), a BACKWARD straight to its method, every other action through
        :meth:`execute`. ``taped``: the indices of the ADVANCEs that may keep their graph
        (``plans.taping.taped_advances`` of these actions)."""
        a, end = 0, len(actions)
        lean = run.k == 1 and self.tracer is None
        advance, backward = Op.ADVANCE, Op.BACKWARD
        while a < end:
            op, i = actions[a]
            if lean and op == advance and not run.runner_at(i).has_buffers:
                a = self._advance_run(run, actions, a, taped)
                continue
            if op == backward:  # as ``execute`` would, without its walk past every other kind
                assert run.current is not None and run.current[0] == i, "plan out of step: a bug in wstream"
                self._backward_stage(run, i, loss_fn)
            else:
                self.execute(run, op, i, loss_fn, tape=a in taped)
            a += 1

    def _advance_run(
        self, run: PlanRun, actions: Sequence[tuple[Op, int]], a: int, taped: frozenset[int] = frozenset()
    ) -> int:
        """Run ``actions[a]``, an ADVANCE of one micro-batch on a stage without buffers, and the
        ADVANCEs like it that follow it, under one ``no_grad``: each stage runs on its weights
        (``weights_of``) in its RNG context, and its output becomes the current input. Returns
        the index of the first action not run. A deep chain's forward sweeps are such runs of
        thousands of stages: what is left per stage is the stage's call, its RNG record or
        replay and the bookkeeping of the current input (issue 17). First runs of stages that
        drew no random number last time go as a quiet stretch (:meth:`_quiet_stretch`); an
        ADVANCE in ``taped`` of a position that tapes keeps its graph (:func:`taped_forward`)."""
        runner_at, advanced, held, states, rng = run.runner_at, run.advanced, run.held, run.rng, self.rng
        around, quiet = rng.around, rng.quiet
        end = len(actions)
        with torch.no_grad():
            while a < end:
                op, i = actions[a]
                if op != Op.ADVANCE:
                    if op != Op.SNAPSHOT:
                        break
                    assert run.current is not None and run.current[0] == i, "plan out of step: a bug in wstream"
                    run.keep(i)  # a forward sweep keeps inputs on its way: part of the run
                    a += 1
                    continue
                runner = runner_at(i)
                if runner.has_buffers:
                    break
                assert run.current is not None and run.current[0] == i, "plan out of step: a bug in wstream"
                if a in taped and self.tapes[i]:
                    advanced.add(i)
                    weights, _ = self.weights_of(runner.stage, held)
                    run.set_current(i + 1, self._taped(run, runner, weights, run.current[1], i, 0))
                    a += 1
                    continue
                if i in quiet and (i, 0) not in states:
                    a = self._quiet_stretch(run, actions, a, taped)
                    continue
                advanced.add(i)
                weights, base = self.weights_of(runner.stage, held)
                with around(states, i, 0):
                    run.set_current(i + 1, output_boundary(runner(weights, run.current[1], base)))
                a += 1
        return a

    def _quiet_stretch(self, run: PlanRun, actions: Sequence[tuple[Op, int]], a: int, taped: frozenset[int]) -> int:
        """Run, from ``actions[a]``, the first runs of stages that drew no random number in their
        last first run (``StageRng.quiet``) without recording each one's RNG state: one check of
        the whole stretch instead (NOTE [Quiet stretches] in rng.py); it ends before a taped
        ADVANCE (``taped``). Returns the index of the first action not run. Where the RNG moved
        after all, the stretch is run again from its input with the RNG set back, each stage
        recording its own state."""
        runner_at, advanced, held, states, rng = run.runner_at, run.advanced, run.held, run.rng, self.rng
        quiet = rng.quiet
        assert run.current is not None
        start = run.current
        before = rng.state()
        positions: list[int] = []
        stage = runner_at(actions[a][1]).stage  # one fetch: a second run of the stretch needs no other
        end = len(actions)
        while a < end:
            op, i = actions[a]
            if op == Op.SNAPSHOT:  # kept as it is: a second run computes the same input
                assert run.current[0] == i, "plan out of step: a bug in wstream"
                run.keep(i)
                a += 1
                continue
            if op != Op.ADVANCE or i not in quiet or (i, 0) in states or (a in taped and self.tapes[i]):
                break
            runner = runner_at(i)
            if runner.has_buffers or runner.stage != stage:
                break
            advanced.add(i)
            weights, base = self.weights_of(runner.stage, held)
            run.set_current(i + 1, output_boundary(runner(weights, run.current[1], base)))
            positions.append(i)
            a += 1
        if rng.unmoved_since(before):
            for i in positions:
                states[i, 0] = None
            return a
        quiet.difference_update(positions)
        rng.set_state(before)
        run.set_current(*start)
        again = self._advance_run(run, [(Op.ADVANCE, i) for i in positions], 0)
        assert again == len(positions), "a quiet stretch ran again only in part: a bug in wstream"
        return a

    def _taped(self, run: PlanRun, runner: StageRunner, weights: torch.Tensor, lane: Boundary, i: int, j: int) -> Boundary:
        """Run micro-batch ``j`` of position i forward keeping its graph for the BACKWARD (NOTE
        [Taped forwards and early stop] in plans/taping.py; appended to ``run.tapes[i]``); returns
        its output, detached."""
        inputs = grad_inputs_of(lane, i, wanted=self._wants_input_grad(i))
        # the context the recomputation runs in lives in the graph ``run.tapes`` holds: it must not
        # hold ``run`` (a cycle through autograd's nodes, which the collector cannot see, would keep
        # a failed step's activations alive for good)
        rng, states = self.rng, run.rng
        record, out = taped_forward(runner, weights, inputs, lambda: rng.around(states, i, j))
        run.tapes.setdefault(i, []).append(record)
        return out

    def _span(self, run: PlanRun, name: str, cat: str, stage: int) -> contextlib.AbstractContextManager[None]:
        """A compute span on the timeline (nothing when not tracing)."""
        if self.tracer is None:
            return contextlib.nullcontext()
        return self.tracer.span(name, cat, "compute", stage=stage, step=run.step)

    def _host_mover(self) -> HostMover:
        if self._mover is None:
            self._mover = HostMover(self.device)
        return self._mover

    def _buffers(
        self, run: PlanRun, runner: StageRunner, weights: torch.Tensor, i: int, j: int, *, real: bool
    ) -> Buffers | None:
        """The buffers position i runs micro-batch j with (NOTE [Buffers]): for its real forward
        the step's own (made from ``weights`` at the stage's first), whose state before it is
        kept for the reruns; for a rerun a copy of that state. None: the stage has none."""
        if not runner.has_buffers:
            return None
        if real:
            live = run.buffers.get(runner.stage)
            if live is None:
                live = run.buffers[runner.stage] = runner.buffer_state(weights)
                run.buffers_start[runner.stage] = {name: b.clone() for name, b in live.items() if not b.is_floating_point()}
            run.buffers_before[i, j] = {name: b.clone() for name, b in live.items()}
            return live
        before = run.buffers_before.get((i, j))
        assert before is not None, f"position {i} rerun before its real forward: a bug in wstream"
        return {name: b.clone() for name, b in before.items()}

    def _push(self, run: PlanRun, runner: StageRunner, grads: list[torch.Tensor | None]) -> None:
        """Send a stage's gradient, summed over its positions, and its buffers' values (with
        ``allreduce``: their mean over the ranks, sent by rank 0 alone; client/distributed.py)."""
        stage = runner.stage
        pusher = self._streams.pusher
        grads = runner.with_buffers(grads, run.buffers.pop(stage, None), run.buffers_start.pop(stage, None))
        if not push_layout(runner.spec).numel:  # every parameter frozen, no buffer: the step commits without it
            return
        # a delayed job's (s, t) may reach the server before (s, t - 1) is applied: it holds it
        if self.allreduce is None:
            pusher.push(stage, run.step, runner.spec, grads)
        else:
            device = next((g.device for g in grads if g is not None), self.device)
            mean = self.allreduce.mean(runner.spec, grads, device)
            if not self.reader:
                pusher.push(  # borrowed: the next stage's mean reuses it; its norm is of the gradient part only
                    stage, run.step, flat_spec(runner.spec), [mean], borrowed=True, grad_numel=push_layout(runner.spec).grad_numel
                )
        run.pushed = True
