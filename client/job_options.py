"""A job's options on the client: :class:`~wstream.protocol.JobOptions` from ``create_job``'s
keywords, and the first difference between two of them (``create_job(exist_ok=True)``)."""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from wstream.protocol import messages as m

log = logging.getLogger(__name__)


LIVE_OPTIMIZER_FIELDS = ("lr", "schedule")
"""What ``set_schedule`` may change on a live job: a rank restarted with the creation's values
attaches to such a job (with a warning) rather than being refused."""


def options_difference(theirs: m.JobOptions, ours: m.JobOptions) -> str | None:
    """The first field in which a job's options differ from those asked for, said readably
    (the optimizer's live fields aside: :data:`LIVE_OPTIMIZER_FIELDS`)."""
    live = {f: getattr(theirs.optimizer, f) for f in LIVE_OPTIMIZER_FIELDS if hasattr(ours.optimizer, f)}
    if type(theirs.optimizer) is type(ours.optimizer) and live:
        changed = [f for f, v in live.items() if getattr(ours.optimizer, f) != v]
        if changed:
            log.warning("the job's %s differ from those given (changed on the live job?); the job's are kept", changed)
        ours = msgspec.structs.replace(ours, optimizer=msgspec.structs.replace(ours.optimizer, **live))
    for field in m.JobOptions.__struct_fields__:
        if field == "units":  # how the stages are cut for transfer, not how the job trains (a layout
            continue  # matter, compared stage by stage at attach; client/units.py)
        a, b = getattr(theirs, field), getattr(ours, field)
        if a != b:
            return f"{field}: the job has {a!r}, asked {b!r}"
    return None


def job_options(options: m.JobOptions | None, fields: dict[str, Any]) -> m.JobOptions:
    """``options``, or a :class:`JobOptions` of the keyword ``fields``; an unknown field is named."""
    if options is not None and fields:
        raise TypeError(f"give options= or its fields as keywords ({', '.join(sorted(fields))}), not both")
    if options is None:
        known = set(m.JobOptions.__struct_fields__)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise TypeError(f"create_job() got unknown option(s) {unknown}; a job's options are {sorted(known)}")
        options = m.JobOptions(**fields)
    if options.dtype not in m.DTYPE_ITEMSIZE:  # the server refuses it too, less readably
        raise ValueError(
            f"dtype {options.dtype!r}: a job computes in float32, bfloat16 or float16 (the server keeps an fp32 "
            "master of its weights either way)"
        )
    return options
