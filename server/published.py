"""A job's stages and the shared-memory segment they are published in, with the bytes they hold in
the server's memory account (admission control).

Workers map the segment read-only and read a stage's weights at its slot offsets; it grows as
stages are added while the job is created (the room ahead is reserved too) and is truncated to its
final size when the job is sealed. The training rules (which version a slot holds, when it may be
read) are in :mod:`wstream.server.versions` and :mod:`wstream.server.step_commit`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from wstream.protocol import LayoutError, MemoryLimitError, format_bytes
from wstream.protocol import messages as m
from wstream.protocol.frames import copy_frames_into, frames_nbytes
from wstream.protocol.layout import exact_integer_buffers, numel_of, publish_master, push_layout, validate_groups, validate_stage
from wstream.protocol.shm import SHM_DIR, create_segment, grow_segment, map_segment, room_for_segment, truncate_segment, unlink_segment

from .memory import MemoryAccount
from .optimizer import StageOptimizer, state_bytes_per_element, state_nbytes
from .stage_state import DTYPES, StageState, stage_bytes

SEGMENT_START = 2**20
VALUE_BUFFERS = ("float32", "bfloat16", "float16", "bool")
"""Buffer dtypes whose push is their value; the others' (integers: counts) is an increment."""
SEGMENT_DOUBLING_LIMIT = 64 * 2**20


def grown_capacity(capacity: int, needed: int) -> int:
    """The next size of a job's published segment: doubling up to 64 MiB, then +25%, and at
    least ``needed``. Few remaps (each keeps older views alive), at most 25% slack on big jobs."""
    step = capacity if capacity < SEGMENT_DOUBLING_LIMIT else capacity // 4
    return max(needed, capacity + step)


def check_shm_room(nbytes: int, what: str) -> None:
    """Refuse a job whose published weights cannot fit in /dev/shm's free space now, where its
    segment would be made there (it would be refused at a stage, after weights travelled)."""
    free = room_for_segment(nbytes)
    if free is not None and nbytes > free:
        raise MemoryLimitError(
            f"{what} needs {format_bytes(nbytes)} ({nbytes} bytes) of shared memory for its published weights, "
            f"but {SHM_DIR} has {format_bytes(free)} ({free} bytes) free"
        )


class PublishedStages:
    """The stages of job ``name`` in one shared-memory segment at ``path``. ``total_numel``, when
    the job says it up front, is reserved at once (checked against the memory limit and /dev/shm's
    free space) and sizes the segment; ``trained_numel``, the part of it with optimizer state and
    an accumulator (None: all of it).
    ``groups``: the job's parameter groups (``JobOptions.param_groups``), which its stages'
    parameters name by index. ``on_base``: the job trains on a frozen base (its stages may be
    empty)."""

    def __init__(
        self,
        name: str,
        optimizer: m.OptimizerSpec,
        dtype: str,
        double_buffer: bool,
        frozen: bool,
        memory: MemoryAccount,
        total_numel: int | None = None,
        *,
        trained_numel: int | None = None,
        groups: Sequence[m.GroupSpec],
        on_base: bool = False,
    ) -> None:
        self.name = name
        self.optimizer_spec = optimizer
        self.groups = tuple(groups)
        self.double_buffer = double_buffer
        self.frozen = frozen  # never updated: no optimizer state
        self.on_base = on_base  # a stage may be empty (frozen whole: every weight is the base's)
        self.compute_dtype = dtype
        self.dtype = dtype  # of the published copies
        self.memory = memory
        expected: int | None = None  # the published segment's final size, if known (huge pages)
        self.promised = 0
        """What the job said it will hold (from ``total_numel``): reserved whole at its creation, so
        that jobs created at once cannot each pass a check that only one of them fits."""
        if total_numel is not None:
            trained = 0 if frozen else total_numel if trained_numel is None else min(trained_numel, total_numel)
            pub, priv = stage_bytes(total_numel, trained * state_bytes_per_element(optimizer), dtype, double_buffer, grad_numel=trained)
            check_shm_room(pub, f"job {name!r}")
            self.promised = pub + priv
            expected = pub
        self.stages: list[StageState] = []
        self.reserved = 0
        """The bytes of the stages added: their published slots and private memory."""
        self.slack = 0
        """The segment's room beyond the stages in it (reserved too, until seal truncates it)."""
        self.held = 0
        """What the job holds in the memory account: the stages', and ahead of them the larger of
        the segment's slack and what is left of the promise (:meth:`_hold`)."""
        self.num_params = 0
        self.max_stage_numel = 0
        start = SEGMENT_START if expected is None else max(1, min(SEGMENT_START, expected))  # a small job: no more
        self._hold(0, start, f"job {name!r}" if self.promised > start else f"job {name!r} (its first shared-memory block)")
        try:
            self.path = create_segment(start, expected=expected)
        except BaseException:
            memory.release(self.held)
            raise
        self.nbytes = 0  # bytes in use
        self._expected = expected  # the segment grows no further than this (but for what a stage needs)
        self._capacity = start
        self._mapping = map_segment(self.path, self._capacity)

    @property
    def ahead(self) -> int:
        """Bytes held beyond the stages added: the segment's slack, or the rest of the promise."""
        return self.held - self.reserved

    def _target(self, reserved: int, slack: int) -> int:
        """What the job holds in the account with ``reserved`` bytes of stages and ``slack`` ahead."""
        return max(reserved + slack, self.promised)

    def _hold(self, reserved: int, slack: int, what: str) -> None:
        """Make the account hold what the job holds with ``reserved`` bytes of stages and ``slack``
        bytes of segment room ahead (at least the promise while the job is created); refused (with
        nothing changed) when the increase does not fit."""
        target = self._target(reserved, slack)
        if target > self.held:
            self.memory.reserve(target - self.held, what)
        else:
            self.memory.release(self.held - target)
        self.held = target
        self.reserved = reserved
        self.slack = slack

    def stage(self, index: int) -> StageState:
        if index >= len(self.stages):
            raise LayoutError(f"job {self.name!r} has {len(self.stages)} stages; there is no stage {index}")
        return self.stages[index]

    def add(self, msg: m.AddStage, frames: list[Any]) -> None:
        """Add the next stage, its fp32 weights in ``frames`` (``add_stage``)."""
        if msg.index != len(self.stages):
            raise LayoutError(f"job {self.name!r} expects stage {len(self.stages)} next, got stage {msg.index}")
        validate_stage(msg.index, msg.spec, on_base=self.on_base)
        validate_groups(msg.index, msg.spec, len(self.groups))
        numel = msg.spec.numel
        expected = numel * 4
        got = frames_nbytes(frames)
        if got != expected:
            raise LayoutError(
                f"stage {msg.index}: got {got} bytes of weights, the layout needs "
                f"{expected} ({numel} float32 elements)"
            )
        self.append(msg.index, msg.spec, lambda flat: copy_frames_into(flat, frames))

    def load(self, specs: list[m.StageSpec], stages: Iterable[tuple[int, dict[str, torch.Tensor]]], step: int) -> bool:
        """Add every stage as a snapshot of ``step`` holds it (master and optimizer state), at
        version ``step``; returns whether every stage's published copy of version ``step - 1`` was
        in it too (a delayed job's, NOTE [Consistent snapshots] rule 5 in snapshot.py), and put
        back in its slot."""
        previous = True
        for i, tensors in stages:
            spec = specs[i]
            validate_groups(i, spec, len(self.groups))
            master = tensors["master"]
            if master.numel() != spec.numel or master.dtype != torch.float32:
                raise LayoutError(f"snapshot of job {self.name!r}: stage {i} master does not fit its layout")
            st = self.append(i, spec, lambda flat, src=master: flat.copy_(src))
            st.optimizer.load_state_tensors({k[4:]: v for k, v in tensors.items() if k.startswith("opt.")})
            st.version = step
            published = st.slots[st.slot_for(step)]
            if published is not st.master:
                publish_master(published, st.master, st.exact_ints)
            before = tensors.get("previous")
            slot = st.slots[st.slot_for(step - 1)]
            if before is None or st.single_slot or step == 0:
                previous = False
            elif before.dtype != slot.dtype or before.numel() != slot.numel():
                raise LayoutError(f"snapshot of job {self.name!r}: stage {i}'s previous weights do not fit its slot")
            else:
                slot.copy_(before)
        return previous

    def append(self, index: int, spec: m.StageSpec, fill: Callable[[torch.Tensor], object]) -> StageState:
        """Reserve memory for stage ``index``, place it in the published segment, ``fill`` its
        fp32 master (a flat tensor of ``spec.numel``) and set up its optimizer."""
        numel = spec.numel
        push = push_layout(spec, cache=False)  # the gradient, then the buffers
        grad_numel = 0 if self.frozen else push.numel  # a base is never updated
        state = 0 if self.frozen else state_nbytes(self.optimizer_spec, spec)
        pub, priv = stage_bytes(numel, state, self.compute_dtype, self.double_buffer, grad_numel=grad_numel)
        offset = self.nbytes
        capacity = self._capacity
        if offset + pub > capacity:  # a job that said its size reserves no room beyond it
            capacity = grown_capacity(capacity, offset + pub)
            if self._expected is not None:
                capacity = max(offset + pub, min(capacity, self._expected))
        slack = capacity - offset - pub
        what = f"job {self.name!r} stage {index}"
        self.memory.check(self._target(self.reserved + pub + priv, slack) - self.held, what)
        if capacity != self._capacity:
            grow_segment(self.path, capacity)
            self._capacity = capacity
            self._mapping = map_segment(self.path, capacity)  # older views keep older maps
        self._hold(self.reserved + pub + priv, slack, what)
        self.nbytes = offset + pub
        pub_dtype = DTYPES[self.dtype]
        slot_nbytes = pub // 2 if self.double_buffer else pub
        views = [
            self._mapping[o : o + numel * pub_dtype.itemsize].view(pub_dtype)
            for o in ((offset, offset + slot_nbytes) if self.double_buffer else (offset,))
        ]
        exact_ints = exact_integer_buffers(spec) if pub_dtype != torch.float32 else ()
        if self.double_buffer or pub_dtype != torch.float32:  # the master apart from the published copies
            master = torch.empty(numel, dtype=torch.float32)
            fill(master)
            publish_master(views[0], master, exact_ints)
        else:  # fp32, one slot: the master is the published copy, updated in place
            master = views[0]
            fill(master)
        if self.double_buffer:
            slots, offsets = (views[0], views[1]), (offset, offset + slot_nbytes)
        else:
            slots, offsets = (views[0], views[0]), (offset, offset)
        st = StageState(index, spec, master, slots, offsets, StageOptimizer(self.optimizer_spec, master, spec, self.groups))
        st.exact_ints = exact_ints
        if grad_numel:
            st.grad = torch.empty(grad_numel, dtype=torch.float32)
            st.grad_numel = push.grad_numel
            st.buffers = tuple(
                (p.offset, at, numel_of(p.shape), p.buffer not in VALUE_BUFFERS)
                for p, at in zip(spec.params, push.offsets)
                if p.buffer and at is not None
            )
        self.stages.append(st)
        self.max_stage_numel = max(self.max_stage_numel, numel)
        self.num_params += sum(numel_of(p.shape) for p in spec.params)
        return st

    def seal(self) -> None:
        """Truncate the segment to the stages in it and release the room reserved ahead (and what
        is left of the promise)."""
        truncate_segment(self.path, self.nbytes)
        self.promised = 0
        self._hold(self.reserved, 0, f"job {self.name!r}")

    def close(self) -> None:
        """Unlink the segment and release the memory reserved."""
        unlink_segment(self.path)
        self.memory.release(self.held)
        self.held = self.reserved = self.slack = self.promised = 0
