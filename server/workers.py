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

from wstream.protocol import StateError
from wstream.protocol import messages as m
from wstream.protocol.shm import create_segment, map_segment, unlink_segment

from .memory import MemoryAccount

log = logging.getLogger(__name__)

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
    slots: list[torch.Tensor]  # fp32 views, one per slot, max_stage_numel each
    slot_bytes: int
    reserved: int
    reader: bool = False  # fetches only (see Join.reader)
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

    def join(self, session: bytes, msg: m.Join, first_step: int, slot_numel: int, slot_bytes: int) -> Worker:
        """Add the worker of ``session``, with ``msg.grad_slots`` gradient slots of ``slot_numel``
        fp32 elements ``slot_bytes`` apart (none for a reader)."""
        if any(w.session == session for w in self.all.values()):
            raise StateError("this session already joined the job as a worker")
        if not self.started and self.world_size is not None and msg.world_size != self.world_size:
            raise StateError(
                f"job {self.job_name!r} is waiting for {self.world_size} workers; this worker says world_size="
                f"{msg.world_size}: give every worker the same world_size"
            )
        nslots = 0 if msg.reader else msg.grad_slots
        nbytes = slot_bytes * nslots
        path, buf = "", torch.empty(0, dtype=torch.uint8)
        if nslots:
            self.memory.reserve(nbytes, f"gradient ring of a worker of job {self.job_name!r}")
            try:
                path = create_segment(nbytes)
            except BaseException:
                self.memory.release(nbytes)
                raise
            buf = map_segment(path, nbytes)
        slots = [buf[k * slot_bytes : k * slot_bytes + slot_numel * 4].view(torch.float32) for k in range(nslots)]
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
        )
        self.all[wid] = w
        log.info(
            "job %r: %s %d joined at step %d (shm=%s)",
            self.job_name, "reader" if w.reader else "worker", wid, w.first_step, w.shm,
        )
        if self.world_size is None:
            self.world_size = msg.world_size
        return w

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
