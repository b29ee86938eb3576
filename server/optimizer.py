"""The per-stage update: PyTorch's fused CPU optimizer on a stage's fp32 master, by parameter group.

``torch.optim.AdamW(fused=True)`` on a flat fp32 tensor runs at memory bandwidth on CPU and is as
fast as DeepSpeed's hand-written CPU Adam (see REFERENCES); writing our own loop would be slower.

# NOTE [Parameter groups on a flat stage]
# 1. An ordinary stage (no frozen parameter, every parameter in group 0) is one flat tensor in one
#    torch param group: one fused call per step, its padding updated with zeros. Its state is
#    torch's own, created lazily by the first step, so snapshots are what they always were.
# 2. Otherwise each trained parameter is its own view of the master, in the torch param group of
#    its ``ParamSpec.group`` (that group's weight decay and lr scale), and its gradient is a view of
#    the pushed gradient at its offset in ``grad_layout(stage)``. Frozen parameters are in no
#    group: no gradient, no state, never changed.
# 3. The state stays *flat per stage* in either case (snapshots keep one tensor per key and stage):
#    flat buffers of the gradient layout's numel, each parameter's state a view of them at its
#    gradient offset, installed in ``opt.state[param]`` by us before torch would create its own.
#    Each parameter has its own ``step`` tensor (the fused kernel adds 1 to every state step in
#    place, so one shared tensor would count once per parameter); they are always equal, and the
#    first is the stage's ``step``.
# 4. SGD's momentum buffer is created by torch at the first step as a copy of the (decayed)
#    gradient, which differs from a zero buffer when dampening > 0; so that first step is left to
#    torch, and its per-parameter buffers are then copied into the flat buffer once.
# 5. The state is created lazily, as torch does (rule 1): a stage that never stepped has none, and
#    its snapshot holds the master alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from wstream.protocol import SGD, AdamW, LayoutError, OptimizerSpec
from wstream.protocol import messages as m
from wstream.protocol.layout import GradLayout, grad_layout, numel_of, validate_groups

from .native import adamw as native_adamw
from .native import available as native_available
from .native import fits_output


def state_bytes_per_element(spec: OptimizerSpec) -> int:
    """Optimizer state in bytes per trained element (fp32 moments)."""
    if isinstance(spec, AdamW):
        return 8
    return 4 if spec.momentum > 0 else 0


def state_nbytes(spec: OptimizerSpec, stage: m.StageSpec) -> int:
    """The optimizer state of ``stage`` in bytes: of its trained elements only (its gradient
    layout, padding included); frozen parameters have none."""
    return grad_layout(stage, cache=False).numel * state_bytes_per_element(spec)


@dataclass(slots=True)
class _Trained:
    """One trained parameter of the grouped path: its view of the master and where its gradient
    (and state) is in the gradient layout."""

    param: torch.Tensor
    offset: int
    numel: int
    at: int
    """Its offset in the master."""


class StageOptimizer:
    """Owns the torch optimizer of one stage's flat fp32 master tensor (NOTE above)."""

    def __init__(
        self, spec: OptimizerSpec, master: torch.Tensor, stage: m.StageSpec, groups: Sequence[m.GroupSpec] = ()
    ) -> None:
        validate_groups(None, stage, len(groups))
        self.spec = spec
        self.master = master
        self.layout: GradLayout = grad_layout(stage, cache=False)
        """Where each parameter's gradient is in the stage's pushed gradient."""
        self._scale: tuple[float, torch.Tensor] | None = None  # the fused kernel's grad_scale, kept while the same
        self._trained: list[_Trained] = []
        self._state: dict[str, torch.Tensor] = {}  # flat state of the grouped path, once created
        self.flat = not any(p.frozen or p.group for p in stage.params)
        """Rule 1 of the NOTE: the whole master is one parameter."""
        self.untrained: tuple[tuple[int, int], ...] = ()
        """The master's ranges no optimizer step changes (frozen parameters and buffers, gaps):
        what a published copy needs besides what :meth:`step` wrote into it."""
        self._groups: dict[int, dict[str, Any]] = {}
        if self.flat:
            self._opt: torch.optim.Optimizer | None = _make(spec, [{"params": [master]}])
            return
        by_group: dict[int, list[torch.Tensor]] = {}
        for p, offset in zip(stage.params, self.layout.offsets):
            if offset is None:  # frozen
                continue
            n = numel_of(p.shape)
            view = master[p.offset : p.offset + n]
            self._trained.append(_Trained(view, offset, n, p.offset))
            by_group.setdefault(p.group, []).append(view)
        param_groups = []
        for k, params in sorted(by_group.items()):
            group = groups[k - 1] if k else m.GroupSpec(name="default")
            decay = spec.weight_decay if group.weight_decay is None else group.weight_decay
            param_groups.append({"params": params, "weight_decay": decay, "lr_scale": group.lr_scale})
        self._opt = _make(spec, param_groups) if param_groups else None  # None: every parameter is frozen
        if self._opt is not None:
            self._groups = {id(p): group for group in self._opt.param_groups for p in group["params"]}
        self.untrained = _complement(master.numel(), [(t.at, t.at + t.numel) for t in self._trained])

    # ---- state (snapshots) -----------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The optimizer's state as flat tensors of the gradient layout (live: moments, step count);
        empty before the first step."""
        if self.flat:
            assert self._opt is not None
            return {k: v for k, v in self._opt.state.get(self.master, {}).items() if isinstance(v, torch.Tensor)}
        if not self._state:
            return {}
        out: dict[str, torch.Tensor] = {}
        if isinstance(self.spec, AdamW):
            out["step"] = self._param_state(self._trained[0])["step"]
        out.update(self._state)
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore state saved by :meth:`state_tensors` (from a snapshot)."""
        if not tensors:
            return
        if self.flat:
            assert self._opt is not None
            self._opt.state[self.master] = {k: v.clone() for k, v in tensors.items()}
            return
        want = self._state_keys()
        if set(tensors) != want or any(
            tensors[k].numel() != self.layout.numel for k in want if k != "step"
        ):
            shapes = {k: tuple(v.shape) for k, v in tensors.items()}
            raise LayoutError(
                f"optimizer state {shapes} does not fit this stage: it needs {sorted(want)} "
                f"(flat ones of {self.layout.numel} elements)"
            )
        flat = {k: v.reshape(-1).clone() for k, v in tensors.items() if k != "step"}
        self._install(flat, tensors.get("step"))

    def _state_keys(self) -> set[str]:
        if isinstance(self.spec, AdamW):
            return {"step", "exp_avg", "exp_avg_sq"}
        return {"momentum_buffer"} if self.spec.momentum > 0 else set()

    def _param_state(self, t: _Trained) -> dict[str, Any]:
        assert self._opt is not None
        return self._opt.state[t.param]  # type: ignore[no-any-return]

    def _install(self, flat: dict[str, torch.Tensor], step: torch.Tensor | None) -> None:
        """Make ``flat`` the state and give each parameter its views of it (rule 3)."""
        self._state = flat
        for t in self._trained:
            state = self._param_state(t)
            if step is not None:
                state["step"] = step.detach().clone().reshape(())
            for k, buf in flat.items():
                state[k] = buf[t.offset : t.offset + t.numel]

    def _create_state(self) -> None:
        """The zero state of AdamW, before its first step (rule 5)."""
        if isinstance(self.spec, AdamW):
            zeros = {k: torch.zeros(self.layout.numel, dtype=torch.float32) for k in ("exp_avg", "exp_avg_sq")}
            self._install(zeros, torch.zeros((), dtype=torch.float32))

    def _gather_momentum(self) -> None:
        """After SGD's first step: torch's per-parameter momentum buffers into one flat buffer (rule 4)."""
        buf = torch.zeros(self.layout.numel, dtype=torch.float32)
        for t in self._trained:
            buf[t.offset : t.offset + t.numel].copy_(self._param_state(t)["momentum_buffer"])
        self._install({"momentum_buffer": buf}, None)

    # ---- the update ------------------------------------------------------------------------------
    def step(
        self, grad: torch.Tensor, *, grad_scale: float | None = None, lr: float | None = None, publish: torch.Tensor | None = None
    ) -> bool:
        """Apply one update with ``grad``, the stage's flat fp32 gradient in its gradient layout
        (``grad_layout(stage).numel`` elements). The fused kernel divides it by ``grad_scale``
        (its ``grad_scale`` input, which AMP uses to unscale: a mean of summed gradients costs no
        extra pass over memory). ``lr``: this step's learning rate in place of the optimizer's;
        each group's is it times the group's ``lr_scale``. ``publish``: the stage's published copy
        (the master's length, another tensor); True when the update wrote its trained
        parameters there too (AdamW by the native kernel, NOTE [Native kernels] rule 2), and only
        :attr:`untrained` is left to copy; False: nothing was written there. AdamW with a
        ``grad_scale`` runs the native kernel too where it is built: torch's fused kernel writes the
        divided gradient back over ``grad`` (4 bytes per parameter more than the update needs)."""
        if grad.numel() != self.layout.numel:
            raise ValueError(
                f"a gradient of {grad.numel()} elements for a stage whose gradient has {self.layout.numel}: "
                "this is a bug in wstream"
            )
        opt = self._opt
        if opt is None:  # every parameter is frozen: nothing to update
            return False
        if grad_scale is None:
            opt.grad_scale = None  # type: ignore[attr-defined]
        else:
            if self._scale is None or self._scale[0] != grad_scale:
                self._scale = (grad_scale, torch.tensor(float(grad_scale)))
            opt.grad_scale = self._scale[1]  # type: ignore[attr-defined]
        base = self.spec.lr if lr is None else lr
        for group in opt.param_groups:
            group["lr"] = base * group.get("lr_scale", 1.0)
        if (publish is not None or grad_scale is not None) and self._native_step(opt, grad, grad_scale or 1.0, publish):
            return publish is not None
        if self.flat:
            self.master.grad = grad
            try:
                opt.step()
            finally:
                self.master.grad = None
            return False
        first_sgd = False
        if not self._state:
            if isinstance(self.spec, AdamW):
                self._create_state()
            else:
                first_sgd = self.spec.momentum > 0
        for t in self._trained:
            t.param.grad = grad[t.offset : t.offset + t.numel]
        try:
            opt.step()
        finally:
            for t in self._trained:
                t.param.grad = None
        if first_sgd:
            self._gather_momentum()
        return False

    def _native_step(
        self, opt: torch.optim.Optimizer, grad: torch.Tensor, grad_scale: float, publish: torch.Tensor | None
    ) -> bool:
        """AdamW (and the published copy, when given) in one pass per trained parameter (NOTE
        [Native kernels] rule 2), on torch's own state (created as torch creates it, its ``step``
        counted as the fused kernel counts it); False when the kernels are off or do not fit,
        having changed nothing."""
        if not isinstance(self.spec, AdamW) or not native_available():
            return False
        if publish is not None and not fits_output(publish, self.master.numel()):
            return False
        if self.flat:
            targets = [(self.master, 0, 0, opt.param_groups[0])]
        else:
            if not self._state:
                self._create_state()
            targets = [(t.param, t.offset, t.at, self._groups[id(t.param)]) for t in self._trained]
        for param, offset, at, group in targets:
            state = opt.state[param]
            if not state:  # the flat path's lazy state, as torch creates it (rule 5)
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            done = native_adamw(
                param, state["exp_avg"], state["exp_avg_sq"], grad[offset : offset + param.numel()],
                lr=group["lr"], betas=self.spec.betas, eps=self.spec.eps, weight_decay=group["weight_decay"],
                step=float(state["step"]) + 1, grad_scale=grad_scale, out=None if publish is None else publish[at : at + param.numel()],
            )
            if not done:  # flat contiguous fp32 views always fit: a bug
                raise RuntimeError(f"the native AdamW refused a parameter of {param.numel()} elements at {at}")
            state["step"] += 1
        return True


def _complement(numel: int, ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """``[0, numel)`` less ``ranges``, as sorted (start, end) pairs."""
    out: list[tuple[int, int]] = []
    at = 0
    for start, end in sorted(ranges):
        if start > at:
            out.append((at, start))
        at = max(at, end)
    if at < numel:
        out.append((at, numel))
    return tuple(out)


def _make(spec: OptimizerSpec, param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    if isinstance(spec, AdamW):
        return torch.optim.AdamW(
            param_groups, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay, fused=True
        )
    if isinstance(spec, SGD):
        return torch.optim.SGD(
            param_groups,
            lr=spec.lr,
            momentum=spec.momentum,
            dampening=spec.dampening,
            weight_decay=spec.weight_decay,
            nesterov=spec.nesterov,
            fused=True,
        )
    raise TypeError(f"unsupported optimizer spec {spec!r}")  # pragma: no cover - the schema admits no other
