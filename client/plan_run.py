"""The state of one step while the executor runs its plan: current input, kept inputs, gradients.

Separate from the executor (``executor.py``) because it is plain bookkeeping: which stage input is
current, which are kept on the device or on the host, the gradients summed so far per stage, the
recorded RNG states, and the live activation bytes (counted as the plan goes, for the peak).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .boundary import Boundary, boundary_bytes
from .offload import PendingMove
from .stages import Buffers, StageRunner
from .taped import TapedForward


class PlanRun:
    """The executor's state during one step. Live bytes are counted incrementally (O(1) per
    action: a 10,000-stage chain makes tens of thousands of actions per step)."""

    __slots__ = (
        "current", "kept", "host", "arriving", "rng", "grad_out", "loss", "pushed", "peak_bytes", "last",
        "runner_at", "held", "grads", "_kept_bytes", "_arriving_bytes", "_current_bytes", "_current_kept",
        "k", "targets", "advanced", "scales", "step", "delayed", "buffers", "buffers_before", "buffers_start",
        "tapes", "lane_weights", "all_finite",
    )

    def __init__(
        self,
        inputs: Boundary,
        runner_at: Callable[[int], StageRunner],
        *,
        targets: list[Any],
        k: int = 1,
        last: int = -1,
        scale: float | None = None,
        step: int = 0,
        delayed: bool = False,
        lane_weights: list[float] | None = None,
        all_finite: Callable[[bool], bool] | None = None,
    ) -> None:
        self.step = step  # the job's step this run trains
        self.delayed = delayed  # it may end before its updates (a delayed-update job past warm-up)
        self.k = k  # micro-batches: every state is k lanes packed (see ``join_lanes``)
        self.lane_weights = lane_weights  # each micro-batch's share (n_j / N) of an uneven split; None: 1/k each
        # ranks that all-reduce: whether every rank's loss is finite, given this rank's (they raise together)
        self.all_finite = all_finite
        self.scales = None if scale is None else [scale] * k  # each micro-batch's loss scale, if scaling
        self.advanced: set[int] = set()  # positions run forward this step (a rerun is a recomputation)
        self.targets = targets  # one per micro-batch
        self.last = last  # the position whose BACKWARD computes the loss
        self.runner_at = runner_at  # position -> its runner (a loop: the body, for any position)
        self.held: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # (weights, base) fetched once for the whole step (a loop body's)
        self.grads: dict[int, GradientSum] = {}  # stage -> gradient summed over its positions so far
        # NOTE [Buffers] in executor.py: stage -> its buffers as this step's real forwards left them,
        # and (position, micro-batch) -> the buffers its real forward started from (for its reruns)
        self.buffers: dict[int, Buffers] = {}
        self.buffers_start: dict[int, Buffers] = {}  # stage -> its integer buffers as fetched (counts push increments)
        self.buffers_before: dict[tuple[int, int], Buffers] = {}
        self.current: tuple[int, Boundary] | None = None
        self.kept: dict[int, Boundary] = {}
        self.host: dict[int, PendingMove] = {}  # offloaded inputs (a copy, also on a CPU worker)
        self.arriving: dict[int, PendingMove] = {}  # inputs being prefetched back from the host
        self.rng: dict[tuple[int, int], Any] = {}  # (stage, micro-batch) -> RNG state of its first run
        self.grad_out: list[torch.Tensor | None] | None = None
        # position -> the graphs its taped forward kept for its BACKWARD, one per micro-batch (NOTE
        # [Taped forwards and early stop] in plans/taping.py)
        self.tapes: dict[int, list[TapedForward]] = {}
        self.loss = 0.0
        self.pushed = False
        self.peak_bytes = 0
        self._kept_bytes = 0
        self._arriving_bytes = 0
        self._current_bytes = 0
        self._current_kept: int | None = None  # the kept index ``current`` is, if it is one
        self.set_current(0, inputs)

    def set_current(self, index: int, b: Boundary) -> None:
        self.current = (index, b)
        self._current_bytes = boundary_bytes(b)
        self._current_kept = None
        self._account()

    def drop_current(self) -> None:
        self.current = None
        self._current_bytes = 0
        self._current_kept = None

    def keep(self, i: int) -> None:
        assert self.current is not None
        self.kept[i] = self.current[1]
        self._kept_bytes += self._current_bytes
        self._current_kept = i
        self._account()

    def restore(self, i: int) -> None:
        if i in self.arriving:  # a PREFETCH still in flight: the compute waits for it here
            pending = self.arriving.pop(i)
            self._arriving_bytes -= pending.nbytes
            self.kept[i] = pending.result()
            self._kept_bytes += boundary_bytes(self.kept[i])
        self.current = (i, self.kept[i])
        self._current_bytes = boundary_bytes(self.kept[i])
        self._current_kept = i

    def free(self, i: int) -> None:
        if i in self.kept:
            self._kept_bytes -= boundary_bytes(self.kept.pop(i))
            if self._current_kept == i:
                self._current_kept = None  # still the current input: counted as that now
        else:
            self._arriving_bytes -= self.arriving.pop(i).nbytes
        self._account()

    def arrive(self, i: int, pending: PendingMove) -> None:
        self.arriving[i] = pending
        self._arriving_bytes += pending.nbytes
        self._account()

    def add_grads(
        self, stage: int, size: int, indices: Sequence[int], grads: Sequence[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        """Add one position's gradients to its stage's sum (``size`` entries, ``spec.params``
        order): ``grads[k]`` goes to entry ``indices[k]``; return the sum. Only the position's own
        entries are touched, so a unit of many stages costs each position its own parameters."""
        acc = self.grads.get(stage)
        if acc is None:
            self.grads[stage] = acc = GradientSum(size)
        for k, g in zip(indices, grads):
            acc.add(k, g)
        return acc.values

    def _account(self) -> None:
        live = self._kept_bytes + self._arriving_bytes
        if self.current is not None and self._current_kept is None:
            live += self._current_bytes
        self.peak_bytes = max(self.peak_bytes, live)


LOW_PRECISION = (torch.bfloat16, torch.float16)


class GradientSum:
    """Gradients summed slot by slot, as accumulation into ``.grad`` sums them. The first gradient
    of a slot is kept as autograd returned it, and the second is added *out of place*: autograd
    may return one tensor for several uses (in ``x + w`` with ``w`` of ``x``'s shape, the gradient
    of ``w`` is the very tensor passed down as ``x``'s), so adding into it would change a gradient
    still to be used. The sum is then this object's own tensor, and later gradients are added to it
    in place (torch's AccumulateGrad likewise copies a gradient it does not own). A 16-bit
    gradient is summed in fp32, as the server's sums, the all-reduce and the loss-scaled path are
    (fp32-master mixed precision): summed in bf16, 32 micro-batches doubled its rounding error."""

    __slots__ = ("values", "_owned")

    def __init__(self, size: int) -> None:
        self.values: list[torch.Tensor | None] = [None] * size
        self._owned = [False] * size

    def add(self, k: int, g: torch.Tensor | None) -> None:
        if g is None:
            return
        acc = self.values[k]
        if acc is None:
            self.values[k] = g
        elif self._owned[k]:
            acc.add_(g)
        else:
            self.values[k] = acc.float() + g if acc.dtype in LOW_PRECISION else acc + g
            self._owned[k] = True

    def add_all(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Add ``grads[k]`` to slot k for every k."""
        for k, g in enumerate(grads):
            self.add(k, g)
