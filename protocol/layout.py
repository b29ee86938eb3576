"""Flat stage layouts: parameters as aligned views into one buffer per stage."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from .errors import LayoutError
from .messages import MAX_NUMEL, ParamSpec, StageSpec

ALIGN_ELEMENTS = 16
"""Every parameter starts at a multiple of 16 elements (64 bytes in fp32): vector-friendly views."""


def numel_of(shape: Iterable[int]) -> int:
    return math.prod(shape)


def align(n: int, to: int = ALIGN_ELEMENTS) -> int:
    return (n + to - 1) // to * to


def build_stage_spec(name: str, params: Iterable[tuple[Any, ...]]) -> StageSpec:
    """Lay ``(name, shape)`` pairs, or ``(name, shape, group, frozen[, buffer])`` tuples, out back
    to back, each aligned to :data:`ALIGN_ELEMENTS`."""
    specs: list[ParamSpec] = []
    offset = 0
    for pname, shape, *marks in params:
        specs.append(ParamSpec(pname, tuple(int(d) for d in shape), offset, *marks))
        offset = align(offset + numel_of(shape))
    return StageSpec(name=name, numel=offset, params=specs)


class GradLayout(NamedTuple):
    """The layout of a stage's *gradient* (what a worker pushes and the optimizer reads): the
    offset of each of ``spec.params`` in a flat buffer of ``numel`` elements, None for a frozen
    parameter (it has no gradient)."""

    numel: int
    offsets: tuple[int | None, ...]


class PushLayout(NamedTuple):
    """The layout of what a worker pushes for a stage (protocol 6): the stage's gradient
    (:func:`grad_layout`, its first ``grad_numel`` elements) followed by the new values of its
    buffers, each aligned to :data:`ALIGN_ELEMENTS`; ``numel`` in all. ``offsets``: each of
    ``spec.params``' place in it (a trained parameter's gradient, a buffer's value), None for a
    frozen parameter. Without buffers it is the gradient layout exactly."""

    numel: int
    grad_numel: int
    offsets: tuple[int | None, ...]
    pieces: tuple[tuple[int, int], ...]
    """Each of ``spec.params`` with a place, in the order of their places: (its index in
    ``spec.params``, the zeros before it: alignment padding). What a worker assembles its push
    from, one piece after another (``client/scatter.py``, ``scatter_grads``)."""
    tail: int
    """Zeros after the last piece."""
    max_gap: int
    """The longest run of zeros before a piece or after the last."""


_LAYOUTS: dict[int, tuple[StageSpec, GradLayout, PushLayout]] = {}
_LAYOUTS_LOCK = threading.Lock()
GRAD_LAYOUT_CACHE = 4096
"""Stage specs whose gradient and push layouts :func:`grad_layout` and :func:`push_layout` keep
(oldest dropped first)."""


def grad_layout(spec: StageSpec, *, cache: bool = True) -> GradLayout:
    """The gradient layout of ``spec``: exactly its own offsets and numel when no parameter is
    frozen (an ordinary stage), else its trained parameters packed back to back in spec order,
    each aligned to :data:`ALIGN_ELEMENTS` (the frozen ones, buffers included, take no room).

    Called for every push, so the result is kept per spec *object* (a ``StageSpec`` holds a list
    and cannot be hashed): keyed by ``id`` with the spec itself kept beside it, so that an id is
    never reused while its entry lives; at most :data:`GRAD_LAYOUT_CACHE` entries. ``cache=False``
    computes it without keeping it (for a holder that keeps it itself, such as the server's
    stages, whose specs should not outlive their job here)."""
    return _layouts(spec, cache)[0]


def push_layout(spec: StageSpec, *, cache: bool = True) -> PushLayout:
    """The layout of ``spec``'s push: its gradient, then its buffers' values (:class:`PushLayout`);
    kept as :func:`grad_layout` keeps its result."""
    return _layouts(spec, cache)[1]


def _layouts(spec: StageSpec, cache: bool) -> tuple[GradLayout, PushLayout]:
    if cache:
        hit = _LAYOUTS.get(id(spec))
        if hit is not None and hit[0] is spec:
            return hit[1], hit[2]
    grad = _grad_layout(spec)
    push = _push_layout(spec, grad)
    if cache:
        with _LAYOUTS_LOCK:
            _LAYOUTS[id(spec)] = (spec, grad, push)
            while len(_LAYOUTS) > GRAD_LAYOUT_CACHE:
                del _LAYOUTS[next(iter(_LAYOUTS))]
    return grad, push


def _grad_layout(spec: StageSpec) -> GradLayout:
    if not any(p.frozen for p in spec.params):
        return GradLayout(spec.numel, tuple(p.offset for p in spec.params))
    offsets: list[int | None] = []
    offset = 0
    for p in spec.params:
        if p.frozen:
            offsets.append(None)
            continue
        offsets.append(offset)
        offset = align(offset + numel_of(p.shape))
    return GradLayout(offset, tuple(offsets))


def _push_layout(spec: StageSpec, grad: GradLayout) -> PushLayout:
    if not any(p.buffer for p in spec.params):
        return _with_pieces(spec, grad.numel, grad.numel, grad.offsets)
    offsets = list(grad.offsets)
    offset = grad.numel
    for k, p in enumerate(spec.params):
        if p.buffer:
            offsets[k] = offset
            offset = align(offset + numel_of(p.shape))
    return _with_pieces(spec, offset, grad.numel, tuple(offsets))


def _with_pieces(spec: StageSpec, numel: int, grad_numel: int, offsets: tuple[int | None, ...]) -> PushLayout:
    """The push layout of ``offsets`` (``numel`` in all), with its pieces and gaps."""
    pieces: list[tuple[int, int]] = []
    pos = 0
    for offset, k in sorted((offset, k) for k, offset in enumerate(offsets) if offset is not None):
        pieces.append((k, offset - pos))
        pos = offset + numel_of(spec.params[k].shape)
    tail = numel - pos
    return PushLayout(numel, grad_numel, offsets, tuple(pieces), tail, max([gap for _, gap in pieces] + [tail]))


INTEGER_BUFFERS = frozenset({"int64", "int32", "int16", "int8", "uint8"})
"""``ParamSpec.buffer`` values of integer buffers."""

# NOTE [Integer buffers in a 16-bit published copy] (protocol 10)
# A job's published copy is in its compute dtype, and workers read buffers from it. bfloat16 holds
# integers exactly only up to 256 and float16 up to 2048, so a count or a position id read as a
# 16-bit value would be rounded. Therefore, in a bfloat16 or float16 copy:
# 1. An integer buffer of n elements whose room in the layout (from its offset to the next
#    parameter's, or to the stage's end) holds 2n elements is published as n little-endian int32
#    values in its first 2n elements: exact up to 2**31 (the fp32 master holds up to 2**24).
#    Every buffer of up to 8 elements has that room in an aligned layout (BatchNorm's count).
# 2. Any other integer buffer is published cast, as a float one; the Python client refuses one
#    whose values the dtype would round at creation (a bigger buffer is a constant, not a count).
# 3. Both ends compute the set from the spec alone (:func:`exact_integer_buffers`): nothing on
#    the wire says which buffers are published so. An fp32 copy is the master's values.


def exact_integer_buffers(spec: StageSpec) -> tuple[tuple[int, int, int], ...]:
    """``(index in spec.params, offset, n)`` of each integer buffer of ``spec`` that a 16-bit
    published copy holds as int32 values (NOTE [Integer buffers in a 16-bit published copy])."""
    starts = sorted({p.offset for p in spec.params})
    out = []
    for k, p in enumerate(spec.params):
        if p.buffer not in INTEGER_BUFFERS:
            continue
        n = numel_of(p.shape)
        later = [o for o in starts if o > p.offset]
        room = (later[0] if later else spec.numel) - p.offset
        if room >= 2 * n:
            out.append((k, p.offset, n))
    return tuple(out)


def publish_master(
    published: torch.Tensor,
    master: torch.Tensor,
    buffers: Iterable[tuple[int, int, int]],
    ranges: Iterable[tuple[int, int]] | None = None,
) -> None:
    """Copy the fp32 ``master`` into its ``published`` copy (only ``ranges``, ``(start, end)``
    element ranges, where given: the rest is written already), then ``buffers``
    (:func:`exact_integer_buffers`; empty for an fp32 copy) as int32 values (rule 1). Every
    publication goes through here, so none leaves an integer buffer cast."""
    if ranges is None:
        published.copy_(master)
    else:
        for start, end in ranges:
            published[start:end].copy_(master[start:end])
    for _, offset, n in buffers:
        values = master[offset : offset + n].to(torch.int32).view(published.dtype)  # 2n 16-bit elements, the int32s' bytes
        published[offset : offset + 2 * n].copy_(values)


def read_integers(published: torch.Tensor, offset: int, n: int) -> torch.Tensor:
    """The n int32 values rule 1 wrote at ``offset`` of a 16-bit copy (a new tensor: the copy's
    address need not be 4-byte aligned)."""
    return published[offset : offset + 2 * n].clone().view(torch.int32)


def validate_stage(index: int, spec: StageSpec, *, on_base: bool = False) -> None:
    """Raise :class:`LayoutError` unless the views of ``spec`` are disjoint and inside the buffer.

    A stage with nothing in it is refused, except in a job on a frozen base (``on_base``): there
    a stage frozen whole reads every weight from the base's stage and holds nothing of its own,
    yet it must be there, since stage i trains on top of the base's stage i."""
    where = f"stage {index} ({spec.name!r})"
    if not spec.params:
        if on_base and spec.numel == 0:
            return
        raise LayoutError(f"{where} has no parameters: merge parameter-free modules into a neighbouring stage")
    if spec.numel > MAX_NUMEL:
        raise LayoutError(f"{where} has {spec.numel} elements, more than the limit of {MAX_NUMEL}")
    seen: set[str] = set()
    spans: list[tuple[int, int, str]] = []
    for p in spec.params:
        if p.name in seen:
            raise LayoutError(f"{where}: parameter {p.name!r} appears twice")
        seen.add(p.name)
        n = numel_of(p.shape)
        if n == 0:
            raise LayoutError(f"{where}: parameter {p.name!r} has no elements (shape {list(p.shape)})")
        if p.offset + n > spec.numel:
            raise LayoutError(
                f"{where}: parameter {p.name!r} spans [{p.offset}, {p.offset + n}) "
                f"beyond the stage's {spec.numel} elements"
            )
        if p.buffer and (not p.frozen or p.group):
            raise LayoutError(f"{where}: buffer {p.name!r} must be frozen and in group 0 (a buffer is not trained)")
        spans.append((p.offset, p.offset + n, p.name))
    spans.sort()
    for (a0, a1, an), (b0, _b1, bn) in zip(spans, spans[1:]):
        if b0 < a1:
            raise LayoutError(f"{where}: parameters {an!r} [{a0}, {a1}) and {bn!r} overlap at {b0}")


def validate_stages(stages: list[StageSpec]) -> None:
    for i, spec in enumerate(stages):
        validate_stage(i, spec)


def validate_groups(index: int | None, spec: StageSpec, groups: int) -> None:
    """Raise :class:`LayoutError` unless every parameter's ``group`` names the optimizer's own
    settings (0) or one of the job's ``groups`` parameter groups (1..groups). ``index``: the
    stage's, for the message (None: unknown)."""
    where = f"stage {spec.name!r}" if index is None else f"stage {index} ({spec.name!r})"
    for p in spec.params:
        if p.group > groups:
            have = "the job has no parameter groups" if not groups else f"the job's are 1..{groups}"
            raise LayoutError(
                f"{where}: parameter {p.name!r} is in parameter group {p.group}, but {have} "
                "(0: the optimizer's own settings)"
            )


def describe_mismatch(expected: list[StageSpec], actual: list[StageSpec]) -> str | None:
    """A readable account of the first difference between two layouts, or None if equal."""
    if len(expected) != len(actual):
        return f"the job has {len(expected)} stages, the given model has {len(actual)}"
    for i, (e, a) in enumerate(zip(expected, actual)):
        if e == a:
            continue
        enames = {p.name: p for p in e.params}
        anames = {p.name: p for p in a.params}
        missing = sorted(set(enames) - set(anames))
        extra = sorted(set(anames) - set(enames))
        if missing or extra:
            return f"stage {i}: parameters missing {missing}, unexpected {extra}"
        for name, ep in enames.items():
            ap = anames[name]
            if ep.shape != ap.shape:
                return f"stage {i}: parameter {name!r} has shape {list(ap.shape)}, the job has {list(ep.shape)}"
            if ep.buffer != ap.buffer:
                what = {"": "a parameter"}
                return (
                    f"stage {i}: {name!r} is {what.get(ap.buffer, f'a {ap.buffer} buffer')} in the given model, "
                    f"{what.get(ep.buffer, f'a {ep.buffer} buffer')} in the job"
                )
            if ep.frozen != ap.frozen:
                how = ("frozen (requires_grad=False)", "trained")
                return (
                    f"stage {i}: parameter {name!r} is {how[not ap.frozen]} in the given model, "
                    f"{how[not ep.frozen]} in the job"
                )
            if ep.group != ap.group:
                return f"stage {i}: parameter {name!r} is in parameter group {ap.group}, in the job group {ep.group}"
        return f"stage {i}: parameter order or offsets differ from the job's layout"
    return None


def without_groups(spec: StageSpec) -> StageSpec:
    """``spec`` with every parameter in group 0 (to compare layouts whatever their groups)."""
    return StageSpec(
        name=spec.name,
        numel=spec.numel,
        params=[ParamSpec(p.name, p.shape, p.offset, 0, p.frozen, p.buffer) for p in spec.params],
    )
