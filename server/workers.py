"""The workers of one job: joining (with a gradient ring in shared memory), the start barrier,
who is expected to push for a step, and leaving.

Kept apart from :mod:`wstream.server.job` (and :mod:`~wstream.server.step_commit` and
:mod:`~wstream.server.versions`, which decide what a worker's pushes and fetches do)
because a worker's lifetime and its memory are their own concern: a ring is reserved in the
server's memory account when the worker joins and released when it leaves or its lease ends.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from wstream.protocol import MemoryLimitError, StateError
from wstream.protocol import messages as m
from wstream.protocol.shm import SegmentSpaceError, create_segment, map_segment, unlink_segment

from .memory import MemoryAccount

log = logging.getLogger(__name__)

SLOT_ALIGN = 64
"""Bytes a step ring's slots are aligned to (as the job's published slots)."""
MAX_WAITING_FETCHES = 1024
"""Deferred fetches one worker may have at once (a prefetcher has its ring's worth in flight)."""


@dataclass(slots=True)
class Worker:
    id: int
    session: bytes
    shm: bool
    first_step: int
    grad_path: str
    grad_buffer: torch.Tensor  # uint8 mapping of the whole ring
    slots: list[torch.Tensor]  # fp32 views, one per slot, max_stage_numel each (a step ring: stage k's push size)
    slot_bytes: int
    reserved: int
    reader: bool = False  # fetches only (see Join.reader)
    slot_offsets: list[int] = field(default_factory=list)
    """A step ring's (``Join.step_ring``): slot k, stage k's only slot, at this byte offset; empty
    for an ordinary ring, whose slots are ``slot_bytes`` apart."""
    busy: set[int] = field(default_factory=set)
    held: set[int] = field(default_factory=set)
    """Busy slots that a stage's update reads in place (NOTE [Held gradient slots] in step_commit.py): free
    again when that update is done, not when a gather is."""
    pushes: tuple[int, int] = (-1, 0)
    """(attempt, pushes accepted from this worker in that attempt of the open step)."""
    last_seen: float = field(default_factory=time.monotonic)
    waiting: int = 0  # its fetches deferred now


class WorkerTable:
    """The workers of job ``job_name`` by id; their rings are reserved in ``memory``."""

    def __init__(self, job_name: str, memory: MemoryAccount) -> None:
        self.job_name = job_name
        self.memory = memory
        self.all: dict[int, Worker] = {}
        self._next = 0
        self.world_size: int | None = None  # set by the first join; see Join
        self.started = False  # the start barrier opened

    def join(
        self, session: bytes, msg: m.Join, first_step: int, slot_numel: int, slot_bytes: int,
        step_ring: list[int] | None = None,
    ) -> Worker:
        """Add the worker of ``session``, with ``msg.grad_slots`` gradient slots of ``slot_numel``
        fp32 elements ``slot_bytes`` apart (none for a reader), or, given ``step_ring`` (each
        stage's push numel) and room for it in the memory account and /dev/shm, a step ring: a
        slot per stage of its own size (``Join.step_ring``; ordinary slots where there is no room)."""
        if any(w.session == session for w in self.all.values()):
            raise StateError("this session already joined the job as a worker")
        if not self.started and self.world_size is not None and msg.world_size != self.world_size:
            raise StateError(
                f"job {self.job_name!r} is waiting for {self.world_size} workers; this worker says world_size="
                f"{msg.world_size}: give every worker the same world_size"
            )
        nslots = 0 if msg.reader else msg.grad_slots
        offsets = [k * slot_bytes for k in range(nslots)]
        sizes = [slot_numel] * nslots
        nbytes = slot_bytes * nslots
        path, buf = "", torch.empty(0, dtype=torch.uint8)
        if step_ring is not None and not any(step_ring):
            step_ring = None  # no stage has a gradient or a buffer to push: nothing to hold
        if step_ring is not None:
            ring_offsets = [0]
            for numel in step_ring:
                ring_offsets.append(ring_offsets[-1] + -(-numel * 4 // SLOT_ALIGN) * SLOT_ALIGN)
            try:
                path, buf = self._ring(ring_offsets[-1])
                offsets, sizes, nbytes = ring_offsets[:-1], list(step_ring), ring_offsets[-1]
            except (MemoryLimitError, SegmentSpaceError) as exc:  # the ordinary ring may still fit
                log.info("job %r: no step ring (%s); the worker gets %d slots", self.job_name, exc, nslots)
                step_ring = None
        if step_ring is None and nbytes:
            path, buf = self._ring(nbytes)
        slots = [buf[at : at + numel * 4].view(torch.float32) for at, numel in zip(offsets, sizes)]
        wid = self._next
        self._next += 1
        w = Worker(
            id=wid,
            session=session,
            shm=msg.shm,
            first_step=first_step,
            grad_path=path,
            grad_buffer=buf,
            slots=slots,
            slot_bytes=slot_bytes,
            reserved=nbytes,
            reader=msg.reader,
            slot_offsets=offsets if step_ring is not None else [],
        )
        self.all[wid] = w
        log.info(
            "job %r: %s %d joined at step %d (shm=%s%s)",
            self.job_name, "reader" if w.reader else "worker", wid, w.first_step, w.shm,
            ", a step ring" if w.slot_offsets else "",
        )
        if self.world_size is None:
            self.world_size = msg.world_size
        return w

    def _ring(self, nbytes: int) -> tuple[str, torch.Tensor]:
        """A gradient ring of ``nbytes`` in shared memory, reserved in the account (released
        again, and the segment removed, if it cannot be made or mapped)."""
        self.memory.reserve(nbytes, f"gradient ring of a worker of job {self.job_name!r}")
        path = None
        try:
            path = create_segment(nbytes)
            return path, map_segment(path, nbytes)
        except BaseException:
            if path is not None:
                unlink_segment(path)
            self.memory.release(nbytes)
            raise

    def barrier_opens(self) -> int | None:
        """The number of pushing workers when the start barrier opens now (``world_size`` of them
        have joined); None when it stays shut or opened before."""
        pushers = sum(not w.reader for w in self.all.values())
        if self.started or self.world_size is None or pushers < self.world_size:
            return None
        self.started = True
        return pushers

    def expected(self, step: int) -> set[int]:
        """The workers whose gradient step ``step``'s updates wait for (NOTE [The step commit
        point] in step_commit.py, rule 2: live, ``first_step <= step``, not a reader)."""
        return {w.id for w in self.all.values() if w.first_step <= step and not w.reader}

    def of_session(self, session: bytes) -> Worker:
        for w in self.all.values():
            if w.session == session:
                return w
        raise StateError("this session has not joined the job as a worker: send 'join' first")

    def pop(self, worker_id: int) -> Worker | None:
        return self.all.pop(worker_id, None)

    def free(self, w: Worker) -> None:
        """Unlink the worker's ring and release its memory."""
        if w.grad_path:
            unlink_segment(w.grad_path)
        self.memory.release(w.reserved)
        w.reserved = 0

    def close(self) -> None:
        for w in list(self.all.values()):
            self.free(w)
        self.all.clear()
