"""A stage's gradients into its push: the flat buffer a worker sends for a stage (its gradient in
the push layout, then its buffers' values; ``wstream.protocol.layout.push_layout``).

Apart from ``stages.py`` (layouts, skeletons, running a stage) because it is the hot end of every
backward: a transfer unit's push gathers thousands of small gradients (issue 17), so how they are
written, one ``torch.cat`` or torch's own flattening, is its own concern.
"""

from __future__ import annotations

import warnings

import torch

from wstream.protocol import StageSpec
from wstream.protocol.layout import numel_of, push_layout


def scatter_grads(dst: torch.Tensor, spec: StageSpec, grads: list[torch.Tensor | None]) -> None:
    """Write per-parameter ``grads`` (in ``spec.params`` order) into flat ``dst``, the stage's
    push (``push_layout(spec)``: its gradient, which is ``spec``'s own layout unless a parameter is
    frozen, then its buffers' values; frozen parameters have no place in it); unused parameters
    and alignment padding become zeros. Where every gradient is there in ``dst``'s dtype it is
    one call from the layout's ``pieces``: a transfer unit holds thousands of small parameters,
    and a copy each cost ~5 us, a reshape each ~1.5 us. Small pieces without padding between
    them are flattened by torch in one call and copied (:data:`_FLATTEN_BELOW`), others go
    through one ``torch.cat`` into ``dst``."""
    layout = push_layout(spec)
    if layout.max_gap <= _CAT_ZEROS:
        dtype = dst.dtype
        ordered: list[torch.Tensor] = []
        for k, _ in layout.pieces:
            g = grads[k]
            if g is None or g.dtype != dtype:
                break
            ordered.append(g)
        else:
            with torch.no_grad():  # a buffer a stage updated under autograd may require grad
                if not layout.max_gap and _flatten is not None and layout.numel < _FLATTEN_BELOW * len(ordered):
                    dst[: layout.numel].copy_(_flatten(ordered))
                    return
                zeros = dst.new_zeros(layout.max_gap) if layout.max_gap else dst
                pieces: list[torch.Tensor] = []
                for (_, gap), g in zip(layout.pieces, ordered):
                    if gap:
                        pieces.append(zeros[:gap])
                    pieces.append(g.reshape(-1))
                if layout.tail:
                    pieces.append(zeros[: layout.tail])
                torch.cat(pieces, out=dst[: layout.numel])
            return
    with torch.no_grad():  # a gradient missing or of another dtype, or a long gap: piece by piece
        pos = 0
        for k, gap in layout.pieces:
            at = pos + gap
            if gap:
                dst[pos:at].zero_()
            pos = at + numel_of(spec.params[k].shape)
            g = grads[k]
            if g is None:
                _warn_no_gradient(spec, k)
                dst[at:pos].zero_()  # in place: no temporary as large
            else:
                dst[at:pos].copy_(g.reshape(-1))
        if layout.tail:
            dst[pos : layout.numel].zero_()


_warned: set[tuple[int, str, str]] = set()
"""(stage, parameter) already warned of in this process."""


def _warn_no_gradient(spec: StageSpec, k: int) -> None:
    """Once per parameter in a process: a trained parameter without a gradient is updated as with a
    zero one (DESIGN.md, "A parameter without a gradient")."""
    key = (id(spec), spec.name, spec.params[k].name)  # a job's specs live as long as its connection
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(
        f"stage {spec.name}: parameter {spec.params[k].name!r} got no gradient in a step; the server updates it as with a "
        "zero gradient (weight decay and momentum still move it, as under DistributedDataParallel with "
        "find_unused_parameters=True), where torch.optim on one process skips it. Give it requires_grad=False "
        "if it should not train.",
        UnusedParameterWarning,
        stacklevel=2,
    )


class UnusedParameterWarning(UserWarning):
    """A trained parameter of a stage got no gradient in a step."""


_flatten = getattr(torch._C._nn, "flatten_dense_tensors", None)
"""torch's own flattening of a list of tensors into one (what ``torch._utils._flatten_dense_tensors``
calls), in C++: no Python per piece. Private, so looked up once; without it the ``cat`` path runs."""

_FLATTEN_BELOW = 1024
"""Pieces of fewer elements than this on average are flattened and copied (one extra pass over
the push, about 0.8 ns per element here, against ~1.5 us of reshape per piece saved); larger ones
are concatenated straight into the slot."""

_CAT_ZEROS = 64
"""The longest run of zeros ``scatter_grads`` writes through its ``torch.cat`` (padding); a
parameter without a gradient is zeroed in place instead of by a temporary as large."""
