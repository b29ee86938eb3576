"""The per-stage update: mean of the workers' gradients, then PyTorch's fused CPU optimizer.

``torch.optim.AdamW(fused=True)`` on a flat fp32 tensor runs at memory bandwidth on CPU and is as
fast as DeepSpeed's hand-written CPU Adam (see REFERENCES); writing our own loop would be slower.
"""

from __future__ import annotations

import torch

from wstream.protocol import SGD, AdamW, OptimizerSpec


def state_bytes_per_element(spec: OptimizerSpec) -> int:
    """Optimizer state in bytes per parameter (fp32 moments)."""
    if isinstance(spec, AdamW):
        return 8
    return 4 if spec.momentum > 0 else 0


class StageOptimizer:
    """Owns the torch optimizer of one stage's flat fp32 master tensor."""

    def __init__(self, spec: OptimizerSpec, master: torch.Tensor) -> None:
        self.master = master
        if isinstance(spec, AdamW):
            self._opt: torch.optim.Optimizer = torch.optim.AdamW(
                [master], lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay, fused=True
            )
        elif isinstance(spec, SGD):
            self._opt = torch.optim.SGD(
                [master],
                lr=spec.lr,
                momentum=spec.momentum,
                dampening=spec.dampening,
                weight_decay=spec.weight_decay,
                nesterov=spec.nesterov,
                fused=True,
            )
        else:  # pragma: no cover - the schema admits no other kind
            raise TypeError(f"unsupported optimizer spec {spec!r}")
        self._scales: dict[float, torch.Tensor] = {}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The optimizer's per-parameter state (live tensors: moments, step count)."""
        return {k: v for k, v in self._opt.state.get(self.master, {}).items() if isinstance(v, torch.Tensor)}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore state saved by :meth:`state_tensors` (from a snapshot)."""
        if tensors:
            self._opt.state[self.master] = {k: v.clone() for k, v in tensors.items()}

    def step(self, grad: torch.Tensor, *, grad_scale: float | None = None, lr: float | None = None) -> None:
        """Apply one update with ``grad / grad_scale`` (the fused kernel's ``grad_scale`` input, which
        AMP uses to unscale: dividing by the number of workers and the clipping factor costs no
        pass over memory) at learning rate ``lr`` (None: the spec's)."""
        scale = None
        if grad_scale is not None and grad_scale != 1.0:
            scale = self._scales.get(grad_scale)
            if scale is None:
                if len(self._scales) > 64:
                    self._scales.clear()
                scale = self._scales[grad_scale] = torch.tensor(float(grad_scale))
        self._opt.grad_scale = scale  # type: ignore[attr-defined]
        if lr is not None:
            self._opt.param_groups[0]["lr"] = lr
        self.master.grad = grad
        try:
            self._opt.step()
        finally:
            self.master.grad = None
