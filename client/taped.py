"""A taped forward and its backward: a stage's graph kept from its forward, so that the backward's
recomputation stops early (NOTE [Taped forwards and early stop] in plans/taping.py).

The forward runs the position under ``torch.utils.checkpoint`` (non-reentrant): the graph is
recorded with a placeholder for every saved tensor and nothing is saved. The BACKWARD
backpropagates from the kept output; the engine's first use of a placeholder re-runs the stage on
the weights fetched for the BACKWARD (the ``bind`` cell) and stops once every saved tensor is back,
before the stage's last operation. The gradients reach the leaves the forward ran on: the same
values as the BACKWARD's own weights (one version per step), maybe other tensors (a ring buffer
reused since), which is why the record keeps them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from .boundary import Boundary, output_boundary
from .stages import StageRunner

EARLY_STOP_MIN_NUMEL = 1 << 22
"""By default a position is taped when its stage has at least this many parameter elements (16 MiB
in fp32). ``torch.utils.checkpoint`` costs about 0.1 ms of Python per stage and run (measured on
the 2-core CPU machine, BENCHMARKS.md), and what it saves is the stage's last operation: worth it
for a transformer block, a loss for a chain of thousands of small layers."""


@dataclass(slots=True)
class TapedForward:
    """What a taped forward of one position keeps for its BACKWARD."""

    out: Any
    """The stage's output with its graph (the backward's root)."""
    leaves: list[torch.Tensor]
    """The trained parameter leaves the graph accumulates into (``grad_indices`` order)."""
    inputs: Boundary
    """The inputs it ran on: leaves that want a gradient where the position below trains."""
    bind: list[dict[str, torch.Tensor]]
    """One cell: the weights the recomputation binds, set by the BACKWARD to those of its fetch."""


def tapes(runner: StageRunner, early_stop: bool | None) -> bool:
    """Whether position ``runner`` is taped where its plan allows: ``early_stop`` True always,
    False never, None when its stage is large (:data:`EARLY_STOP_MIN_NUMEL`). Only positions that
    train and run the lean way (no buffers, no frozen base) are."""
    if early_stop is False or not runner.simple or not runner.trains:
        return False
    return early_stop is True or runner.own_numel >= EARLY_STOP_MIN_NUMEL  # its own part of a unit


def taped_forward(
    runner: StageRunner,
    weights: torch.Tensor,
    inputs: Boundary,
    around: Callable[[], Any],
) -> tuple[TapedForward, Boundary]:
    """Run position ``runner`` forward on ``weights`` from ``inputs`` (made leaves that want a
    gradient by the caller, where wanted), recording its graph; ``around()`` is the position's
    RNG context (recording at a first run, replaying after), entered by the recomputation too.
    Returns the record and the output, detached, as the next position's input."""
    kept, leaves = runner.bound_leaves(weights)
    bind = [kept]

    def run(*xs: Any) -> Any:
        with around():
            return runner.call_own(bind[0], xs)

    with torch.enable_grad():
        out = checkpoint(run, *inputs, use_reentrant=False, preserve_rng_state=False, determinism_check="none")
    following = tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in output_boundary(out))
    return TapedForward(out, list(leaves), inputs, bind), following
