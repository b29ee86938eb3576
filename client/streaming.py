"""What the worker's streaming threads share: the connection's context, stats, and the heartbeat.

The threads themselves live apart: the weight ring and prefetch thread in ``prefetch.py``
(NOTE [Residency bound]), the gradient pusher in ``push.py``. This module is what both need
(:class:`StreamContext`, :class:`StreamStats`, :class:`LatencyWindow`) plus the small heartbeat
thread, so neither imports the other.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from wstream.protocol import ServerUnavailable, WstreamError
from wstream.protocol import messages as m
from wstream.protocol.auth import SessionSigner

from .channel import Channel
from .endpoint import WorkerEndpoint
from .timeline import Tracer

TRACE_MIN_WAIT_NS = 20_000
"""Waits shorter than this are left out of a timeline (they would only clutter it)."""

log = logging.getLogger(__name__)

TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LatencyWindow:
    """The last ``capacity`` latency samples (seconds), for percentiles; ``count`` is all ever seen.

    Appends come from one thread and reads from another: ``deque.append`` and ``list(deque)`` are
    atomic in CPython, so a reader sees a consistent (possibly one sample old) window."""

    def __init__(self, capacity: int = 4096) -> None:
        self._samples: deque[float] = deque(maxlen=capacity)
        self.count = 0

    def record(self, seconds: float) -> None:
        self._samples.append(seconds)
        self.count += 1

    def samples(self) -> list[float]:
        return list(self._samples)

    def quantile(self, q: float) -> float:
        """Nearest-rank ``q``-quantile (0 < q <= 1) of the window; NaN when it is empty."""
        if not 0.0 < q <= 1.0:
            raise ValueError(f"q must be in (0, 1], got {q}")
        data = sorted(self._samples)
        if not data:
            return math.nan
        return data[max(0, math.ceil(q * len(data)) - 1)]


@dataclass(slots=True)
class StreamStats:
    fetches: int = 0
    bytes_fetched: int = 0  # copied into the ring (or received): 0 on the zero-copy path
    bytes_read_in_place: int = 0  # zero-copy: the published bytes computed on where they are
    fetch_wait_s: float = 0.0  # time compute waited for weights
    # Round trip of each fetch: request sent -> weights reply taken off the socket by the prefetch
    # thread. A fetch during whose round trip the thread waited for a free ring buffer is left out
    # (counted in ``fetch_latency_skipped``): its reply sat in the socket while compute held the
    # ring, so the time would measure the worker's compute, not the server.
    fetch_latency: LatencyWindow = field(default_factory=LatencyWindow)
    fetch_latency_skipped: int = 0
    pushes: int = 0
    bytes_pushed: int = 0
    push_wait_s: float = 0.0  # time compute waited for a free gradient slot or the final acks
    skipped_steps: int = 0  # steps committed without an update (their gradient norm was not finite)


@dataclass(kw_only=True)
class StreamContext:
    """What the streaming threads need to know about the connection and the job."""

    endpoint: WorkerEndpoint  # the server, the client's CURVE keys and timeouts
    session: bytes
    signer: SessionSigner  # shared by every channel of the session (one seq counter)
    numels: list[int]
    published: torch.Tensor | None  # uint8 mapping of the published segment, None in frames mode
    published_dtype: torch.dtype
    zero_copy: bool = False  # compute on views of ``published`` instead of ring copies
    tracer: Tracer | None = None  # set while ``Trainer.trace`` records a timeline
    base_published: torch.Tensor | None = None  # uint8 mapping of the frozen base's segment
    base_numels: list[int] = field(default_factory=list)  # per stage, of the base's stage
    abort: threading.Event = field(default_factory=threading.Event)
    abort_reason: list[WstreamError] = field(default_factory=list)

    def channel(self, timeout_s: float | None = None) -> Channel:
        """A channel of this session for one streaming thread (its own socket)."""
        return self.endpoint.channel(timeout_s, signer=self.signer)

    def raise_aborted(self) -> None:
        if self.abort_reason:
            raise self.abort_reason[0]
        raise ServerUnavailable("the worker was shut down")


class HeartbeatThread:
    """Keeps the worker's lease alive; on failure records the error and sets ``abort``."""

    def __init__(self, sc: StreamContext, interval_s: float, timeout_s: float | None = None) -> None:
        self._sc = sc
        self._interval = interval_s
        self._timeout_s = sc.endpoint.timeout_s if timeout_s is None else timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wstream-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sc = self._sc
        chan = sc.channel(self._timeout_s)
        try:
            while not self._stop.wait(self._interval):
                try:
                    chan.request(m.Heartbeat(session=sc.session), m.Ok, stop=self._stop)
                except InterruptedError:
                    return
                except WstreamError as exc:
                    log.warning("heartbeat failed: %s (the trainer reconnects where it may: Transport.reconnect_s)", exc)
                    sc.abort_reason.append(exc)
                    sc.abort.set()
                    return
        finally:
            chan.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
