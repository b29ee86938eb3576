"""The plan executor: runs a checkpoint plan's actions on the stages of one step.

The step is driven by a checkpoint plan (:mod:`wstream.client.plans`): untaped ADVANCEs move the
current stage input forward, SNAPSHOT/RESTORE/FREE keep and reuse inputs, OFFLOAD/PREFETCH/FREE_HOST
move them through host memory, and each BACKWARD re-runs one stage with autograd from its input,
pushes its gradient and passes dx_i down. The weights of every compute action are fetched in the
plan's order by the prefetch thread; :meth:`PlanExecutor.stage_weights` is the one place a
stage's weights are taken from it and given back (forward, recomputation, backward, and the
trainer's ``forward`` and profile).

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
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from wstream.protocol.layout import push_layout

from .backprop import backprop
from .boundary import Boundary, as_boundary, join_lanes, lanes_of
from .distributed import AllReduceGradients, flat_spec
from .loss_scale import LossScaler, all_finite, unscaled
from .offload import HostMover
from .plan_run import PlanRun, add_into
from .plans import Op
from .prefetch import Fetched, Prefetcher
from .push import GradientPusher
from .rng import StageRng
from .stages import Buffers, StageRunner
from .timeline import Tracer

LossFn = Callable[[Any, Any], torch.Tensor]


class Streams(Protocol):
    """Where the executor takes weights from and sends gradients to (a ``WorkerConnection``; its
    prefetcher and pusher are new ones after a reconnect, so they are read at each use)."""

    @property
    def prefetcher(self) -> Prefetcher: ...

    @property
    def pusher(self) -> GradientPusher: ...


class PlanExecutor:
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
    ) -> None:
        self.runners = runners  # one per chain position
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
        self._allreduce = allreduce
        self.reader = allreduce is not None and allreduce.rank != 0  # a rank that pushes nothing
        self.tracer: Tracer | None = None  # set while ``Trainer.trace`` records a timeline
        self._mover: HostMover | None = None
        self._resident: Fetched | None = None  # the last fetch, kept while positions on its stage follow

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
        self, stage: int, held: dict[int, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stage ``stage``'s weights and its frozen base's (if any), for the next compute: held
        for the whole step (a loop body, in ``held``), or the prefetcher's next fetch. A fetch
        stays *resident* while the next computes are on the same stage (the positions of a
        transfer unit, NOTE [Transfer units] in units.py; ``stages_of`` fetches such a run once),
        and goes back to the ring when a compute needs another stage or at :meth:`end_fetches`.
        After a compute that raises, the step's abort frees the buffer (the prefetcher's
        ``reset`` frees every buffer; :meth:`forget_resident`)."""
        if held is not None and stage in held:
            return held[stage], None
        resident = self._resident
        if resident is None or resident.stage != stage:
            prefetcher = self._streams.prefetcher
            if resident is not None:
                self._resident = None
                prefetcher.release(resident)
            resident = self._resident = prefetcher.get(stage)
        return resident.weights, resident.base

    @contextlib.contextmanager
    def stage_weights(
        self, stage: int, held: dict[int, torch.Tensor] | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """:meth:`weights_of` as a block's context (the trainer's ``forward`` and the profile)."""
        yield self.weights_of(stage, held)

    def end_fetches(self) -> None:
        """The step's (or forward's) last compute is done: give the resident fetch back."""
        resident, self._resident = self._resident, None
        if resident is not None:
            self._streams.prefetcher.release(resident)
        self._forget_leaves()

    def forget_resident(self) -> None:
        """After an abort: the prefetcher's ``reset`` freed every buffer, the resident one too."""
        self._resident = None
        self._forget_leaves()

    def _forget_leaves(self) -> None:
        """No fetch is left: no position keeps leaves viewing one (NOTE [Leaves kept for a step])."""
        for runner in self.runners:
            runner.forget_leaves()

    def close(self) -> None:
        if self._mover is not None:
            self._mover.close()

    def execute(self, run: PlanRun, op: Op, i: int, loss_fn: LossFn) -> None:
        if op == Op.ADVANCE:
            assert run.current is not None and run.current[0] == i, "plan out of step: a bug in wstream"
            runner = run.runner_at(i)
            if run.k == 1 and self.tracer is None and not runner.has_buffers:  # the common case, lean
                self._advance_run(run, ((op, i),), 0)
                return
            weights, base = self.weights_of(runner.stage, run.held)
            first = i not in run.advanced
            run.advanced.add(i)
            outs: list[Boundary] = []
            with self._span(run, ("forward " if first else "recompute ") + str(i), "forward" if first else "recompute", i):
                for j, lane in enumerate(lanes_of(run.current[1], run.k)):  # stage-major: every micro-batch
                    buffers = self._buffers(run, runner, weights, i, j, real=first)
                    with torch.no_grad(), self.rng.around(run.rng, i, j):
                        outs.append(as_boundary(runner(weights, lane, base, buffers)))
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

    def run_actions(self, run: PlanRun, actions: Sequence[tuple[Op, int]], loss_fn: LossFn) -> None:
        """Execute a plan's ``actions`` in order: each run of consecutive ADVANCEs that can go
        the lean way (one micro-batch, no timeline, stages without buffers) in one loop
        (:meth:`_advance_run`), every other action through :meth:`execute`."""
        a, end = 0, len(actions)
        lean = run.k == 1 and self.tracer is None
        while a < end:
            op, i = actions[a]
            if lean and op == Op.ADVANCE and not run.runner_at(i).has_buffers:
                a = self._advance_run(run, actions, a)
            else:
                self.execute(run, op, i, loss_fn)
                a += 1

    def _advance_run(self, run: PlanRun, actions: Sequence[tuple[Op, int]], a: int) -> int:
        """Run ``actions[a]``, an ADVANCE of one micro-batch on a stage without buffers, and the
        ADVANCEs like it that follow it, under one ``no_grad``: each stage runs on its weights
        (``weights_of``) in its RNG context, and its output becomes the current input. Returns
        the index of the first action not run. A deep chain's forward sweeps are such runs of
        thousands of stages: what is left per stage is the stage's call, its RNG record or
        replay and the bookkeeping of the current input (issue 17). First runs of stages that
        drew no random number last time go as a quiet stretch (:meth:`_quiet_stretch`)."""
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
                if i in quiet and (i, 0) not in states:
                    a = self._quiet_stretch(run, actions, a)
                    continue
                advanced.add(i)
                weights, base = self.weights_of(runner.stage, held)
                with around(states, i, 0):
                    run.set_current(i + 1, as_boundary(runner(weights, run.current[1], base)))
                a += 1
        return a

    def _quiet_stretch(self, run: PlanRun, actions: Sequence[tuple[Op, int]], a: int) -> int:
        """Run, from ``actions[a]``, the first runs of stages that drew no random number in their
        last first run (``StageRng.quiet``) without recording each one's RNG state: one check of
        the whole stretch instead (NOTE [Quiet stretches] in rng.py). Returns the index of the
        first action not run. Where the RNG moved after all, the stretch is run again from its
        input with the RNG set back, each stage recording its own state."""
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
            if op != Op.ADVANCE or i not in quiet or (i, 0) in states:
                break
            runner = runner_at(i)
            if runner.has_buffers or runner.stage != stage:
                break
            advanced.add(i)
            weights, base = self.weights_of(runner.stage, held)
            run.set_current(i + 1, as_boundary(runner(weights, run.current[1], base)))
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

    def _span(self, run: PlanRun, name: str, cat: str, stage: int) -> contextlib.AbstractContextManager[None]:
        """A compute span on the timeline (nothing when not tracing)."""
        if self.tracer is None:
            return contextlib.nullcontext()
        return self.tracer.span(name, cat, "compute", stage=stage, step=run.step)

    def _host_mover(self) -> HostMover:
        if self._mover is None:
            self._mover = HostMover(self.device)
        return self._mover

    def _backward_stage(self, run: PlanRun, i: int, loss_fn: LossFn) -> None:
        """Re-run position i with autograd from the current state and backpropagate; push its
        stage's gradient when i is the stage's lowest position, else add it to the stage's sum.

        With k micro-batches this runs once per micro-batch on the same weights (one tape live at
        a time) and sums their parameter gradients in micro-batch order, as accumulation into
        ``.grad`` would."""
        assert run.current is not None
        runner = run.runner_at(i)
        stage = runner.stage
        if not runner.trains and not self._wants_input_grad(i):
            self._nothing_to_differentiate(run, i, runner)
            return
        weights, base = self.weights_of(stage, run.held)
        if run.k == 1 and self.scaler is None and self.tracer is None and runner.simple:  # the common case, lean
            param_grads = self._backward_one(run, i, runner, weights, loss_fn)
        else:
            params = runner.leaves(weights, base)
            lanes = lanes_of(run.current[1], run.k)
            grad_lanes = [None] * run.k if i == run.last else lanes_of(tuple(run.grad_out or ()), run.k)
            run.drop_current()
            with self._span(run, f"backward {i}", "backward", i):
                param_grads, run.grad_out = self._backward_lanes(
                    run, i, runner, weights, params, lanes, grad_lanes, loss_fn
                )
            del params
            self._done_with(run, i)
        grads = run.add_grads(stage, len(runner.spec.params), runner.grad_indices, param_grads)
        if i == self.first_use[stage]:  # backward has no use of this stage left
            del run.grads[stage]
            self._push(run, runner, grads)

    def _backward_one(
        self, run: PlanRun, i: int, runner: StageRunner, weights: torch.Tensor, loss_fn: LossFn
    ) -> Sequence[torch.Tensor | None]:
        """:meth:`_backward_lanes` for what most steps are: one micro-batch, no loss scaling, no
        timeline, a stage without buffers or base (``StageRunner.simple``). Sets ``run.grad_out``
        and returns the parameter gradients (``leaves`` order). A deep chain backpropagates each of
        its thousands of small stages once per step, so this is the same work without the
        general path's lanes, lists and checks (a few microseconds per stage, issue 17)."""
        assert run.current is not None
        params, leaves = runner.bound_leaves(weights)
        inputs = grad_inputs_of(run.current[1], i, wanted=self._wants_input_grad(i))
        run.drop_current()
        with self.rng.around(run.rng, i, 0), torch.enable_grad():
            out = runner.call_with(params, inputs, known=True)
        roots, root_grads = _roots(run, out, None if i == run.last else run.grad_out, loss_fn, 0)
        grad_inputs = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
        grads = backprop(roots, root_grads, [*leaves, *grad_inputs])
        n = len(leaves)
        if len(inputs) == 1:  # one tensor flows between stages: the common boundary
            run.grad_out = [grads[n] if grad_inputs else None]
        else:
            it = iter(grads[n:])
            run.grad_out = [next(it) if isinstance(x, torch.Tensor) and x.requires_grad else None for x in inputs]
        return grads[:n]

    def _wants_input_grad(self, i: int) -> bool:
        """Whether position i's input gradient is used: a position below it trains."""
        return self.lowest_trained is not None and self.lowest_trained < i

    def _nothing_to_differentiate(self, run: PlanRun, i: int, runner: StageRunner) -> None:
        """The BACKWARD of a position below every trained one whose own parameters are all frozen
        (a frozen embedding, the first stages of a fine-tune): no parameter gradient and no input
        gradient is wanted, so nothing is recomputed. Its weights were fetched for this action
        (the fetch order is the plan's) and are given back; its push has nothing to send."""
        assert run.current is not None and i != run.last, "a chain that trains nothing: a bug in wstream"
        self.weights_of(runner.stage, run.held)
        run.grad_out = [None] * len(run.current[1])
        run.drop_current()
        self._done_with(run, i)
        grads = run.add_grads(runner.stage, len(runner.spec.params), (), ())
        if i == self.first_use[runner.stage]:
            del run.grads[runner.stage]
            self._push(run, runner, grads)

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

    @staticmethod
    def _done_with(run: PlanRun, i: int) -> None:
        """Position i's backward is done: no rerun of it is left, nor the buffers for one."""
        for j in range(run.k):
            run.buffers_before.pop((i, j), None)

    def _push(self, run: PlanRun, runner: StageRunner, grads: list[torch.Tensor | None]) -> None:
        """Send a stage's gradient, summed over its positions, and its buffers' values (with
        ``allreduce``: their mean over the ranks, sent by rank 0 alone; client/distributed.py)."""
        stage = runner.stage
        pusher = self._streams.pusher
        grads = runner.with_buffers(grads, run.buffers.pop(stage, None), run.buffers_start.pop(stage, None))
        if not push_layout(runner.spec).numel:  # every parameter frozen, no buffer: the step commits without it
            return
        # a delayed job's (s, t) may reach the server before (s, t - 1) is applied: it holds it
        if self._allreduce is None:
            pusher.push(stage, run.step, runner.spec, grads)
        else:
            device = next((g.device for g in grads if g is not None), self.device)
            mean = self._allreduce.mean(runner.spec, grads, device)
            if not self.reader:
                pusher.push(stage, run.step, flat_spec(runner.spec), [mean])
        run.pushed = True

    def _backward_lanes(
        self,
        run: PlanRun,
        i: int,
        runner: StageRunner,
        weights: torch.Tensor,
        params: dict[str, torch.Tensor],
        lanes: list[Boundary],
        grad_lanes: list[Boundary | None],
        loss_fn: LossFn,
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Backpropagate stage i for every micro-batch: (summed parameter gradients, the input
        gradients of every micro-batch, packed). With loss scaling a micro-batch whose gradients
        are not finite is run again at a lower scale (NOTE [Per-stage loss scaling]) and its
        parameter gradients are summed unscaled, in fp32."""
        leaves = [v for v in params.values() if v.requires_grad]  # not a frozen base's views
        param_grads: list[torch.Tensor | None] = [None] * len(leaves)
        grad_out: list[torch.Tensor | None] = []
        scaler = self.scaler
        for j, (lane, lane_grad_out) in enumerate(zip(lanes, grad_lanes)):
            first = True
            while True:
                inputs = grad_inputs_of(lane, i, wanted=self._wants_input_grad(i))
                buffers = self._buffers(run, runner, weights, i, j, real=first and i not in run.advanced)
                with self.rng.around(run.rng, i, j), torch.enable_grad():
                    out = runner.call_with(params if buffers is None else {**params, **buffers}, inputs)
                grad_inputs = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
                roots, root_grads = _roots(run, out, lane_grad_out, loss_fn, j, first=first)
                grads = backprop(roots, root_grads, [*leaves, *grad_inputs])
                del out, roots, root_grads
                if scaler is None or all_finite(grads):
                    break
                assert run.scales is not None
                where = f"step {run.step}, position {i}, micro-batch {j}"
                lower = scaler.back_off(run.scales[j], where)
                factor = lower / run.scales[j]
                run.scales[j] = lower
                if lane_grad_out is not None:  # exact for a power-of-two factor
                    lane_grad_out = tuple(g * factor if isinstance(g, torch.Tensor) else g for g in lane_grad_out)
                first = False
            own = grads[: len(leaves)]
            add_into(param_grads, own if scaler is None or run.scales is None else unscaled(own, run.scales[j]))
            it = iter(grads[len(leaves) :])
            grad_out.extend(next(it) if isinstance(x, torch.Tensor) and x.requires_grad else None for x in inputs)
            del grads, inputs, grad_inputs, own
        return param_grads, grad_out


def _roots(
    run: PlanRun, out: Any, grad_out: Boundary | None, loss_fn: LossFn, lane: int, *, first: bool = True
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """What micro-batch ``lane`` of a stage backpropagates from: the loss (divided by the
    number of micro-batches; seeded with the lane's loss scale, if any) at the chain's end,
    else the outputs that have a gradient. ``first``: not a loss-scaling retry (the loss is
    counted once)."""
    if grad_out is None:
        loss = loss_fn(out, run.targets[lane])
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(
                f"the loss of micro-batch {lane} is {value}: nothing of this step was sent (the job's "
                "weights are unchanged); check the data and the learning rate"
            )
        if first:
            run.loss += value / run.k
        root = loss if run.k == 1 else loss / run.k
        if run.scales is None:
            return [root], [None]
        return [root.float()], [torch.tensor(run.scales[lane], dtype=torch.float32, device=root.device)]
    if isinstance(out, torch.Tensor) and len(grad_out) == 1:  # one tensor between stages
        g = grad_out[0]
        return ([out], [g]) if out.requires_grad and g is not None else ([], [])
    roots: list[torch.Tensor] = []
    root_grads: list[torch.Tensor | None] = []
    for o, g in zip(as_boundary(out), grad_out):
        if isinstance(o, torch.Tensor) and o.requires_grad and g is not None:
            roots.append(o)
            root_grads.append(g)
    return roots, root_grads


def grad_inputs_of(inputs: Boundary, i: int, *, wanted: bool = True) -> Boundary:
    """Position i's inputs for a run with autograd: floating-point tensors become leaves that
    want a gradient (not at position 0, whose input is the data, nor where no position below
    trains: ``wanted`` False)."""
    if not wanted or i == 0:
        return inputs
    if len(inputs) == 1:  # one tensor between stages, the common case
        x = inputs[0]
        return (x.detach().requires_grad_(True),) if _wants_grad(x) else inputs
    return tuple(x.detach().requires_grad_(True) if wanted and i > 0 and _wants_grad(x) else x for x in inputs)


def _wants_grad(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()
