"""What flows between stages (a :data:`Boundary`: the next stage's positional arguments), and
how the executor handles it: its bytes, micro-batch lanes packed into one boundary and back, and
placing inputs on the worker's device. Separate from ``stages.py`` (layouts, skeletons, running a
stage) because the plan's bookkeeping needs these and nothing of a stage."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

Boundary = tuple[Any, ...]
"""What flows between stages: the positional arguments of the next stage."""


def as_boundary(value: Any) -> Boundary:
    """A stage's output as the next stage's positional arguments."""
    return value if isinstance(value, tuple) else (value,)


def output_boundary(value: Any) -> Boundary:
    """A stage's output as the next stage's positional arguments (:func:`as_boundary`), refused
    when its tensors sit in a list, a dict or a nested tuple: gradients flow back through the
    boundary's own tensors only, so the stages below would silently get no gradient."""
    if isinstance(value, torch.Tensor):  # the common case, first
        return (value,)
    b = as_boundary(value)
    for item in b:
        if isinstance(item, (list, tuple, dict)) and _holds_tensors(item):
            raise TypeError(
                f"a stage returned {'a tuple holding ' if isinstance(value, tuple) else ''}a {type(item).__name__} of "
                "tensors: wstream passes a tensor or a flat tuple of them from one stage to the next (the gradients "
                "flow back through those only, so the stages below would get none); return a flat tuple"
            )
    return b


def _holds_tensors(value: Any) -> bool:
    items = value.values() if isinstance(value, dict) else value
    return any(isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple, dict)) and _holds_tensors(v)) for v in items)


def boundary_bytes(b: Boundary) -> int:
    if len(b) == 1:  # one tensor between stages, the common case: no generator per stage run
        t = b[0]
        return t.nbytes if isinstance(t, torch.Tensor) else 0
    return sum(t.nbytes for t in b if isinstance(t, torch.Tensor))


def batch_size(value: Any) -> int | None:
    """The size of dim 0 of the first batched tensor in ``value`` (a tensor, or a tuple or list)."""
    items = list(value) if isinstance(value, (tuple, list)) else [value]
    return next((t.shape[0] for t in items if isinstance(t, torch.Tensor) and t.dim() > 0), None)


def check_micro_batches(inputs: Any, targets: Any, k: int) -> None:
    """``k`` is a whole number of micro-batches, and inputs and targets are cut alike: with
    different batch sizes each micro-batch's outputs would meet another share of the targets
    (a loss that broadcasts trains on that silently)."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"micro_batches must be an int, got {k!r}")
    if k == 1:
        return
    n_in, n_out = batch_size(inputs), batch_size(targets)
    if n_in is not None and n_out is not None and n_in != n_out:
        raise ValueError(
            f"inputs have a batch of {n_in} and targets of {n_out}: with micro_batches={k} both are cut along dim 0 "
            "into the same micro-batches, so they must have the same batch size"
        )


def split_micro_batches(value: Any, k: int, *, what: str) -> list[Any]:
    """``value`` cut into ``k`` micro-batches along dim 0 of every tensor in it.

    ``value`` is a tensor, a tuple or list of them (other items, such as ``None``, a number or a 0-d
    tensor, are handed to every micro-batch unchanged), or anything else (handed on unchanged).
    Every tensor must have the same batch size, at least ``k``; ``torch.tensor_split`` decides the
    cut, so the micro-batches are those of ordinary gradient accumulation over the same chunks.
    A side input without a batch dimension cannot go through here: pass it as a stage's buffer.
    """
    if k < 1:
        raise ValueError(f"micro_batches must be >= 1, got {k}")
    if k == 1:
        return [value]
    items = list(value) if isinstance(value, (tuple, list)) else [value]
    batched = [isinstance(t, torch.Tensor) and t.dim() > 0 for t in items]
    sizes = {t.shape[0] for t, b in zip(items, batched) if b}
    if not sizes:
        return [value] * k
    if len(sizes) != 1:
        raise ValueError(
            f"{what}: every tensor is split into micro-batches along dim 0, so all need one batch size; "
            f"got {sorted(sizes)}"
        )
    (batch,) = sizes
    if batch < k:
        raise ValueError(f"{what}: a batch of {batch} cannot make {k} micro-batches")
    parts = [torch.tensor_split(t, k) if b else [t] * k for t, b in zip(items, batched)]
    per_mb = [[p[j] for p in parts] for j in range(k)]
    if isinstance(value, tuple):
        return [tuple(x) for x in per_mb]
    if isinstance(value, list):
        return per_mb
    return [x[0] for x in per_mb]


def lane_weights(value: Any, k: int) -> list[float] | None:
    """Each micro-batch's share of the batch (n_j / N) where :func:`split_micro_batches` splits
    ``value`` unevenly; None where the k shares are equal (each 1/k)."""
    batch = batch_size(value)
    if k == 1 or batch is None or batch % k == 0:
        return None
    return [(batch // k + (1 if j < batch % k else 0)) / batch for j in range(k)]  # torch.tensor_split's sizes


def join_lanes(lanes: Iterable[Boundary]) -> Boundary:
    """Micro-batch boundaries packed as one (lane after lane), for the plan executor's bookkeeping."""
    out: list[Any] = []
    for b in lanes:
        out.extend(b)
    return tuple(out)


def lanes_of(packed: Boundary, k: int) -> list[Boundary]:
    """The inverse of :func:`join_lanes`: every lane of one position has the same arity."""
    if k == 1:
        return [packed]
    arity, rest = divmod(len(packed), k)
    assert not rest, "micro-batch lanes of unequal arity: a bug in wstream"
    return [packed[j * arity : (j + 1) * arity] for j in range(k)]


def place(value: Any, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    """``value`` (a tensor, or a tuple or list of items) on ``device``, floating-point tensors cast
    to ``dtype`` when given: a job computes in its published dtype from its first stage's input on
    (a no-op for fp32 tensors already there)."""
    if isinstance(value, torch.Tensor):
        cast = dtype if dtype is not None and value.is_floating_point() else None
        return value.to(device=device, dtype=cast)
    if type(value) in (tuple, list):
        return type(value)(place(v, device, dtype) for v in value)
    return value
