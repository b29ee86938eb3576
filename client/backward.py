"""The BACKWARD action of a plan: re-run a position with autograd from its kept input,
backpropagate, add its parameter gradients to its stage's sum and push the sum after the stage's
last use. The backward half of :class:`~wstream.client.executor.PlanExecutor` (its base class),
apart from the plan walk and the forward runs (``executor.py``) because it has its own concerns:
micro-batch lanes, loss-scaling retries (NOTE [Per-stage loss scaling] in loss_scale.py), the
roots a stage backpropagates from, and the lean one-micro-batch path (issue 17).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .backprop import backprop
from .boundary import Boundary, as_boundary, lanes_of
from .loss_scale import LossScaler, all_finite, unscaled
from .plan_run import GradientSum, PlanRun
from .rng import StageRng
from .stages import Buffers, StageRunner
from .taped import TapedForward
from .timeline import Tracer

LossFn = Callable[[Any, Any], torch.Tensor]


class StageBackward:
    """The BACKWARD of a position, for :class:`~wstream.client.executor.PlanExecutor`, which
    sets the attributes below and provides the methods declared under ``TYPE_CHECKING``."""

    rng: StageRng
    scaler: LossScaler | None
    tracer: Tracer | None
    first_use: dict[int, int]
    lowest_trained: int | None

    if TYPE_CHECKING:

        def weights_of(
            self, stage: int, held: dict[int, torch.Tensor] | None = None
        ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

        def _span(self, run: PlanRun, name: str, cat: str, stage: int) -> contextlib.AbstractContextManager[None]: ...

        def _buffers(
            self, run: PlanRun, runner: StageRunner, weights: torch.Tensor, i: int, j: int, *, real: bool
        ) -> Buffers | None: ...

        def _push(self, run: PlanRun, runner: StageRunner, grads: list[torch.Tensor | None]) -> None: ...

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
        taped = run.tapes.pop(i, None) if run.tapes else None
        try:
            if taped is not None:  # its forward kept the graph: NOTE [Taped forwards and early stop]
                with self._span(run, f"backward {i}", "backward", i):
                    param_grads = self._backward_taped(run, i, runner, weights, taped, loss_fn)
            elif run.k == 1 and self.scaler is None and self.tracer is None and runner.simple:  # the common case, lean
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
        except RuntimeError as exc:
            if _inner_checkpoint(exc):
                raise RuntimeError(
                    f"the backward of position {i} (in weight stage {stage}) re-ran part of the stage outside its run: "
                    "does its forward call torch.utils.checkpoint? wstream checkpoints stages itself (the "
                    "schedule) on weights bound only while the stage runs; remove the inner checkpoint"
                ) from exc
            raise
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
        with self.rng.around(run.rng, i, 0), torch.enable_grad(), in_place_on_input(i):
            out = runner.call_own(params, inputs)
        roots, root_grads = _roots(run, out, None if i == run.last else run.grad_out, loss_fn, 0)
        grad_inputs = _differentiable(inputs)
        grads = backprop(roots, root_grads, [*leaves, *grad_inputs])
        n = len(leaves)
        if len(inputs) == 1:  # one tensor flows between stages: the common boundary
            run.grad_out = [grads[n] if grad_inputs else None]
        else:
            run.grad_out = _per_input(inputs, grads[n:])
        return grads[:n]

    def _backward_taped(
        self, run: PlanRun, i: int, runner: StageRunner, weights: torch.Tensor, taped: list[TapedForward], loss_fn: LossFn
    ) -> Sequence[torch.Tensor | None]:
        """:meth:`_backward_one` through the graphs a taped forward of position i kept, one per
        micro-batch (their parameter gradients summed in micro-batch order, as
        :meth:`_backward_lanes` does): each recomputation binds this BACKWARD's weights and stops
        before the stage's last operation (client/taped.py). Never the chain's last position:
        its gradient comes from the one above."""
        assert run.current is not None and run.grad_out is not None, "a taped position without one above it: a bug in wstream"
        assert len(taped) == run.k, "a taped position without a graph per micro-batch: a bug in wstream"
        kept = runner.bound_leaves(weights)[0]
        run.drop_current()
        grad_lanes = lanes_of(tuple(run.grad_out), run.k)
        param_grads = GradientSum(len(taped[0].leaves))
        grad_out: list[torch.Tensor | None] = []
        for j, (record, lane_grad_out) in enumerate(zip(taped, grad_lanes)):
            record.bind[0] = kept
            roots, root_grads = _roots(run, record.out, lane_grad_out, loss_fn, j)
            grads = backprop(roots, root_grads, [*record.leaves, *_differentiable(record.inputs)])
            n = len(record.leaves)
            param_grads.add_all(grads[:n])
            grad_out += _per_input(record.inputs, grads[n:])
            del roots, root_grads, grads
        run.grad_out = grad_out
        return param_grads.values

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

    @staticmethod
    def _done_with(run: PlanRun, i: int) -> None:
        """Position i's backward is done: no rerun of it is left, nor the buffers for one."""
        for j in range(run.k):
            run.buffers_before.pop((i, j), None)

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
        param_grads = GradientSum(len(leaves))
        grad_out: list[torch.Tensor | None] = []
        scaler = self.scaler
        for j, (lane, lane_grad_out) in enumerate(zip(lanes, grad_lanes)):
            first = True
            while True:
                inputs = grad_inputs_of(lane, i, wanted=self._wants_input_grad(i))
                buffers = self._buffers(run, runner, weights, i, j, real=first and i not in run.advanced)
                with self.rng.around(run.rng, i, j), torch.enable_grad(), in_place_on_input(i):
                    out = runner.call_with(params if buffers is None else {**params, **buffers}, inputs)
                grad_inputs = _differentiable(inputs)
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
            param_grads.add_all(own if scaler is None or run.scales is None else unscaled(own, run.scales[j]))
            grad_out += _per_input(inputs, grads[len(leaves) :])
            del grads, inputs, grad_inputs, own
        return param_grads.values, grad_out


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
        finite = math.isfinite(value)
        # the ranks agree once per micro-batch (a loss-scaling retry of one rank recomputes the same loss)
        if first and run.all_finite is not None and not run.all_finite(finite) and finite:
            raise FloatingPointError(
                f"the loss of micro-batch {lane} is not finite on another rank: no rank sends this step "
                "(the job's weights are unchanged); check the data and the learning rate"
            )
        if not finite:
            where = " on this rank" if run.all_finite is not None else ""
            raise FloatingPointError(
                f"the loss of micro-batch {lane} is {value}{where}: nothing of this step was sent (the job's "
                "weights are unchanged); check the data and the learning rate"
            )
        weights = run.lane_weights  # an uneven split: each micro-batch's mean loss weighs its share of the batch
        if first:
            run.loss += value / run.k if weights is None else value * weights[lane]
        root = loss if run.k == 1 else loss / run.k if weights is None else loss * weights[lane]
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


def _differentiable(inputs: Boundary) -> list[torch.Tensor]:
    """The inputs that want a gradient (the leaves :func:`grad_inputs_of` made)."""
    return [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]


def _per_input(inputs: Boundary, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Each input's gradient: ``grads`` are those of :func:`_differentiable`'s inputs, in order;
    None for the others."""
    it = iter(grads)
    return [next(it) if isinstance(x, torch.Tensor) and x.requires_grad else None for x in inputs]


def _inner_checkpoint(exc: RuntimeError) -> bool:
    """Whether a backward failed the way a ``torch.utils.checkpoint`` inside a stage makes it fail:
    its recomputation ran on the meta skeleton (non-reentrant), or torch refused it under
    ``autograd.grad`` (reentrant)."""
    text = str(exc)
    return ("device meta" in text and "expected device" in text) or "torch.utils.checkpoint is incompatible with .grad()" in text


@contextlib.contextmanager
def in_place_on_input(i: int) -> Iterator[None]:
    """Name the position whose stage changes its own input in place (its first op an in-place
    ``ReLU(inplace=True)``, say): the input is a kept stage boundary here, recomputed from and
    differentiated, so torch refuses, naming no stage."""
    try:
        yield
    except RuntimeError as exc:
        if "leaf Variable that requires grad is being used in an in-place operation" not in str(exc):
            raise
        raise RuntimeError(
            f"position {i}'s stage changes its input in place (e.g. a first op with inplace=True, or x += ...): the "
            "input of a stage is a kept boundary that wstream recomputes from and differentiates; make that op "
            "out of place (inplace=False, x = x + ...)"
        ) from exc


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
