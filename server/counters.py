"""What the server counts that no state holds: bytes served, gradients, durations, requests, errors;
and the trace events a job keeps for ``timeline``.

Written by the loop thread only and read by :mod:`wstream.server.metrics` at scrape time (NOTE
[Metrics are read from the server's state at scrape time] in metrics.py, rules 2 and 3). Kept apart
from metrics so that the jobs and the server that write them do not import the Prometheus side,
and the collector that reads them imports neither the jobs nor the server.
"""

from __future__ import annotations

import bisect
import math
import sys
from collections import Counter, deque
from dataclasses import dataclass, field

from prometheus_client.utils import floatToGoString

from wstream.protocol import messages as m

OPTIMIZER_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
"""Seconds of one stage update: from a small layer (tens of microseconds) to a huge one."""
SNAPSHOT_BUCKETS = (0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0, 3000.0)
"""Seconds of one snapshot, from start to durable."""
RATE_WINDOW_S = 30
"""``steps_per_s`` counts the steps completed over this many seconds."""


class Histogram:
    """Observations in fixed buckets (Prometheus ``le`` semantics); one writer, read at scrape."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        """``[(le, observations <= le), ..., ("+Inf", count)]`` from one copy of the buckets."""
        total = 0
        out = []
        for bound, n in zip((*self.bounds, math.inf), list(self.counts)):
            total += n
            out.append((floatToGoString(bound), total))
        return out


class StepRate:
    """Steps completed per second over the last :data:`RATE_WINDOW_S` seconds, counted in
    one-second bins (memory bounded by the window, whatever the step rate)."""

    __slots__ = ("_bins", "since")

    def __init__(self) -> None:
        self.since: float | None = None  # when training started: the rate is 0 before
        self._bins: deque[list[int]] = deque()  # [second, steps completed in it], oldest first

    def start(self, now: float) -> None:
        if self.since is None:
            self.since = now

    def add(self, steps: int, now: float) -> None:
        sec = int(now)
        if self._bins and self._bins[-1][0] == sec:
            self._bins[-1][1] += steps
        else:
            self._bins.append([sec, steps])
        while self._bins[0][0] <= sec - RATE_WINDOW_S:
            self._bins.popleft()

    def rate(self, now: float) -> float:
        """Steps per second; read-only, so safe from the scrape thread (NOTE [Metrics are read from
        the server's state at scrape time] in metrics.py, rule 3)."""
        if self.since is None:
            return 0.0
        cutoff = int(now) - RATE_WINDOW_S
        steps = sum(n for sec, n in list(self._bins) if sec > cutoff)
        return steps / min(float(RATE_WINDOW_S), max(now - self.since, 1.0))


@dataclass(slots=True)
class JobCounters:
    """What one job counts for its metrics and status (loop thread only: NOTE [Metrics are read
    from the server's state at scrape time] in metrics.py, rule 2)."""

    served: dict[tuple[str, str], int] = field(
        default_factory=lambda: {("fetch", "shm"): 0, ("fetch", "frames"): 0, ("pull", "frames"): 0}
    )
    """Bytes of weights served, by (op, via): a shared-memory reply counts the bytes it points at."""
    gradients: int = 0
    gradient_bytes: int = 0
    held_gradients: int = 0
    """Gradients read in place from their worker's slot by the update (NOTE [Held gradient
    slots] in step_commit.py), counted in ``gradients`` too; the others were gathered."""
    optimizer: Histogram = field(default_factory=lambda: Histogram(OPTIMIZER_BUCKETS))
    """Seconds of every stage update (its count is the job's updates, its sum its optimizer time)."""
    snapshots: Histogram = field(default_factory=lambda: Histogram(SNAPSHOT_BUCKETS))
    snapshot_bytes: int = 0
    snapshot_failures: int = 0
    steps: StepRate = field(default_factory=StepRate)


@dataclass(slots=True)
class ServerCounters:
    """Requests decoded, by op, and error replies sent, by code (loop thread only)."""

    requests: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)


class Timeline:
    """A job's last :data:`~wstream.protocol.messages.MAX_TRACE_EVENTS` trace events (gradients
    gathered, updates queued and run, fetches deferred), returned by ``timeline``; loop thread only.
    Always on, so a trace asked for later finds the server's side of the steps it covers: about
    12 MiB per job once full (docs/operating.md, sizing), outside the memory limit."""

    __slots__ = ("dropped", "events")

    def __init__(self) -> None:
        self.events: deque[m.TraceEvent] = deque(maxlen=m.MAX_TRACE_EVENTS)
        self.dropped = 0  # events pushed out by newer ones

    def add(self, name: str, cat: str, lane: str, start_ns: int, end_ns: int, stage: int, step: int) -> None:
        if len(self.events) == self.events.maxlen:
            self.dropped += 1
        self.events.append(  # the name interned: the same few per stage, step after step (a quarter of the bytes)
            m.TraceEvent(name=sys.intern(name), cat=cat, lane=lane, start_ns=start_ns, dur_ns=end_ns - start_ns, stage=stage, step=step)
        )

    def since(self, since_ns: int) -> list[m.TraceEvent]:
        """The events that ended at or after ``since_ns``."""
        return [e for e in self.events if e.start_ns + e.dur_ns >= since_ns]
