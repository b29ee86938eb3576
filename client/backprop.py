"""One stage's backpropagation: the gradients of given inputs from given roots and their gradients.

# NOTE [Calling the autograd engine directly]
# ``torch.autograd.grad`` spends about 30 us of Python before the engine starts (turning its
# arguments into tuples, ``_make_grads``' shape checks with symbolic-shape helpers, dtype checks)
# and a stage of a deep chain is backpropagated once per step: on a chain of 16-wide layers that
# was a fifth of a BACKWARD (BENCHMARKS.md, issue 17). What ``_make_grads`` checks cannot fail
# here: every root is a stage output and its gradient the next stage's input gradient, of the
# same shape, dtype and device, made by the engine itself. So where every root has a gradient
# tensor, :func:`backprop` hands them to the function ``torch.autograd.grad`` itself ends in
# (``torch.autograd.graph._engine_run_backward``, with ``grad``'s own arguments); anywhere else
# (the loss, whose gradient ``_make_grads`` makes; a torch without that function) it calls
# ``torch.autograd.grad``. Both give the same tensors: the engine computes them either way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

try:  # private, so looked up once and checked: a torch without it takes the public path
    from torch.autograd.graph import _engine_run_backward as _engine
except ImportError:  # pragma: no cover - every torch this project supports has it
    _engine = None


def backprop(
    roots: Sequence[torch.Tensor], root_grads: Sequence[torch.Tensor | None], inputs: Sequence[torch.Tensor]
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of ``inputs`` (None where a root does not reach one) from ``roots`` seeded
    with ``root_grads``, without keeping the graph: ``torch.autograd.grad(roots, inputs,
    root_grads, allow_unused=True)``, through the engine directly where it may be (NOTE above)."""
    if _engine is None or not roots or any(g is None for g in root_grads):
        return torch.autograd.grad(roots, inputs, root_grads, allow_unused=True)
    return _engine(tuple(roots), tuple(root_grads), False, False, tuple(inputs), True, accumulate_grad=False)
