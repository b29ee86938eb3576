"""Flat stage layouts: parameters as aligned views into one buffer per stage."""

from __future__ import annotations

import math
from collections.abc import Iterable

from .errors import LayoutError
from .messages import MAX_NUMEL, ParamSpec, StageSpec

ALIGN_ELEMENTS = 16
"""Every parameter starts at a multiple of 16 elements (64 bytes in fp32): vector-friendly views."""


def numel_of(shape: Iterable[int]) -> int:
    return math.prod(shape)


def align(n: int, to: int = ALIGN_ELEMENTS) -> int:
    return (n + to - 1) // to * to


def build_stage_spec(name: str, params: Iterable[tuple[str, tuple[int, ...]]]) -> StageSpec:
    """Lay ``(name, shape)`` pairs out back to back, each aligned to :data:`ALIGN_ELEMENTS`."""
    specs: list[ParamSpec] = []
    offset = 0
    for pname, shape in params:
        specs.append(ParamSpec(pname, tuple(int(d) for d in shape), offset))
        offset = align(offset + numel_of(shape))
    return StageSpec(name=name, numel=offset, params=specs)


def validate_stage(index: int, spec: StageSpec) -> None:
    """Raise :class:`LayoutError` unless the views of ``spec`` are disjoint and inside the buffer."""
    where = f"stage {index} ({spec.name!r})"
    if not spec.params:
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
        spans.append((p.offset, p.offset + n, p.name))
    spans.sort()
    for (a0, a1, an), (b0, _b1, bn) in zip(spans, spans[1:]):
        if b0 < a1:
            raise LayoutError(f"{where}: parameters {an!r} [{a0}, {a1}) and {bn!r} overlap at {b0}")


def validate_stages(stages: list[StageSpec]) -> None:
    for i, spec in enumerate(stages):
        validate_stage(i, spec)


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
        return f"stage {i}: parameter order or offsets differ from the job's layout"
    return None
