"""Waits on other workers that say what they wait for, and end.

A worker's step waits on the others twice: for its commit (every expected worker's gradients of
the step) and for the next step's weights (the updates that the commit starts). Such a wait may
legitimately take long (a slower rank), or forever (a rank that was never started, a second
trainer of the job stepped from the same thread). :class:`WaitWatch` turns both into words: every
``wait_report_s`` it asks the server what the job waits for (``status``'s ``waiting``) and logs
it, and after ``wait_timeout_s`` without progress it raises :class:`WaitTimeoutError` with that
cause. A server that stops answering the question is :class:`ServerUnavailable`, as before.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from wstream.protocol import WaitTimeoutError
from wstream.protocol import messages as m

from .channel import Channel
from .endpoint import WorkerEndpoint

log = logging.getLogger(__name__)

POLL_SLICE_S = 0.1
"""How often a watched wait looks at its clock (and its stop event)."""


def job_waiting(endpoint: WorkerEndpoint) -> str | None:
    """What the server says the job waits for (None: nothing); ServerUnavailable if it is silent."""
    chan = endpoint.channel(timeout_s=min(endpoint.timeout_s, 10.0))
    try:
        status, _ = chan.request(m.Status(job=endpoint.job), m.StatusReply)
    finally:
        chan.close()
    for info in status.jobs:
        if info.name == endpoint.job:
            return info.waiting
    return f"the job {endpoint.job!r} is gone from the server"


class WaitWatch:
    """One wait of ``what`` (e.g. "for the commit of step 3"): call :meth:`tick` while it lasts,
    :meth:`progress` when something it waits for came."""

    def __init__(self, endpoint: WorkerEndpoint, what: str) -> None:
        self.endpoint = endpoint
        self.what = what
        self.progress()

    def progress(self) -> None:
        self.started = time.monotonic()
        self.next_report = self.started + self.endpoint.wait_report_s

    def tick(self) -> None:
        now = time.monotonic()
        timeout = self.endpoint.wait_timeout_s
        if now < self.next_report and now - self.started < timeout:
            return
        cause = job_waiting(self.endpoint) or (
            "the server names no worker it waits for (its updates or a reply may be slow)"
        )
        waited = now - self.started
        if waited >= timeout:
            raise WaitTimeoutError(
                f"job {self.endpoint.job!r}: gave up waiting {self.what} after {timeout:g} s (the client's "
                f"wait_timeout): {cause}"
            )
        log.warning("job %r: still waiting %s after %.1f s: %s", self.endpoint.job, self.what, waited, cause)
        self.next_report = now + self.endpoint.wait_report_s


def recv_watched(
    chan: Channel, watch: WaitWatch, stop: threading.Event | None = None
) -> tuple[m.Message, list[zmq.Frame]]:
    """``chan``'s next reply, however long it takes, with ``watch`` ticking meanwhile."""
    while not chan.socket.poll(int(POLL_SLICE_S * 1000), zmq.POLLIN):
        if stop is not None and stop.is_set():
            raise InterruptedError("channel wait interrupted by shutdown")
        watch.tick()
    return chan.recv(stop=stop)

