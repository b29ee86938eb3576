"""Walking a job's chain of stages (layouts, ties, uploads) and the progress bar of a transfer.

Helpers of ``client.py`` (``create_job`` and ``attach_job`` walk the chain the same way), kept
apart so that ``client.py`` holds only the ``Client`` and ``Job`` handles.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from wstream.protocol import LayoutError, StageSpec

from .groups import GroupAssigner
from .stages import Tied, check_integer_buffers, check_tied, frozen_params, skeleton_of, spec_of

Chain = list[tuple[int, nn.Module]]
"""A job's chain: per position, its weight stage and meta skeleton (NOTE [Positions and weight
stages] in ``stages.py``)."""


def layout_on(
    base_stages: list[StageSpec] | None, i: int, module: nn.Module, groups: GroupAssigner | None = None
) -> StageSpec:
    """Stage i's layout: every parameter (those without ``requires_grad`` marked frozen), or on a
    frozen base only the trainable ones (the others must be the base's stage i's, by name and
    shape); ``groups`` gives the trained ones their parameter groups."""
    if base_stages is None:
        return spec_of(i, module, groups=groups)
    if i >= len(base_stages):
        raise LayoutError(f"stage {i}: the base has {len(base_stages)} stages")
    frozen_params(i, module, base_stages[i])  # they match the base, or raise
    return spec_of(i, module, trainable_only=True, groups=groups)


def walk_chain(
    items: Iterable[nn.Module | Tied],
    add_stage: Callable[[int, nn.Module], StageSpec],
    base_stages: list[StageSpec] | None = None,
    *,
    skeletons: bool = True,
) -> tuple[list[StageSpec], Chain]:
    """Walk a job's ``stages`` in order: ``add_stage(i, module)`` lays out (and uploads) weight
    stage i and returns its spec; a :class:`Tied` item is checked against the stages before it
    (and, for a job on a frozen base, ``base_stages``: its frozen parameters are the base's).
    Every module is moved to the meta device once handled, so one at a time is materialized;
    ``skeletons`` False leaves them as they are (a check of the chain before anything is
    uploaded or compared: a refusal must not cost the caller its model)."""
    specs: list[StageSpec] = []
    chain: Chain = []
    seen = SharedWeights()
    keep = skeleton_of if skeletons else (lambda module: module)
    for position, item in enumerate(items):
        check_item(position, item)
        if isinstance(item, Tied):
            check_tied(len(chain), item, specs, base_stages)
            chain.append((item.stage, keep(item.module)))
            continue
        seen.check(len(specs), item)
        specs.append(add_stage(len(specs), item))
        chain.append((len(specs) - 1, keep(item)))
    return specs, chain


def check_before_upload(
    stages: Sequence[nn.Module | Tied], groups: GroupAssigner, *, on_base: bool, published: torch.dtype = torch.float32
) -> None:
    """Every check ``create_job`` can make of a chain it is given as a sequence, made before the
    job exists: a refusal then leaves the caller's modules as they were (the upload moves each to
    the meta device). On a frozen base the layout needs the base's, so only the items are checked.
    Weights on the meta device pass here (a model built on meta is sized for admission, and may
    attach under ``exist_ok``); the upload refuses them (:func:`check_materialized`)."""
    if not stages:
        raise ValueError("stages is empty: a job needs at least one stage")
    if on_base:
        for position, item in enumerate(stages):
            check_item(position, item)
        return

    def check(i: int, module: nn.Module) -> StageSpec:
        spec = spec_of(i, module, groups=groups)
        check_integer_buffers(i, module, spec, published)
        return spec

    walk_chain(stages, check, skeletons=False)
    groups.check_all_used()


def check_item(position: int, item: object) -> None:
    """A chain's item is a module instance or a :class:`Tied` one."""
    if isinstance(item, Tied):
        return
    if isinstance(item, type) and issubclass(item, nn.Module):
        raise LayoutError(f"stage {position} is the class {item.__name__}, not a module: give an instance ({item.__name__}(...))")
    if not isinstance(item, nn.Module):
        raise LayoutError(f"stage {position} is a {type(item).__name__}, not a torch.nn.Module (or Tied(stage, module))")


def check_materialized(position: int, module: nn.Module, *, trainable_only: bool = False) -> None:
    """Weights to upload have data: a parameter on the meta device is a model built on meta, or
    a module already given as an earlier stage (moved to meta once uploaded). ``trainable_only``
    (a job on a frozen base): only the parameters with ``requires_grad`` are uploaded."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad] if trainable_only else [
        *module.named_parameters(), *module.named_buffers()
    ]
    for name, p in named:
        if p.is_meta:
            raise LayoutError(
                f"stage {position}'s {name!r} is on the meta device, with no data to upload: a module given "
                "again after an earlier stage (share it as Tied(stage, module)), or a model built on meta "
                "(materialize it first; meta skeletons are for attach_job)"
            )


def to_skeletons(chain: Chain) -> Chain:
    """``chain`` (walked with ``skeletons=False``) with every module moved to the meta device."""
    return [(stage, skeleton_of(module)) for stage, module in chain]


class SharedWeights:
    """Refuses a stage that holds a parameter an earlier stage held: each stage's weights are
    uploaded and trained apart, so a weight shared that way would silently become two, trained on
    separate gradients (:class:`Tied` is how a chain shares one). Parameters are remembered by weak
    reference, so a handled stage's weights are still freed as the walk moves on."""

    def __init__(self) -> None:
        self._owners: dict[int, tuple[weakref.ref[nn.Parameter], int, str]] = {}

    def check(self, stage: int, module: nn.Module) -> None:
        for name, p in module.named_parameters():
            owner = self._owners.get(id(p))
            if owner is not None and owner[0]() is p:
                raise LayoutError(
                    f"stage {stage}'s parameter {name!r} is stage {owner[1]}'s {owner[2]!r}: a weight shared by "
                    f"two stages must be given once, with the later position as Tied({owner[1]}, module) "
                    "(as given, each stage would train its own copy)"
                )
        owners = self._owners
        for name, p in module.named_parameters():  # forgotten once freed (a 250,000-stage chain keeps no table of them)
            owners[id(p)] = (weakref.ref(p, lambda _, key=id(p): owners.pop(key, None)), stage, name)


def progress_bar(enabled: bool | None, total: int | None, desc: str) -> Any:
    """A tqdm bar counting parameters on stderr; ``enabled`` None: only when stderr is a terminal
    (never in a pipe, a log file or a test)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="param", unit_scale=True, disable=None if enabled is None else not enabled)
