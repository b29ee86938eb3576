"""Stages on the worker: flat layouts from modules, meta-device skeletons, and running a stage.

A stage's parameters are views into one flat buffer (``StageSpec``). The worker keeps only a
skeleton of each module on the meta device and runs it on views cut from a streamed buffer, as
``torch.func.functional_call`` would (:class:`~wstream.client.binding.Binding`).

# NOTE [Per-parameter leaves, not a flat leaf]
# Making the flat buffer itself the autograd leaf gives one flat gradient directly, but the
# backward of each parameter's slice-view materializes a zero tensor as large as the whole stage
# and the results are summed: for a 6-parameter block of 33 MB that was 2.7x the time of the
# ordinary backward (BENCHMARKS.md). So each view is made its own leaf; autograd produces
# parameter-sized gradients, element for element the module's own, and ``scatter.scatter_grads``
# writes them into the flat gradient slot at their offsets (padding zeroed) in one pass.

# NOTE [Kept leaves]
# Under a checkpoint plan a position runs two or three times per step (its advances, the
# backward's rerun) on the same fetched weights, step after step, and cutting its parameter
# views and making them autograd leaves cost 3-13 us per run, as much as a small stage's
# compute. So a position whose run binds only its own parameters (``StageRunner.simple``: no
# buffers, no base)
#   1. keeps the leaves it cut, with the address (``data_ptr``) and dtype of the flat weights
#      they view, and cuts again only when its weights come at another address (a ring slot
#      elsewhere, the other of two published slots); the same address means the same views of
#      the same memory, because the kept views hold that memory: it cannot be freed and given
#      to anything else while they live;
#   2. serves every run from them, forward (under ``no_grad``) and backward alike, binding the
#      kept dict as it is (``Binding.run_own``: a tensor a module replaces during a run is not
#      written back, so the next run binds the kept leaves again); the leaves never get a
#      ``.grad`` (the backward asks the engine for their gradients, ``backprop.py``);
#   3. keeps them from step to step: what they view, the ring's buffers or the mapped published
#      segment, lives as long as the prefetcher that fills them. They are dropped when another
#      prefetcher serves the weights (a reconnect maps the server's memory again), after an
#      abort, and when the executor closes (``PlanExecutor._forget_leaves``), so no leaf keeps
#      an old ring or mapping alive. Kept from step to step rather than cut each step, a deep
#      chain neither pays the cut again nor makes four long-lived Python objects per position
#      and step, which drove Python's full collections (BENCHMARKS.md, issue 17).

# NOTE [Positions and weight stages]
# The chain the plans run is a list of *positions*; each position runs a module on the weights of
# one *weight stage* (the unit the server stores, updates and streams). Usually position i runs
# stage i. A :class:`Tied` position runs another module on an earlier stage's weights: GPT-2's
# head multiplies by the token embedding of stage 0, so its chain is [embed (stage 0), blocks...,
# head (stage 0 again)] and the embedding matrix is one parameter on the server. The trainer
#   1. fetches the weight stage of every ADVANCE and BACKWARD position, in the plan's order (a
#      tied head fetches the embedding again, and the plan's weight traffic counts it);
#   2. sums a stage's gradients over all its positions and pushes the sum once, after the
#      backward of its lowest position (the last one backward reaches), so the server still
#      sees one push per stage and step, made after the stage's last use (server/versions.py, rule 2).
# A loop body (``Trainer.step_loop``) is the same thing with every position on stage 0; its
# weights are fetched once and held for the step because the loop's length is not known ahead.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from wstream.protocol import LayoutError, StageSpec
from wstream.protocol.layout import build_stage_spec, exact_integer_buffers, numel_of, read_integers, validate_stage

from .binding import Binding
from .boundary import Boundary
from .groups import GroupAssigner

MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The parameter dtypes a stage may have: each is exact in the server's fp32 master. A float64 one
is refused rather than trained in float32 without a word (the master, the optimizer state and the
published weights would all need a 64-bit path, which is not built)."""

Buffers = dict[str, torch.Tensor]
"""A stage's buffers by name, as a run of its module sees (and may update) them."""


BUFFER_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.int64: "int64",
    torch.int32: "int32", torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool",
}
"""The buffer dtypes a stage may have (``ParamSpec.buffer``): integers are exact in the fp32 master
up to 2**24 in magnitude (:data:`MAX_EXACT_INT`)."""
DTYPE_OF_BUFFER = {name: dtype for dtype, name in BUFFER_DTYPES.items()}
MAX_EXACT_INT = 2**24
"""The largest magnitude an integer buffer may hold: every integer up to it is a float32."""


def stage_buffers(index: int, module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module``'s buffers as a stage streams them: every persistent one (those ``state_dict``
    holds, such as BatchNorm's running statistics and its ``num_batches_tracked``). A
    non-persistent buffer is refused: it is not model state (no checkpoint holds it) but a constant
    of the code, which the stage should compute inside ``forward``."""
    out = []
    for name, b in module.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf in module.get_submodule(owner)._non_persistent_buffers_set:
            raise LayoutError(
                f"stage {index} ({type(module).__name__}) has the non-persistent buffer {name!r}: wstream streams "
                "parameters and persistent buffers (model state); compute constants such as masks inside forward"
            )
        if b.dtype not in BUFFER_DTYPES:
            dtype = str(b.dtype).removeprefix("torch.")
            raise LayoutError(
                f"stage {index}: buffer {name!r} is {dtype}; wstream streams buffers of "
                f"{', '.join(BUFFER_DTYPES.values())}"
            )
        out.append((name, b))
    return out


def spec_of(
    index: int, module: nn.Module, *, trainable_only: bool = False, groups: GroupAssigner | None = None
) -> StageSpec:
    """The flat layout of ``module``'s parameters (in ``named_parameters`` order), then its
    persistent buffers (:func:`stage_buffers`, marked ``buffer`` and ``frozen``). A parameter
    without ``requires_grad`` is marked ``frozen`` (kept and streamed, never trained); with
    ``trainable_only`` it is left out instead (a job on a base holds only the others; its buffers
    are its own). ``groups`` gives each trained parameter its parameter group (else every one is
    in group 0)."""
    for name, sub in module.named_modules():
        if getattr(sub, "gradient_checkpointing", False) is True:  # Hugging Face's gradient_checkpointing_enable()
            raise LayoutError(
                f"stage {index}: module {name or type(module).__name__!r} has gradient checkpointing on "
                "(model.gradient_checkpointing_enable()); wstream checkpoints its stages itself, and a "
                "checkpoint inside a stage cannot recompute on streamed weights: call "
                "model.gradient_checkpointing_disable() first"
            )
    buffers = stage_buffers(index, module)
    params: list[tuple[str, tuple[int, ...], int, bool, str]] = []
    for name, p in module.named_parameters():
        if trainable_only and not p.requires_grad:
            continue
        if not p.is_floating_point():
            raise LayoutError(f"stage {index}: parameter {name!r} has dtype {p.dtype}; only floating point is streamed")
        if p.dtype not in MODEL_DTYPES:
            dtype = str(p.dtype).removeprefix("torch.")
            raise LayoutError(
                f"stage {index}: parameter {name!r} is {dtype}; wstream trains float32, bfloat16 or float16: "
                "call model.float() first"
            )
        frozen = not p.requires_grad
        group = 0
        if groups is not None and not frozen:
            group = groups.index(name, p, module.get_submodule(name.rpartition(".")[0]))
        params.append((name, tuple(p.shape), group, frozen, ""))
    params += [(name, tuple(b.shape), 0, True, BUFFER_DTYPES[b.dtype]) for name, b in buffers]
    spec = build_stage_spec(str(index), params)
    validate_stage(index, spec, on_base=trainable_only)
    return spec


def flatten(module: nn.Module, spec: StageSpec) -> torch.Tensor:
    """``module``'s parameters and buffers copied into one flat fp32 CPU tensor laid out as
    ``spec`` (check its integer buffers first: :func:`check_integer_buffers`)."""
    flat = torch.zeros(spec.numel, dtype=torch.float32)
    named = dict(module.named_parameters())
    named.update(module.named_buffers())
    for p in spec.params:
        n = numel_of(p.shape)
        flat[p.offset : p.offset + n].copy_(named[p.name].detach().reshape(-1))
    return flat


EXACT_INTEGERS = {torch.bfloat16: 2**8, torch.float16: 2**11}
"""The largest magnitude up to which each 16-bit dtype holds every integer."""


def check_integer_buffers(index: int, module: nn.Module, spec: StageSpec, published: torch.dtype) -> None:
    """Refuse an integer buffer that would not reach the stage as it is: the fp32 master holds
    integers exactly up to :data:`MAX_EXACT_INT`, and workers read buffers from the published
    copy, in the job's dtype. A 16-bit copy holds most integer buffers as int32 values (NOTE
    [Integer buffers in a 16-bit published copy] in protocol/layout.py), but one without room in
    the layout for that is cast (bfloat16 holds integers exactly up to 256, float16 up to 2048: a
    stage that looked up positions 257.. would index with rounded ones). A buffer on the meta
    device has no values to check yet."""
    as_int32 = {spec.params[k].name for k, _, _ in exact_integer_buffers(spec)}  # (a unit's layout gives each the same room)
    for name, value in module.named_buffers():
        if value.is_floating_point() or value.dtype == torch.bool or value.is_meta or not value.numel():
            continue
        largest = value.detach().abs().max().item()
        if largest > MAX_EXACT_INT:
            raise LayoutError(
                f"stage {index}'s buffer {name!r} holds {largest}: an integer buffer is kept in the fp32 master, "
                f"exact up to {MAX_EXACT_INT}"
            )
        exact = published == torch.float32 or name in as_int32
        if not exact and not torch.equal(value.to(published).to(value.dtype), value):
            exact = EXACT_INTEGERS[published]
            raise LayoutError(
                f"stage {index}'s integer buffer {name!r} holds {largest}, which {str(published).removeprefix('torch.')} "
                f"(the job's dtype, in which workers read buffers) holds exactly only up to {exact}: create the job with "
                "dtype='float32', or compute the values inside forward (a constant such as position ids)"
            )


def skeleton_of(module: nn.Module) -> nn.Module:
    """Move ``module`` to the meta device in place (frees its weights) and return it. A tensor
    tied inside the module (one parameter under two names) stays tied: ``Module.to`` gives each
    submodule a new meta parameter of its own, and an alias left apart would run on no weights
    (a buffer shared by two submodules likewise)."""
    ties: dict[int, list[str]] = {}
    buffer_ties: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        ties.setdefault(id(p), []).append(name)
    for name, b in module.named_buffers(remove_duplicate=False):
        buffer_ties.setdefault(id(b), []).append(name)
    module.to(device="meta")
    for kind, get, groups in (("_parameters", module.get_parameter, ties), ("_buffers", module.get_buffer, buffer_ties)):
        for first, *others in (names for names in groups.values() if len(names) > 1):
            shared = get(first)
            for name in others:
                owner, _, attr = name.rpartition(".")
                getattr(module.get_submodule(owner), kind)[attr] = shared
    return module


def specs_of(modules: Iterable[nn.Module]) -> Iterator[StageSpec]:
    for i, mod in enumerate(modules):
        yield spec_of(i, mod)


Shape = tuple[int, ...]


def _not_in(params: Iterable[tuple[str, torch.Tensor]], spec: StageSpec) -> tuple[str, Shape, Shape | None] | None:
    """The first of ``params`` that ``spec`` lacks by name and shape: (name, its shape, the spec's
    shape or None when the spec has no such name); None when all are there."""
    have = {p.name: tuple(p.shape) for p in spec.params}
    for name, p in params:
        if have.get(name) != tuple(p.shape):
            return name, tuple(p.shape), have.get(name)
    return None


def frozen_params(index: int, module: nn.Module, base: StageSpec) -> list[str]:
    """The parameters of ``module`` that stage ``index`` reads from its frozen base (those without
    ``requires_grad``); each must be in the base's stage with the same shape."""
    frozen = [(name, p) for name, p in module.named_parameters() if not p.requires_grad]
    bad = _not_in(frozen, base)
    if bad is not None:
        name, shape, theirs = bad
        if theirs is None:
            raise LayoutError(f"stage {index}: frozen parameter {name!r} is not in the base's stage {index}")
        raise LayoutError(f"stage {index}: frozen parameter {name!r} has shape {shape}, the base's {theirs}")
    return [name for name, _ in frozen]


@dataclass(frozen=True, slots=True)
class Tied:
    """A chain position that runs ``module`` on the weights of the earlier stage ``stage`` (see
    NOTE [Positions and weight stages]). Give it in a job's ``stages`` where the position goes.

    ``module`` uploads nothing: its parameters name a subset of that stage's parameters (same
    names, same shapes) and it is kept on the meta device. Its gradient is added to the stage's.
    """

    stage: int
    module: nn.Module


def check_tied(position: int, tied: Tied, specs: list[StageSpec], base: list[StageSpec] | None = None) -> None:
    """Refuse a :class:`Tied` position whose parameters are not among its stage's. On a frozen
    ``base`` (the base job's layout) the stage holds only the parameters with ``requires_grad``:
    the tied module's others are read from the base's stage, as the stage's own module reads
    them, so they are looked for there."""
    if not 0 <= tied.stage < len(specs):
        raise LayoutError(
            f"position {position} is tied to stage {tied.stage}, but only stages 0..{len(specs) - 1} come before it"
        )
    buffers = [name for name, _ in tied.module.named_buffers()]
    if buffers:
        raise LayoutError(
            f"position {position} (tied to stage {tied.stage}) has buffers {buffers[:5]}: a tied position reuses "
            "its stage's parameters only (running the stage's buffers twice in one step would update them twice)"
        )
    s = tied.stage
    if base is None:
        bad = _not_in(tied.module.named_parameters(), specs[s])
        if bad is not None:
            name, shape, theirs = bad
            why = "no such parameter" if theirs is None else f"it has shape {theirs}"
            raise LayoutError(f"position {position}: parameter {name!r} {shape} is not one of stage {s}'s ({why})")
        return
    params = list(tied.module.named_parameters())
    trained = _not_in([(n, p) for n, p in params if p.requires_grad], specs[s])
    if trained is not None:
        name, shape, theirs = trained
        why = "no such parameter" if theirs is None else f"it has shape {theirs}"
        raise LayoutError(
            f"position {position}: parameter {name!r} {shape} is not one of stage {s}'s or its base's: with "
            f"requires_grad it is the job's own, and stage {s} has {why}"
        )
    frozen = _not_in([(n, p) for n, p in params if not p.requires_grad], base[s])
    if frozen is not None:
        name, shape, theirs = frozen
        why = "no such parameter" if theirs is None else f"it has shape {theirs}"
        raise LayoutError(
            f"position {position}: parameter {name!r} {shape} is not one of stage {s}'s or its base's: without "
            f"requires_grad it is read from the base's stage {s}, which has {why}"
        )


class StageRunner:
    """Runs one chain position on its weight stage's flat weights through a meta skeleton.

    ``stage`` is the weight stage (whose ``spec`` lays out the flat buffer); the skeleton may use
    only some of its parameters (a :class:`Tied` position), and only those become views. A stage
    of a job on a frozen base also reads ``frozen`` parameters from the base's flat weights
    (``base_spec`` lays them out). With transfer units (``client/units.py``) ``stage`` is the
    unit and the skeleton's parameter ``name`` is the unit's ``prefix + name``."""

    def __init__(
        self,
        stage: int,
        skeleton: nn.Module,
        spec: StageSpec,
        *,
        base_spec: StageSpec | None = None,
        frozen: Iterable[str] = (),
        prefix: str = "",
    ) -> None:
        self.stage = stage
        self.skeleton = skeleton
        self._binding = Binding(skeleton)  # functional_call, its module walk done once (NOTE [Binding])
        self.spec = spec
        self.base_spec = base_spec
        self.prefix = prefix
        cut = len(prefix)
        used = {prefix + name for name, _ in skeleton.named_parameters()}
        # the trained parameters this position uses: its autograd leaves, in ``leaves`` order
        self._used = [k for k, p in enumerate(spec.params) if p.name in used and not p.frozen]
        self._views = [
            (p.name[cut:], p.offset, numel_of(p.shape), tuple(p.shape), p.frozen) for p in spec.params if p.name in used
        ]
        # the same as (name, offset, shape, contiguous strides, frozen): ``as_strided`` cuts a view
        # in one call, half the time of a slice and a view (a deep chain cuts millions per step)
        self._strided = [(name, off, shape, _strides(shape), frozen) for name, off, _, shape, frozen in self._views]
        if prefix and len(self._views) != len(used):
            missing = sorted(used - {p.name for p in spec.params})
            raise LayoutError(f"stage {stage} has no parameter {missing[0]!r}: a bug in wstream (layouts were checked)")
        named_buffers = {prefix + name for name, _ in skeleton.named_buffers()}
        # the stage's buffers this position runs with: (index in spec.params, name, offset, numel, shape, dtype)
        self._buffers = [
            (k, p.name[cut:], p.offset, numel_of(p.shape), tuple(p.shape), DTYPE_OF_BUFFER[p.buffer])
            for k, p in enumerate(spec.params)
            if p.buffer and p.name in named_buffers
        ]
        # its integer buffers that a 16-bit copy holds as int32s (NOTE [Integer buffers in a 16-bit published copy])
        self._int32_buffers = {k for k, _, _ in exact_integer_buffers(spec)}
        # the elements of the server stage this position reads: its own part of a unit, else the stage
        own = sum(n for _, _, n, _, _ in self._views) + sum(b[3] for b in self._buffers)
        self.own_numel = own if prefix else spec.numel
        # the leaves cut from the flat weights at ``_leaves_at`` (their data_ptr and dtype), kept
        # until :meth:`forget_leaves` (NOTE [Kept leaves]); only for a position with
        # neither buffers nor a base, whose leaves are all that a run binds
        self._leaves_at: tuple[int, torch.dtype] | None = None
        self._kept_leaves: dict[str, torch.Tensor] = {}
        self._kept_trained: list[torch.Tensor] = []  # those of them that are autograd leaves
        wanted = set(frozen)
        self._base_views = [
            (p.name, p.offset, numel_of(p.shape), tuple(p.shape))
            for p in (base_spec.params if base_spec is not None else ())
            if p.name in wanted
        ]
        # attributes rather than properties: asked on every run of a deep chain's positions
        self.trains = bool(self._used)
        """Whether this position uses a trained parameter (has an autograd leaf)."""
        self.simple = not self._buffers and not self._base_views
        """Whether a run binds only this position's own parameters (no buffers, no base)."""
        self.has_buffers = bool(self._buffers)
        """Whether this position runs with buffers of its stage (NOTE [Buffers] in executor.py)."""


    def views(self, flat: torch.Tensor, base: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return {**self._own(flat), **self._frozen(base)}

    def __call__(
        self, flat: torch.Tensor, inputs: Boundary, base: torch.Tensor | None = None, buffers: Buffers | None = None
    ) -> Any:
        """Run the position on ``flat`` (and its base's ``base``). ``buffers``: the stage's buffers
        to run with (a module may update them in place); default fresh copies of the published
        ones (:meth:`buffer_state`), so that what the run does to them is forgotten."""
        if self.simple:  # the common case: the kept leaves, bound as they are
            return self._binding.run_own(self._own_leaves(flat), inputs)
        state = self.buffer_state(flat) if buffers is None else buffers
        return self._binding({**self.views(flat, base), **state}, inputs)

    def leaves(self, flat: torch.Tensor, base: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Parameter views of ``flat``, each trained one an autograd leaf (see NOTE above); frozen
        parameters (``ParamSpec.frozen``, and the base's) are views that need no gradient. The
        stage's buffers come as fresh copies (:meth:`buffer_state`); the executor replaces them
        with the step's own where a run must update them. A new dict: the caller may change it."""
        if self.simple:
            return dict(self._own_leaves(flat))
        return {**self._cut_leaves(flat), **self._frozen(base), **self.buffer_state(flat)}

    def bound_leaves(self, flat: torch.Tensor) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        """For a :attr:`simple` position: its kept leaves (NOTE [Kept leaves]; the dict itself,
        for :meth:`call_own`, which changes nothing in it) and those of them that are autograd
        leaves (in :attr:`grad_indices` order)."""
        return self._own_leaves(flat), self._kept_trained

    def _own_leaves(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The leaves of ``flat`` for a position without buffers or base, cut once per flat
        buffer until :meth:`forget_leaves` (NOTE [Kept leaves]). The kept dict itself: bind it
        with ``Binding.run_own`` (which changes nothing in it), or copy it."""
        at = (flat.data_ptr(), flat.dtype)
        if self._leaves_at != at:
            self._kept_leaves = self._cut_leaves(flat)
            self._kept_trained = [v for v in self._kept_leaves.values() if v.requires_grad]
            self._leaves_at = at
        return self._kept_leaves

    def forget_leaves(self) -> None:
        """Drop the kept leaves: the memory they view may go (an abort, a reconnect, close)."""
        self._leaves_at = None
        self._kept_leaves = {}
        self._kept_trained = []

    def _cut_leaves(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        at = flat.storage_offset()
        return {
            name: flat.as_strided(shape, stride, at + off) if frozen
            else flat.as_strided(shape, stride, at + off).detach().requires_grad_(True)
            for name, off, shape, stride, frozen in self._strided
        }

    def buffer_state(self, flat: torch.Tensor) -> Buffers:
        """Copies of the stage's buffers from its flat weights: floating-point ones in the weights'
        dtype (the job's compute dtype, as its parameters), the others in their own (an integer
        count, exact: a 16-bit copy holds it as int32 values where the layout has room, and the job
        is refused where it would round one). Copies, because a module updates them in place
        (BatchNorm's running statistics) and the flat weights are the published ones (read-only,
        shared by every worker)."""
        int32 = flat.dtype in (torch.bfloat16, torch.float16)  # NOTE [Integer buffers in a 16-bit published copy]
        return {
            name: read_integers(flat, off, n).view(shape).to(dtype) if int32 and k in self._int32_buffers
            else flat[off : off + n].view(shape).to(dtype=flat.dtype if dtype.is_floating_point else dtype, copy=True)
            for k, name, off, n, shape, dtype in self._buffers
        }

    def with_buffers(
        self, values: list[torch.Tensor | None], buffers: Buffers | None, start: Buffers | None
    ) -> list[torch.Tensor | None]:
        """A stage's push in ``spec.params`` order: ``values`` (the gradients, placed there by
        ``PlanRun.add_grads``) with each buffer's entry from ``buffers`` (the step's): a
        floating-point (or boolean) buffer's value, an integer buffer's increment over ``start`` (the step's
        fetched value), which the server adds to its exact fp32 master (NOTE [Buffers] in
        executor.py, rule 3)."""
        if not self._buffers:
            return values
        assert buffers is not None and start is not None, "a stage with buffers pushed without them: a bug in wstream"
        out = list(values)
        for k, name, *_ in self._buffers:
            b = buffers[name]
            out[k] = b if b.is_floating_point() or b.dtype == torch.bool else b - start[name]
        return out

    def _own(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        at = flat.storage_offset()
        return {name: flat.as_strided(shape, stride, at + off) for name, off, shape, stride, _ in self._strided}

    def _frozen(self, base: torch.Tensor | None) -> dict[str, torch.Tensor]:
        if not self._base_views:
            return {}
        assert base is not None, "a stage on a base needs the base's weights: a bug in wstream"
        return {name: base[off : off + n].view(shape) for name, off, n, shape in self._base_views}

    def call_with(self, params: dict[str, torch.Tensor], inputs: Boundary) -> Any:
        """Run the skeleton on ``params`` (a replaced tensor comes back in it)."""
        return self._binding(params, inputs)

    def call_own(self, kept: dict[str, torch.Tensor], inputs: Boundary) -> Any:
        """Run the skeleton on ``kept``, the dict :meth:`bound_leaves` gave (left as it is)."""
        return self._binding.run_own(kept, inputs)

    @property
    def grad_indices(self) -> list[int]:
        """Where each of :meth:`leaves`' gradients goes in ``spec.params`` (PlanRun.add_grads)."""
        return self._used



def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= max(size, 1)
    return tuple(reversed(out))
