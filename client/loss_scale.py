"""Dynamic loss scaling for float16 jobs, decided stage by stage so that no step is skipped.

# NOTE [Per-stage loss scaling]
# float16 gradients underflow below 6e-8 and overflow above 65504, so fp16 training seeds the
# backward pass with a scale S instead of 1 and divides it out of the gradients afterwards.
# PyTorch's GradScaler then *skips the whole step* when any gradient is inf/nan. wstream cannot skip
# a step after the fact: the server updates each stage as soon as its gradients arrive, so when
# stage 3 overflows the stages above it are updated already (holding every update until the end of
# the backward would lose the overlap; keeping the old state to roll back would double the
# optimizer's memory). Instead a worker never sends a gradient that is not finite:
# 1. Each micro-batch's backward is seeded at the loss with the step's scale S (in fp32).
# 2. After a stage's backward for a micro-batch the worker checks its parameter gradients and its
#    input gradients (what goes down to the stage below). If any is inf/nan, that micro-batch's
#    scale is multiplied by ``backoff_factor`` and the stage is run again from its input (same RNG
#    state, as any recomputation) with the incoming gradient multiplied by the same factor. By a
#    power of two that multiplication is exact, so the retried gradients are those of the lower
#    scale; the stages below carry on at the lower scale.
# 3. Parameter gradients are cast to fp32 and divided by their micro-batch's scale on the device,
#    then summed over micro-batches and pushed: the server receives true gradients, in the same
#    wire format as every job, and each data-parallel worker may hold its own scale.
# 4. After the step S becomes the smallest scale any micro-batch ended with if one backed off;
#    otherwise after ``growth_interval`` steps in a row without a back-off S grows by
#    ``growth_factor`` (GradScaler's rule, same defaults).
# An overflow therefore costs one more forward and backward of the stage it happened in (per
# halving), not a lost step. A loss that is not finite is refused before anything is sent.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LossScale:
    """How a trainer scales float16 gradients (NOTE [Per-stage loss scaling]); the defaults are
    ``torch.amp.GradScaler``'s."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 2.0**-24
    """A micro-batch whose gradient is still not finite below this scale is refused: the cause is
    not range (the smallest fp16 subnormal is 2^-24) but a forward pass that made inf or nan."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.init_scale) and self.init_scale > 0):
            raise ValueError(f"init_scale must be a finite number > 0, got {self.init_scale}")
        if not self.growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor}")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor}")
        if self.growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {self.growth_interval}")
        if not 0 < self.min_scale <= self.init_scale:
            raise ValueError(f"min_scale must be in (0, init_scale], got {self.min_scale}")


class LossScaler:
    """The scale of a trainer's next step, and the rule that moves it."""

    def __init__(self, config: LossScale) -> None:
        self.config = config
        self.scale = config.init_scale
        self.clean_steps = 0
        """Steps in a row that ended without a back-off (growth comes at ``growth_interval``)."""
        self.backoffs = 0
        """Stage re-runs made because a gradient was not finite, over the trainer's life."""

    def back_off(self, scale: float, where: str) -> float:
        """The scale to retry at after a gradient at ``scale`` was not finite."""
        lower = scale * self.config.backoff_factor
        if lower < self.config.min_scale:
            raise FloatingPointError(
                f"{where}: the gradient is not finite even at loss scale {scale:g}: the forward pass "
                "made inf or nan (a float16 range problem would have cleared by now); nothing of this "
                "stage was sent"
            )
        self.backoffs += 1
        return lower

    def end_step(self, final_scales: Iterable[float]) -> None:
        """Apply the growth/back-off rule once a step's micro-batches ended at ``final_scales``."""
        lowest = min(final_scales, default=self.scale)
        if lowest < self.scale:
            self.scale = lowest
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.config.growth_interval:
            self.scale *= self.config.growth_factor
            self.clean_steps = 0


def scaler_for(dtype: torch.dtype, wanted: LossScale | bool | None, job: str) -> LossScaler | None:
    """The loss scaler of a trainer of job ``job`` computing in ``dtype`` (``Precision.loss_scale``
    is ``wanted``): None (the default) scales float16 and nothing else. Warns when a float16 job
    runs unscaled."""
    if wanted is None:
        wanted = dtype == torch.float16
    scaler = None if wanted is False else LossScaler(LossScale() if wanted is True else wanted)
    if dtype == torch.float16 and scaler is None:
        log.warning(
            "job %r computes in float16 with loss scaling switched off: gradients below 6e-8 "
            "become 0 and above 65504 become inf",
            job,
        )
    return scaler


def all_finite(tensors: Iterable[torch.Tensor | None]) -> bool:
    """True when no element of any tensor is inf or nan: one device synchronisation for the lot
    (``amax`` propagates nan and, unlike a norm, cannot overflow on finite values)."""
    peaks = [t.detach().abs().amax().float() for t in tensors if t is not None and t.numel()]
    return not peaks or bool(torch.stack(peaks).isfinite().all())


def unscaled(grads: Iterable[torch.Tensor | None], scale: float) -> list[torch.Tensor | None]:
    """``grads`` in fp32, divided by ``scale`` (a multiplication by its inverse: exact for powers of
    two), as new tensors: a parameter's gradient may be the very tensor passed down as its stage
    input's gradient, which stays scaled (``GradientSum`` in client/plan_run.py)."""
    inverse = 1.0 / scale
    return [None if g is None else g.float() * inverse for g in grads]
