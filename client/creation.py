"""How ``Client.create_job`` uploads a chain: its transfer-unit size resolved and checked, then each
module laid out, checked, flattened and sent (cut into units where asked), then the job sealed.

One upload belongs to one job session (``create_job`` made it); a failure anywhere drops the
half-made job, so nothing is left on the server.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from wstream.protocol import LayoutError, MemoryLimitError, StageSpec, WstreamError
from wstream.protocol import messages as m
from wstream.protocol.frames import tensor_frames
from wstream.protocol.layout import numel_of
from wstream.protocol.units import parse_size

from .chain import Chain, check_materialized, layout_on, progress_bar, walk_chain
from .channel import Channel
from .groups import GroupAssigner
from .stages import Tied, check_integer_buffers, flatten
from .units import AUTO_UNIT_BYTES, UnitCutter


def unit_size(unit_bytes: int | str | None, options: m.JobOptions) -> int | None:
    """``create_job(unit_bytes=...)`` as a number of bytes, or None (one server stage per stage):
    ``"auto"`` is :data:`AUTO_UNIT_BYTES` except for a frozen base and a job on one, which are
    never cut (stage i of a job on a base trains on the base's stage i)."""
    cut_never = options.base is not None or options.frozen
    if unit_bytes == "auto":
        return None if cut_never else AUTO_UNIT_BYTES
    if unit_bytes is None:
        return None
    if isinstance(unit_bytes, str):  # a size, as memory_budget takes one ("64MiB")
        try:
            unit_bytes = parse_size(unit_bytes)
        except ValueError as exc:
            raise ValueError(f"unit_bytes: {exc}; or 'auto', or None") from None
    if isinstance(unit_bytes, bool) or not isinstance(unit_bytes, int) or unit_bytes < 1:
        raise ValueError(f"unit_bytes must be 'auto', None, or a size of at least 1 byte, got {unit_bytes!r}")
    if cut_never:  # DESIGN.md "Transfer units": bases and jobs on them are not cut
        raise ValueError(
            "unit_bytes cannot be used with base= or frozen=True: stage i of a job on a frozen base trains on "
            "the base's stage i, so neither is cut into transfer units"
        )
    return unit_bytes


def chain_numel(stages: Iterable[nn.Module | Tied], *, on_base: bool) -> int:
    """The elements a (checked) list of stages uploads: on a frozen base, only its trained ones."""
    return sum(
        p.numel() for s in stages if not isinstance(s, Tied) for p in s.parameters() if p.requires_grad or not on_base
    )


def trained_numel(stages: Iterable[nn.Module | Tied]) -> int:
    """The elements of a (checked) list of stages that get gradients or are pushed: parameters
    that require a gradient, and buffers (``CreateJob.trained_numel``)."""
    modules = [s for s in stages if not isinstance(s, Tied)]
    return sum(p.numel() for s in modules for p in s.parameters() if p.requires_grad) + sum(
        b.numel() for s in modules for b in s.buffers()
    )


class ChainUpload:
    """The upload of one chain into a just-created job (its ``session``): :meth:`run` walks the
    chain, sends each server stage (a module's, or a transfer unit of several), seals the job, and
    drops it on any failure."""

    def __init__(
        self,
        chan: Channel,
        name: str,
        created: m.Attached,
        *,
        groups: GroupAssigner,
        published: torch.dtype,
        unit_bytes: int | None,
        total: int | None,
        progress: bool | None,
    ) -> None:
        self._chan = chan
        self._name = name
        self._created = created
        self._session = created.session
        self._on_base = created.options.base is not None
        self._groups = groups
        self._published = published
        self._cutter = None if unit_bytes is None else UnitCutter(unit_bytes, published.itemsize)
        self._total = total
        self._progress = progress
        self._bar: Any = None  # the progress bar of :meth:`run`
        self.added = 0
        """Server stages uploaded so far."""

    def run(self, stages: Iterable[nn.Module | Tied], wait_timeout_s: float) -> tuple[m.Attached, Chain]:
        """Upload ``stages`` and seal: (the sealed job's ``attached``, the chain of skeletons)."""
        base_stages = list(self._created.base_stages) if self._on_base else None
        with progress_bar(self._progress, self._total, f"uploading {self._name}") as self._bar:
            try:
                _, chain = walk_chain(stages, self._upload, base_stages)
                units = None
                if self._cutter is not None:
                    for first, unit, flat in self._cutter.finish():
                        self._add(unit, flat, first)
                    units = self._cutter.counts
                self._groups.check_all_used()
                seal = m.Seal(session=self._session, units=units)
                sealed, _ = self._chan.request(seal, m.Attached, timeout_s=wait_timeout_s, held=True)
            except BaseException as exc:
                self._drop_half_made(exc, given_list=isinstance(stages, Sequence))
                raise
        return sealed, chain

    def _upload(self, i: int, module: nn.Module) -> StageSpec:
        check_materialized(i, module, trainable_only=self._on_base)
        spec = layout_on(self._created.base_stages if self._on_base else None, i, module, self._groups)
        check_integer_buffers(i, module, spec, self._published)
        flat = flatten(module, spec)
        if self._cutter is None:
            self._add(spec, flat, None)
        else:
            for first, unit, unit_flat in self._cutter.add(spec, flat, has_buffers=any(p.buffer for p in spec.params)):
                self._add(unit, unit_flat, first)
        self._bar.update(sum(numel_of(p.shape) for p in spec.params))
        return spec

    def _add(self, spec: StageSpec, flat: torch.Tensor | None, first: int | None) -> None:
        """Send server stage ``added``; ``first``: the first chain stage of its unit (None: no units)."""
        assert flat is not None, "a unit without its weights: a bug in wstream"
        try:
            self._chan.request(m.AddStage(session=self._session, index=self.added, spec=spec), m.Ok, tensor_frames(flat))
        except (MemoryLimitError, LayoutError) as e:  # the server names its own stage: say which stages that is
            if first is None or self._cutter is None:
                raise
            last = first + self._cutter.counts[self.added] - 1
            raise type(e)(f"{e.message} (the server's stage {self.added} is the transfer unit of chain stages {first}..{last})") from e
        self.added += 1

    def _drop_half_made(self, exc: BaseException, *, given_list: bool) -> None:
        """Leave nothing half-made on the server; say what a generator's failure cost its caller."""
        try:
            self._chan.request(m.DropJob(session=self._session), m.Ok, timeout_s=5.0)
        except WstreamError:
            pass
        if self.added and not given_list:  # a generator's stages cannot be checked first
            exc.add_note(
                f"create_job({self._name!r}): the stages uploaded before this were moved to the meta device as each went; "
                "build them again before retrying (a list of stages is checked whole before any upload)"
            )
