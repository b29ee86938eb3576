"""The gradient side of streaming: the pusher that sends stage gradients from a sender thread."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch
import zmq

from wstream.protocol import StageSpec, WaitTimeoutError, WstreamError
from wstream.protocol import messages as m
from wstream.protocol.frames import tensor_frames
from wstream.protocol.layout import push_layout
from wstream.protocol.wake import WakePipe

from .channel import Channel, raise_or_narrow
from .device import DONE, CopyTicket
from .gradient_write import DeferredWrite, GradientStager
from .streaming import StreamContext, StreamStats
from .threads import serial_thread
from .waiting import POLL_SLICE_S, WaitWatch

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Unsent:
    """A push (or the step's commit) handed to the sender thread: sent once ``ticket`` (the
    gradient's copy) is done."""

    message: m.Push | m.Commit
    frames: list[object]
    ticket: CopyTicket
    sumsq: Callable[[], float] | None = None
    """The push's ``sumsq`` (the gradient's squared norm), read once the ticket is done."""


@dataclass(slots=True)
class _Sent:
    slot: int | None  # None: the step's commit
    stage: int
    step: int
    sent_ns: int
    returned_ns: int


class GradientPusher:
    """Sends stage gradients without making compute wait; a ``pushed`` reply frees its slot (a credit).

    The compute thread writes a gradient into a free slot (on a GPU: issues its device -> host
    copy, NOTE [Copy ordering on a GPU] rule 3) and hands the ``push`` to a sender thread, which
    owns this pusher's socket: it sends each push, in order, once its copy is complete, and reads
    the replies. The compute thread only waits for a free slot or, at the end of a step, for the
    acknowledgements; a reply that does not come within the client's ``wait_timeout`` while it
    waits is :class:`WaitTimeoutError` (naming what the job waits for; ``client/waiting.py``), and
    an error reply is raised there too.

    ``slots`` are host fp32 views: the worker's shared-memory gradient ring, or (``shm=False``) its
    own buffers whose bytes go out as data frames (a slot is busy until its reply, so a buffer is
    never refilled while ZeroMQ may still read it)."""

    def __init__(
        self, sc: StreamContext, slots: list[torch.Tensor], *, shm: bool, stager: GradientStager, step_ring: bool = False
    ) -> None:
        self._sc = sc
        self._slots = slots
        self._nslots = len(slots)
        self._shm = shm
        self._stager = stager
        self._step_ring = step_ring  # slot k is stage k's (Join.step_ring)
        self._cond = threading.Condition()
        self._free = set(range(len(slots)))
        self._unsent: deque[_Unsent] = deque()
        self._outstanding: dict[int, _Sent] = {}  # request id -> what was sent
        self._replies = 0  # replies seen: progress, for the wait deadline
        self._error: BaseException | None = None
        self.committed: m.Committed | None = None  # the newest step's commit reply
        self._stop = threading.Event()
        self._wake = WakePipe()
        self.stats = StreamStats()
        self._thread = serial_thread(self._run, "wstream-push")

    @property
    def slots(self) -> int:
        """Slots of the ring (a step ring: one per server stage)."""
        return self._nslots

    # ---- the compute thread ----------------------------------------------------------------------
    def push(
        self, stage: int, step: int, spec: StageSpec, grads: list[torch.Tensor | None], *, borrowed: bool = False,
        grad_numel: int | None = None,
    ) -> None:
        """Write the stage's per-parameter gradients (and its buffers' values: ``push_layout``)
        into a free slot and have ``push`` sent. On a CPU worker the write itself runs on the
        sender thread (``GradientStager``, deferred) unless ``borrowed``: the caller reuses the
        gradients' memory once this returns; ``grad_numel``: the gradient part of a push already
        flat (the rest is its buffers' values, left out of its norm)."""
        slot = self._acquire(stage)
        t0 = time.monotonic_ns()
        numel = push_layout(spec).numel  # the stage's gradient (frozen parameters have none), then its buffers
        ticket, sumsq = self._stager.write_measured(
            self._slots[slot], spec, grads, stage=stage, step=step, borrowed=borrowed, grad_numel=grad_numel
        )
        frames: list[object] = [] if self._shm else list(tensor_frames(self._slots[slot][:numel]))
        msg = m.Push(session=self._sc.session, stage=stage, step=step, slot=slot, numel=numel)
        with self._cond:
            self._unsent.append(_Unsent(msg, frames, ticket, sumsq))
        self._wake.wake()
        if self._sc.tracer is not None and not isinstance(ticket, DeferredWrite):  # a deferred one says when it ran
            self._sc.tracer.add(f"grad copy {stage}", "push", "compute", t0, stage=stage, step=step)
        self.stats.pushes += 1
        self.stats.bytes_pushed += numel * 4

    def commit(self, step: int) -> None:
        """Say that every gradient of ``step`` is pushed (after them, on the same socket); its reply
        comes when the step commits (NOTE [The step commit point] in server/step_commit.py) and is kept
        in :attr:`committed`; :meth:`drain` waits for it."""
        with self._cond:
            self._unsent.append(_Unsent(m.Commit(session=self._sc.session, step=step), [], DONE))
        self._wake.wake()

    def drain(self) -> None:
        """Wait until every push and commit is answered: for a commit, the step committed (its
        updates are queued; the next step's fetches wait for them)."""
        self._wait_until(
            lambda: not self._outstanding and not self._unsent, "wait commit", "for the step to commit (every worker's gradients)"
        )

    def wait_committed(self, step: int) -> None:
        """Wait until step ``step`` committed (its ``committed`` reply): every push of it was
        taken, gathered or held. Unlike :meth:`drain` it does not wait for the held slots, which
        come back as their stages' updates end, overlapping the next step's forward; a later push
        into one waits for it there (NOTE [Held gradient slots] in server/step_commit.py)."""
        self._wait_until(
            lambda: not self._unsent and self.committed is not None and self.committed.step >= step,
            "wait commit", "for the step to commit (every worker's gradients)",
        )

    def _acquire(self, stage: int) -> int:
        """A free slot for ``stage``'s gradient: the lowest free one, or, in a step ring, the stage's
        own (free once the server's update read its last gradient)."""
        if self._step_ring:
            self._wait_until(lambda: stage in self._free, f"wait grad slot {stage}", f"for stage {stage}'s gradient slot")
            with self._cond:
                self._free.remove(stage)
                return stage
        self._wait_until(lambda: bool(self._free), f"wait grad slot {stage}", "for a free gradient slot")
        with self._cond:
            slot = min(self._free)
            self._free.remove(slot)
            return slot

    def _wait_until(self, done: Callable[[], bool], what: str, why: str) -> None:
        """Wait (with the lock's condition) until ``done()``; raise what the sender thread met, an
        abort, or, after ``wait_timeout`` without any reply, :class:`WaitTimeoutError` naming what
        the job waits for (:class:`ServerUnavailable` if the server does not say). ``what`` labels
        the wait in a timeline, ``why`` in the reports."""
        with self._cond:
            if self._error is None and done():
                return
        t0, t0_ns = time.perf_counter(), time.monotonic_ns()
        watch = WaitWatch(self._sc.endpoint, why)
        seen = self._replies
        while True:
            with self._cond:
                if self._error is not None:
                    raise self._error
                if done():
                    break
                if self._sc.abort.is_set():
                    self._sc.raise_aborted()
                if self._replies != seen:  # progress: a long backlog of pushes is not a stall
                    seen = self._replies
                    watch.progress()
                self._cond.wait(POLL_SLICE_S)
            try:
                watch.tick()  # outside the lock: it may ask the server
            except WaitTimeoutError:  # this wait's: a later one may find what it waits for
                raise
            except WstreamError as exc:  # the server did not answer: every later wait fails with it too
                with self._cond:
                    self._error = exc
                raise
        self.stats.push_wait_s += time.perf_counter() - t0
        if self._sc.tracer is not None:
            self._sc.tracer.add(what, "wait", "compute", t0_ns)

    def uncommitted(self) -> bool:
        """Whether a push waits for a step this pusher sent no commit for (a step left half-way):
        its reply may only come with an update that never runs (a held slot)."""
        with self._cond:
            commits = [u.message.step for u in self._unsent if isinstance(u.message, m.Commit)]
            commits += [e.step for e in self._outstanding.values() if e.slot is None]
            last = max([*commits, -1 if self.committed is None else self.committed.step])
            pushes = [u.message.step for u in self._unsent if isinstance(u.message, m.Push)]
            pushes += [e.step for e in self._outstanding.values() if e.slot is not None]
            return any(step > last for step in pushes)

    def forget_outstanding(self) -> None:
        with self._cond:
            self._outstanding.clear()
            self._unsent.clear()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.wake()
        self._thread.join()
        self._wake.close()
        self._slots = []  # the ring's views: its mapping goes with the last of them, not at a garbage collection

    # ---- the sender thread -----------------------------------------------------------------------
    def _run(self) -> None:
        chan = self._sc.channel()
        poller = zmq.Poller()
        poller.register(chan.socket, zmq.POLLIN)
        poller.register(self._wake.fileno(), zmq.POLLIN)
        try:
            while not self._stop.is_set():
                sent = self._send_ready(chan)
                events = dict(poller.poll(0 if sent else 100))
                if self._wake.fileno() in events:
                    self._wake.clear()
                if chan.socket in events:
                    self._take_replies(chan)
        except BaseException as exc:  # raised in the compute thread by its next wait
            with self._cond:
                if self._error is None:
                    self._error = exc
                self._cond.notify_all()
        finally:
            chan.close()

    def _send_ready(self, chan: Channel) -> bool:
        """Send the oldest unsent push once its copy is done (waits for that copy only)."""
        with self._cond:
            if not self._unsent:
                return False
            item = self._unsent[0]
        item.ticket.synchronize()
        msg = item.message
        if item.sumsq is not None:  # the server may take it for the stage's norm (NOTE [Held gradient slots])
            assert isinstance(msg, m.Push)
            msg = msgspec.structs.replace(msg, sumsq=item.sumsq())
        sent = time.monotonic_ns()
        rid = chan.send(msg, item.frames, copy=False)
        with self._cond:
            if self._unsent and self._unsent[0] is item:  # not forgotten meanwhile
                self._unsent.popleft()
                if isinstance(msg, m.Push):
                    self._outstanding[rid] = _Sent(msg.slot, msg.stage, msg.step, sent, time.monotonic_ns())
                else:
                    self._outstanding[rid] = _Sent(None, -1, msg.step, sent, time.monotonic_ns())
        return True

    def _take_replies(self, chan: Channel) -> None:
        while chan.socket.poll(0, zmq.POLLIN):
            reply, _ = chan.recv(timeout_s=self._sc.endpoint.wait_timeout_s)
            with self._cond:
                entry = self._outstanding.pop(reply.id, None)
                if entry is None:
                    log.debug("dropping an unexpected reply %s", type(reply).__name__)
                    continue
                if entry.slot is not None:
                    self._free.add(entry.slot)
                self._replies += 1
                self._cond.notify_all()
            if entry.slot is None:
                if self._sc.tracer is not None:
                    self._sc.tracer.add(f"commit {entry.step}", "commit", "gradient pushes", entry.sent_ns, step=entry.step)
                committed = raise_or_narrow(reply, m.Committed)
                with self._cond:
                    self.committed = committed
                    self.stats.skipped_steps += committed.skipped
                    self._cond.notify_all()
                continue
            if self._sc.tracer is not None:  # the send; when the worker saw the reply goes in args
                seen_us = (time.monotonic_ns() - entry.sent_ns) / 1000
                self._sc.tracer.add(
                    f"push {entry.stage}", "push", "gradient pushes", entry.sent_ns, entry.returned_ns,
                    stage=entry.stage, step=entry.step, ack_seen_us=seen_us,
                )
            raise_or_narrow(reply, m.Pushed)
