"""What the server says about a job: the ``attached`` reply (its layout and where workers read
it) and its line of ``status``.

Separate from :mod:`wstream.server.job` because they only read a job: replies built from its
state, nothing that changes it.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from wstream.protocol import messages as m

from .job import Job


def attached_reply(job: Job, session: bytes, lease_s: float, request_id: int) -> m.Attached:
    """The reply to ``create_job``, ``attach`` and ``seal``: the job's layout and where to read it."""
    return m.Attached(
        id=request_id,
        session=session,
        job=job.name,
        stages=[s.spec for s in job.stages],
        options=job.options,
        step=max((s.version for s in job.stages), default=0),
        ready=job.ready,
        published_path=job.published.path,
        published_bytes=job.published.nbytes,
        slot_offsets=[s.slot_offsets for s in job.stages],
        published_dtype=job.published_dtype,
        lease_s=lease_s,
        compute_threads=torch.get_num_threads(),
        server_pid=os.getpid(),
        incarnation=job.incarnation,
        **_base_fields(job),
    )


def _base_fields(job: Job) -> dict[str, Any]:
    """The fields of :class:`Attached` that say where a job's base is (none without one)."""
    base = job.base
    if base is None:
        return {}
    return {
        "base_stages": [s.spec for s in base.stages],
        "base_path": base.published.path,
        "base_bytes": base.published.nbytes,
        "base_offsets": [s.slot_offsets[0] for s in base.stages],
    }


def job_info(job: Job) -> m.JobInfo:
    """One job's line of ``status``."""
    now = time.monotonic()
    return m.JobInfo(
        name=job.name,
        stages=job.num_chain_stages,
        units=None if job.options.units is None else len(job.stages),
        params=job.num_params,
        step=job.step,
        ready=job.ready,
        optimizer=type(job.options.optimizer).__name__,
        dtype=job.options.dtype,
        bytes=sum(job.memory_by_kind().values()),
        workers=[
            m.WorkerInfo(id=w.id, shm=w.shm, first_step=w.first_step, idle_s=now - w.last_seen)
            for w in job.workers.values()
        ],
        updates=job.updates,
        optimizer_s=job.counters.optimizer.sum,
        last_snapshot=job.last_snapshot_step,
        steps_per_s=job.counters.steps.rate(now),
        frozen=job.options.frozen,
        base=job.options.base,
        grad_norm=job.last_commit.grad_norm if job.last_commit else None,
        lr=job.last_commit.lr if job.last_commit else None,
        skipped_steps=job.skipped_steps,
        discarded_steps=job.discarded_steps,
        waiting=waiting_for(job, now),
    )


def waiting_for(job: Job, now: float) -> str | None:
    """What the job's open step waits for on its workers, in words; None when nothing does (no
    worker, a step not begun by anyone, or every gradient in and the commit under way)."""
    table = job.worker_table
    pushers = sorted(w.id for w in table.all.values() if not w.reader)
    if not job.ready or not pushers:
        return None
    if not table.started:
        size = table.world_size or 0
        return (
            f"waiting for {size - len(pushers)} of {size} workers to join (world_size={size}); "
            f"present: {_workers(pushers)}"
        )
    if not job.contributors and not job.waiting_commit:
        return None  # nobody has begun the open step
    trained = [st for st in job.stages if st.trained]
    total = sum(job.chain_stages(st.index) for st in trained)  # chain stages, as the worker counts them
    lagging = []
    for wid in sorted(table.expected(job.open_step)):
        missing = sum(job.chain_stages(st.index) for st in trained if wid not in st.gathered and wid not in st.pending)
        if missing:
            idle = now - table.all[wid].last_seen
            lagging.append(
                f"the gradients of worker {wid} ({missing} of {total} stages missing; heard from {idle:.1f} s ago)"
            )
    if not lagging:
        return None
    return f"step {job.open_step}: waiting for " + ", ".join(lagging)


def _workers(ids: list[int]) -> str:
    return ("worker " if len(ids) == 1 else "workers ") + ", ".join(map(str, ids))
