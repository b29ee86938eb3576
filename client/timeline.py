"""A timeline of training steps, both sides, as a Chrome-trace / Perfetto JSON file.

The worker records spans while :meth:`Trainer.trace` is active: compute per stage (first forward,
recomputation, backward), waits (for weights, for a gradient slot, for an update), weight fetches
(request to reply), copies into the weight ring and gradient pushes (send to acknowledgement).
The server keeps a bounded timeline per job (gradients gathered, updates queued, optimizer steps
per stage, fetches it deferred) and sends it back on ``timeline``. Both clocks are monotonic; the
server's is mapped onto the worker's by one round trip (offset = server time at the reply minus
the midpoint of send and receive), so one file shows both processes on one time axis.

Spans that overlap on one lane (several fetches in flight, say) are spread over numbered
sub-lanes, so every event is a plain complete event ("ph": "X") and any viewer nests them right.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wstream.protocol import messages as m

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class Span:
    name: str
    cat: str
    lane: str
    start_ns: int
    end_ns: int
    args: dict[str, Any] = field(default_factory=dict)


class Tracer:
    """Collects one worker's spans; ``add`` may be called from any thread (a list append)."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.started_ns = time.monotonic_ns()

    def add(self, name: str, cat: str, lane: str, start_ns: int, end_ns: int | None = None, **args: Any) -> None:
        self.spans.append(Span(name, cat, lane, start_ns, time.monotonic_ns() if end_ns is None else end_ns, args))

    @contextlib.contextmanager
    def span(self, name: str, cat: str, lane: str, **args: Any) -> Iterator[None]:
        start = time.monotonic_ns()
        try:
            yield
        finally:
            self.add(name, cat, lane, start, **args)


# Lanes in the order a reader wants them, top to bottom; others follow in order of appearance.
WORKER_LANES = ("steps", "compute", "weight fetches", "weight copies", "gradient pushes")
SERVER_LANES = ("gradients in", "update queue", "deferred fetches")


def server_spans(events: Iterable[m.TraceEvent], offset_ns: int, since_ns: int) -> list[Span]:
    """The server's events on the worker's clock (``offset_ns`` = server clock - worker clock),
    those ending after ``since_ns`` (worker clock)."""
    out = []
    for e in events:
        start = e.start_ns - offset_ns
        if start + e.dur_ns >= since_ns:
            out.append(Span(e.name, e.cat, e.lane, start, start + e.dur_ns, {"stage": e.stage, "step": e.step}))
    return out


def chrome_trace(processes: list[tuple[str, list[Span], tuple[str, ...]]], *, t0_ns: int) -> dict[str, Any]:
    """Chrome-trace JSON (``traceEvents``) of ``(process name, spans, preferred lane order)``."""
    events: list[dict[str, Any]] = []
    for pid, (pname, spans, order) in enumerate(processes, start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": pname}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        lanes = _assign_sublanes(spans)
        names = sorted({lane for lane, _ in lanes}, key=lambda n: _lane_key(n, order))
        tids = {name: tid for tid, name in enumerate(names, start=1)}
        for name, tid in tids.items():
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        for lane, s in lanes:
            events.append(
                {
                    "name": s.name,
                    "cat": s.cat,
                    "ph": "X",
                    "pid": pid,
                    "tid": tids[lane],
                    "ts": (s.start_ns - t0_ns) / 1000,
                    "dur": max(s.end_ns - s.start_ns, 0) / 1000,
                    "args": s.args,
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _assign_sublanes(spans: list[Span]) -> list[tuple[str, Span]]:
    """Each span with the (sub-)lane it is drawn on: a span that overlaps an earlier one on its
    lane without nesting inside it moves to ``lane #2``, ``#3``... (interval partitioning)."""
    by_lane: dict[str, list[Span]] = {}
    for s in spans:
        by_lane.setdefault(s.lane, []).append(s)
    out: list[tuple[str, Span]] = []
    for lane, items in by_lane.items():
        items.sort(key=lambda s: (s.start_ns, -s.end_ns))
        stacks: list[list[Span]] = []  # per sub-lane, the open spans (nested ones stack up)
        for s in items:
            for k, stack in enumerate(stacks):
                while stack and stack[-1].end_ns <= s.start_ns:
                    stack.pop()
                if not stack or s.end_ns <= stack[-1].end_ns:  # free, or nested in the open span
                    stack.append(s)
                    out.append((lane if k == 0 else f"{lane} #{k + 1}", s))
                    break
            else:
                stacks.append([s])
                out.append((lane if not stacks[1:] else f"{lane} #{len(stacks)}", s))
    return out


def _lane_key(name: str, order: tuple[str, ...]) -> tuple[int, str]:
    base, _, sub = name.partition(" #")
    rank = order.index(base) if base in order else len(order)
    return (rank, f"{base}\x00{int(sub) if sub else 1:04d}")


def write_trace(path: str | Path, trace: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace, separators=(",", ":")))
    return path


def write_worker_trace(
    path: str | os.PathLike[str],
    tracer: Tracer,
    request: Callable[[], m.TimelineReply],
    *,
    job: str,
    worker: int,
) -> None:
    """Ask the server for its timeline (``request()``) and write it with ``tracer``'s spans as one
    Chrome trace at ``path``. The server's clock is mapped onto the worker's by that round trip:
    offset = server time at the reply minus the midpoint of send and receive."""
    sent = time.monotonic_ns()
    reply = request()
    received = time.monotonic_ns()
    offset = reply.now_ns - (sent + received) // 2
    uncertainty = (received - sent) // 2  # the offset is right to within this
    # kept: what may have ended after the trace began, given that uncertainty (a loaded machine's
    # round trip can be tens of ms, one-sided: the first pushes' events must not fall out)
    server = server_spans(reply.events, offset, tracer.started_ns - uncertainty)
    if reply.dropped:
        log.warning("the server's timeline of job %r lost %d older events", job, reply.dropped)
    processes = [
        (f"worker {worker} (job {job})", tracer.spans, WORKER_LANES),
        (f"wstream-server (job {job})", server, SERVER_LANES),
    ]
    start = min((s.start_ns for _, spans, _ in processes for s in spans), default=tracer.started_ns)
    trace = chrome_trace(processes, t0_ns=start)
    trace["otherData"] = {
        "job": job,
        "worker": worker,
        "clock_offset_ns": offset,  # server clock - worker clock
        "clock_uncertainty_ns": uncertainty,
        "server_events_dropped": reply.dropped,
    }
    write_trace(path, trace)
    log.info("timeline of %d worker and %d server events written to %s", len(tracer.spans), len(server), path)
