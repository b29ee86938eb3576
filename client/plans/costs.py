"""The cost model: what each stage of a chain costs (:class:`StageCosts`, measured by the
trainer's profiling pass or given) and what a plan costs under it (:func:`plan_time`).

Griewank and Walther's model (../shared/REFERENCES.md): ``slots`` counts kept states, the one
holding x_0 included; one stage's tape is live at a time; each stage runs once with autograd (its
BACKWARD). The number of ADVANCEs is the recomputation a plan costs; keeping every boundary
(``store_all``) needs n-1 of them, the least possible. With streamed weights every ADVANCE and
BACKWARD of stage i also fetches w_i, which :meth:`StageCosts.advance_cost` prices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .plan import Op, Plan, PlanError


@dataclass(frozen=True, slots=True)
class StageCosts:
    """Per-stage costs of a chain, as measured by a profiling pass (or given).

    ``forward_s[i]``: seconds of an untaped forward of stage i; ``state_bytes[i]``: size of its
    input x_i; ``tape_bytes[i]``: extra memory while stage i runs with autograd and backward;
    ``weight_bytes[i]``: bytes fetched for every run of stage i; ``bandwidth``: bytes/s of that
    fetch (0 = free, as on the zero-copy CPU path)."""

    forward_s: tuple[float, ...]
    state_bytes: tuple[int, ...]
    tape_bytes: tuple[int, ...]
    weight_bytes: tuple[int, ...] = ()
    bandwidth: float = 0.0
    host_bandwidth: float = 0.0
    """Bytes/s of copying a stage input to host memory and back (for ``offload``)."""
    host_is_device: bool = False
    """The worker computes in host memory (a CPU worker): an offloaded input is a second copy in
    the same memory, beside the budget, so ``auto`` never chooses ``offload``."""

    def __post_init__(self) -> None:
        n = len(self.forward_s)
        if n < 1 or len(self.state_bytes) != n or len(self.tape_bytes) != n:
            raise PlanError("StageCosts needs forward_s, state_bytes and tape_bytes of one equal, non-zero length")
        if self.weight_bytes and len(self.weight_bytes) != n:
            raise PlanError("StageCosts.weight_bytes must have one entry per stage")

    @property
    def n(self) -> int:
        return len(self.forward_s)

    def for_micro_batches(self, k: int) -> StageCosts:
        """The costs of running every stage for ``k`` micro-batches at once (stage-major), from a
        profile of one: compute and stage inputs grow k-fold while the weights move once; in
        BACKWARD one micro-batch's tape is live at a time, next to every micro-batch's output
        gradient and input gradient (k - 1 more of each than with one micro-batch)."""
        if k == 1:
            return self
        n = self.n
        out_bytes = [self.state_bytes[i + 1] if i + 1 < n else 0 for i in range(n)]
        return dataclasses.replace(
            self,
            forward_s=tuple(f * k for f in self.forward_s),
            state_bytes=tuple(s * k for s in self.state_bytes),
            tape_bytes=tuple(t + (k - 1) * (s + o) for t, s, o in zip(self.tape_bytes, self.state_bytes, out_bytes)),
        )

    def advance_cost(self, i: int) -> float:
        """Seconds one recomputation of stage i costs: its forward and, streamed, its weights."""
        fetch = self.weight_bytes[i] / self.bandwidth if self.weight_bytes and self.bandwidth > 0 else 0.0
        return self.forward_s[i] + fetch



def plan_time(costs: StageCosts, plan: Plan) -> float:
    """Seconds of recomputation ``plan`` costs under ``costs``."""
    return sum(costs.advance_cost(i) for op, i in plan.actions if op == Op.ADVANCE)
