"""Profiling a step, and the plan made from it (schedules "optimal", "auto", "offload", "min_peak").

A profiled schedule cannot plan before it knows the chain's costs: :func:`measure_profile` runs
each stage once on the first batch (one micro-batch: forward time, input size, tape size, and
the time to copy the input to the host), and :class:`Planning` keeps the plan that was made from
it, measuring again whenever the number of micro-batches changes. Separate from the executor
because it runs no plan: it only times stages, inside a forked RNG, and pushes nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from wstream.protocol import StateError

from .boundary import Boundary, as_boundary, boundary_bytes, output_boundary
from .device import synchronize
from .backward import grad_inputs_of
from .executor import PlanExecutor
from .plans import Plan, StageCosts, simulate
from .plans.taping import taped_advances
from .prefetch import Prefetcher
from .stages import StageRunner

log = logging.getLogger(__name__)


Shapes = tuple[tuple[int, ...] | None, ...]
"""The shape of each item of a micro-batch's inputs (None: not a tensor)."""


PLANS_KEPT = 8
"""Plans a trainer keeps, by the batch shapes they were made for."""


def shapes_of(inputs: Any) -> Shapes:
    """The shapes of a micro-batch's input tensors (its boundary's items), for
    :meth:`Planning.needs_profile`."""
    return tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in as_boundary(inputs))


def within(shapes: Shapes, profiled: Shapes) -> bool:
    """Whether every tensor of ``shapes`` is no larger in any dimension than ``profiled``'s."""
    if len(shapes) != len(profiled):
        return False
    for new, old in zip(shapes, profiled):
        if (new is None) != (old is None):
            return False
        if new is not None and old is not None and (len(new) != len(old) or any(a > b for a, b in zip(new, old))):
            return False
    return True


class Planning:
    """The trainer's checkpoint plan: given up front, or made by ``from_profile`` from a profile of
    the first step (and again when the number of micro-batches changes)."""

    def __init__(
        self,
        plan: Plan | None,
        from_profile: Callable[[StageCosts], Plan] | None,
        stages_of: Callable[[list[int]], list[int]],
    ) -> None:
        if (plan is None) == (from_profile is None):
            raise ValueError("give either a plan or a planner to apply to the first step's profile")
        self.plan = plan
        self._from_profile = from_profile
        self._stages_of = stages_of
        self.profile: StageCosts | None = None
        """The costs the plan was made for: ``profile_one`` (a profile of one micro-batch, measured
        again whenever the number of micro-batches changes) scaled to ``k`` micro-batches."""
        self.profile_one: StageCosts | None = None
        self.k = 1
        self.shapes: Shapes = ()
        """The shapes of the profiled micro-batch's tensors: a larger batch is profiled again."""
        self._made: dict[Shapes, tuple[StageCosts, StageCosts, Plan]] = {}
        """The plans made for this ``k``, by the shapes they were profiled at (the newest
        :data:`PLANS_KEPT`): batches whose shapes alternate (more sequences, or longer ones) each
        reuse theirs instead of being profiled at every change."""
        self.fetch_order = stages_of(plan.fetch_order()) if plan is not None else []
        """The weight stages a step fetches, in order."""
        self.taped = taped_advances(plan.actions) if plan is not None else frozenset()
        """The plan's ADVANCEs that may keep their graph (NOTE [Taped forwards and early stop])."""

    def needs_profile(self, k: int, shapes: Shapes = ()) -> bool:
        """Whether a step of ``k`` micro-batches, the first of whose tensors have ``shapes``
        (:func:`shapes_of`), must be profiled first: the plan is made from a profile, and none
        was made yet, or ``k`` changed, or a tensor is larger in some dimension than the profiled
        one's (its activations may be too: the plan made for the smaller ones could exceed the
        budget). A batch no larger anywhere keeps the plan, which fits it too."""
        if self.plan is None:
            return True
        if self._from_profile is None:
            return False
        if k != self.k:
            self._made.clear()
            return True
        if within(shapes, self.shapes):
            return False
        for made_for, made in reversed(self._made.items()):  # batches of shapes that come back: no new profile
            if within(shapes, made_for):
                self._use(made_for, *made)
                return False
        log.info("a batch of shapes %s, larger than the profiled %s: profiled and planned again", shapes, self.shapes)
        return True

    def plan_for(self, one: StageCosts, k: int, shapes: Shapes = ()) -> Plan:
        """Make the plan for ``k`` micro-batches from ``one``, the profile of one of ``shapes``; a
        budget no plan fits is refused here, before any update."""
        assert self._from_profile is not None
        profile = one.for_micro_batches(k)
        plan = self._from_profile(profile)  # (refused: the plan and its profile stay as they were)
        self.k = k
        self._use(shapes, one, profile, plan)
        self._made[shapes] = (one, profile, plan)
        while len(self._made) > PLANS_KEPT:
            del self._made[next(iter(self._made))]
        log.info(
            "schedule %r from the profile (%d micro-batch%s): %d recomputed forwards, %d live inputs at most",
            plan.name,
            k,
            "" if k == 1 else "es",
            plan.advances,
            plan.peak_states,
        )
        return plan

    def _use(self, shapes: Shapes, one: StageCosts, profile: StageCosts, plan: Plan) -> None:
        """Make ``plan`` (from ``profile``, of a batch of ``shapes``) the one steps run."""
        self.profile_one, self.profile, self.plan, self.shapes = one, profile, plan, shapes
        self.fetch_order = self._stages_of(plan.fetch_order())
        self.taped = taped_advances(plan.actions)

    def summary(self, stage_bytes: list[int], *, peak_boundary: int, tapes: Sequence[bool] = ()) -> dict[str, Any]:
        """What the plan costs per step: recomputation, memory (``peak_boundary``: the most a step
        held, measured) and weight traffic (``stage_bytes``: each weight stage's size); ``tapes``:
        which positions tape their forward where the plan allows (the executor's)."""
        plan = self.plan
        if plan is None:
            raise StateError("the plan is made from a profile of the first step: call step() first")
        return {
            "schedule": plan.name,
            "stages": plan.n,
            "forward_evaluations": plan.forward_evaluations,
            "recomputed_forwards": plan.advances,
            # BACKWARDs whose re-run stops before the stage's last op (NOTE [Taped forwards and early stop])
            "early_stopped_recomputations": sum(1 for a in self.taped if tapes and tapes[plan.actions[a][1]]),
            "peak_kept_states": plan.peak_slots,
            "peak_live_states": plan.peak_states,
            "peak_activation_bytes_measured": peak_boundary,
            "weight_bytes_fetched": sum(stage_bytes[i] for i in self.fetch_order),
            # inputs offloaded to host memory at once, by the profile's sizes (None: no profile);
            # on a CPU worker the same memory as the activations, beside the budget
            "peak_host_bytes_planned": None if self.profile is None else simulate(
                plan.n, plan.actions, state_bytes=self.profile.state_bytes, tape_bytes=self.profile.tape_bytes
            ).peak_host_bytes,
        }


def measure_profile(
    executor: PlanExecutor,
    prefetcher: Prefetcher,
    inputs: Any,
    *,
    step: int,
    stage_bytes: list[int],
    zero_copy: bool,
) -> StageCosts:
    """Measure each position once on ``inputs`` (one micro-batch): forward time, input size, tape
    size, and the copy of its input to the host. Runs inside a forked RNG and pushes nothing, so
    training afterwards is exactly what it would have been. ``stage_bytes``: each weight stage's
    size (for the fetch bandwidth, which a zero-copy worker does not spend)."""
    runners = executor.runners
    device = executor.device
    prefetcher.start(step, executor.stages_of(list(range(len(runners)))))
    forward_s: list[float] = []
    state_bytes: list[int] = []
    tape_bytes: list[int] = []
    current = as_boundary(inputs)
    host_s = tape_s = 0.0  # the host copies and the tape runs: not fetch time
    t_fetch = time.perf_counter()
    try:
        with executor.rng.forked():
            for runner in runners:
                with executor.stage_weights(runner.stage) as (weights, base):
                    state_bytes.append(boundary_bytes(current))
                    synchronize(device)  # a GPU runs asynchronously: time the work, not its launch
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        out = runner(weights, current, base)
                    synchronize(device)
                    forward_s.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    tape_bytes.append(_tape_bytes(runner, len(tape_bytes), weights, base, current))
                    synchronize(device)
                    tape_s += time.perf_counter() - t0
                t0 = time.perf_counter()
                _to_device(current, torch.device("cpu"))
                host_s += time.perf_counter() - t0
                current = output_boundary(out)
    except BaseException:
        executor.forget_resident()
        prefetcher.reset()
        raise
    executor.end_fetches()
    elapsed = time.perf_counter() - t_fetch
    # a position's own weights: its stage's, or its part of a unit (NOTE [Transfer units])
    weight_bytes = tuple(stage_bytes[r.stage] * r.own_numel // max(r.spec.numel, 1) for r in runners)
    fetch_s = max(elapsed - sum(forward_s) - host_s - tape_s, 1e-9)
    bandwidth = 0.0 if zero_copy else sum(weight_bytes) / fetch_s
    return StageCosts(
        forward_s=tuple(forward_s),
        state_bytes=tuple(state_bytes),
        tape_bytes=tuple(tape_bytes),
        weight_bytes=weight_bytes,
        bandwidth=bandwidth,
        host_bandwidth=sum(state_bytes) / max(host_s, 1e-9),
        host_is_device=device.type == "cpu",
    )


def _tape_bytes(
    runner: StageRunner, i: int, weights: torch.Tensor, base: torch.Tensor | None, inputs: Boundary
) -> int:
    """Bytes autograd saves for backward when position i runs with grad (plus its output); the
    stage's weights (and its base's) are not new memory."""
    saved = 0
    own = [w.untyped_storage().data_ptr() for w in (weights, base) if w is not None]

    def pack(t: torch.Tensor) -> None:
        """Counts the tensor and keeps nothing: no backward runs, and handing autograd ``t``
        itself would make a cycle through C++ for a saved output (Tanh's) that no collection
        frees, keeping every stage's output and tape alive after the profile."""
        nonlocal saved
        if t.untyped_storage().data_ptr() not in own:
            saved += t.numel() * t.element_size()

    params = runner.leaves(weights, base)
    xs = grad_inputs_of(inputs, i)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _never_unpacked):
        out = runner.call_with(params, xs)
    return saved + boundary_bytes(as_boundary(out))


def _never_unpacked(_: None) -> torch.Tensor:
    raise AssertionError("the profile's tape run has no backward: a bug in wstream")


def _to_device(b: Boundary, device: torch.device) -> Boundary:
    """A synchronous copy of a boundary's tensors on ``device`` (the profile times it)."""
    return tuple(t.to(device, copy=True) if isinstance(t, torch.Tensor) else t for t in b)
