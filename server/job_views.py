"""What the server says about a job: the ``attached`` reply (its layout and where workers read
it) and its line of ``status``.

Separate from :mod:`wstream.server.job` because they only read a job: replies built from its
state, nothing that changes it.
"""

from __future__ import annotations

import time
from typing import Any

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
        stages=len(job.stages),
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
    )
