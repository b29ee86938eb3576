"""The worker's streaming machinery: weight ring, prefetch thread, gradient pusher, heartbeat.

# NOTE [Residency bound]
# 1. The ring preallocates ``prefetch + 1`` flat buffers, each the size of the largest stage, on
#    the compute device; nothing else on the worker holds stage weights.
# 2. A buffer is *resident* from the prefetcher's ``acquire`` until the trainer's ``release``, so
#    at most ``prefetch + 1`` stages' weights exist at once (``WeightRing.peak`` proves it).
# 3. The prefetcher walks the step's fetch order and blocks when the ring is full, which is what
#    keeps it no more than ``prefetch`` stages ahead of compute.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from wstream.protocol import ServerUnavailable, StageSpec, WstreamError
from wstream.protocol import messages as m
from wstream.protocol.auth import SessionSigner
from wstream.protocol.curve import ClientKeys

from wstream.protocol.frames import copy_frames_into, frames_nbytes, tensor_frames

from .channel import Channel, no_answer, raise_or_narrow
from .device import DONE, CopyEngine, CopyTicket, GradientStager, ReceiveRing
from .timeline import Tracer

TRACE_MIN_WAIT_NS = 20_000
"""Waits shorter than this are left out of a timeline (they would only clutter it)."""

log = logging.getLogger(__name__)

TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightRing:
    """``capacity`` preallocated flat weight buffers; see NOTE [Residency bound].

    With ``allocate=False`` (zero-copy CPU workers) the ring holds no memory and only counts the
    stages in use, which still bounds how far the prefetcher runs ahead."""

    def __init__(
        self, capacity: int, numel: int, dtype: torch.dtype, device: torch.device, *, allocate: bool = True
    ) -> None:
        size = numel if allocate else 0
        self.buffers = [torch.empty(size, dtype=dtype, device=device) for _ in range(capacity)]
        # per buffer: when compute was done with it (NOTE [Copy ordering on a GPU], rule 2)
        self._consumed: list[CopyTicket] = [DONE] * capacity
        self._free: deque[int] = deque(range(capacity))
        self._cond = threading.Condition()
        self.resident = 0
        self.peak = 0
        self.waits = 0  # acquires that found the ring full (compute held every buffer)

    @property
    def capacity(self) -> int:
        return len(self.buffers)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def acquire(self, stop: threading.Event) -> int:
        with self._cond:
            if not self._free:
                self.waits += 1
            while not self._free:
                if stop.is_set():
                    raise InterruptedError("weight ring wait interrupted by shutdown")
                self._cond.wait(0.1)
            idx = self._free.popleft()
            self.resident += 1
            self.peak = max(self.peak, self.resident)
            return idx

    def consumed(self, idx: int) -> CopyTicket:
        """When the last reader of buffer ``idx`` was done with it (a copy into it waits for this)."""
        return self._consumed[idx]

    def release(self, idx: int, consumed: CopyTicket = DONE) -> None:
        with self._cond:
            self._consumed[idx] = consumed
            self._free.append(idx)
            self.resident -= 1
            self._cond.notify()

    def release_all(self) -> None:
        with self._cond:
            self._free = deque(range(len(self.buffers)))
            self.resident = 0
            self._cond.notify_all()


@dataclass(slots=True)
class Fetched:
    stage: int
    buffer: int
    weights: torch.Tensor  # flat view of the ring buffer, the stage's numel long
    ready: CopyTicket = DONE  # the copy into it (the compute stream waits for it in ``get``)
    base: torch.Tensor | None = None  # a job on a frozen base: the base's stage, flat


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
    bytes_fetched: int = 0
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


@dataclass(kw_only=True)
class StreamContext:
    """What the streaming threads need to know about the connection and the job."""

    ctx: zmq.Context[Any]
    address: str
    curve: ClientKeys | None  # the client's CURVE keys, for every channel the threads open
    timeout_s: float
    wait_timeout_s: float
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
        limit = self.timeout_s if timeout_s is None else timeout_s
        return Channel(self.ctx, self.address, timeout_s=limit, signer=self.signer, curve=self.curve)

    def raise_aborted(self) -> None:
        if self.abort_reason:
            raise self.abort_reason[0]
        raise ServerUnavailable("the worker was shut down")


class Prefetcher:
    """A thread that fetches stages in the order the trainer announces, into the ring."""

    def __init__(
        self, sc: StreamContext, ring: WeightRing, engine: CopyEngine, receive: ReceiveRing | None = None
    ) -> None:
        self._sc = sc
        self._ring = ring
        self._engine = engine  # host -> device copies (NOTE [Copy ordering on a GPU], rule 1)
        self._receive = receive  # data frames land here first when the ring is on a device
        self._orders: queue.SimpleQueue[tuple[int, list[int]] | None] = queue.SimpleQueue()
        self._ready: queue.SimpleQueue[Fetched | BaseException] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats = StreamStats()

    def start(self, step: int, order: list[int]) -> None:
        """Begin fetching ``order`` (stage indices) for ``step``."""
        if self._thread is None or not self._thread.is_alive():
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._run, name="wstream-prefetch", daemon=True)
            self._thread.start()
        self._orders.put((step, order))

    def get(self, stage: int) -> Fetched:
        """The next fetched stage, which must be ``stage`` (the order is the trainer's own)."""
        t0 = time.perf_counter()
        t0_ns = time.monotonic_ns()
        while True:
            try:
                item = self._ready.get(timeout=0.1)
                break
            except queue.Empty:
                if self._sc.abort.is_set():
                    self._sc.raise_aborted()
                if self._thread is None or not self._thread.is_alive():
                    raise ServerUnavailable("the prefetch thread stopped") from None
        self.stats.fetch_wait_s += time.perf_counter() - t0
        tracer = self._sc.tracer
        if tracer is not None and time.monotonic_ns() - t0_ns > TRACE_MIN_WAIT_NS:
            tracer.add(f"wait weights {stage}", "wait", "compute", t0_ns, stage=stage)
        if isinstance(item, BaseException):
            raise item
        if item.stage != stage:
            raise AssertionError(f"prefetch order broken: got stage {item.stage}, wanted {stage} (a bug in wstream)")
        item.ready.wait_stream()
        return item

    def release(self, fetched: Fetched) -> None:
        """Compute is done with ``fetched`` (as far as the host has issued it)."""
        self._ring.release(fetched.buffer, self._engine.mark())

    def reset(self) -> None:
        """Stop the thread, forget queued work and free every buffer (after a failed step)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._thread = None
        while not self._orders.empty():
            self._orders.get_nowait()
        while not self._ready.empty():
            self._ready.get_nowait()
        self._ring.release_all()

    close = reset

    def _run(self) -> None:
        sc = self._sc
        stop = self._stop
        chan = sc.channel()
        try:
            while not stop.is_set():
                try:
                    job = self._orders.get(timeout=0.1)
                except queue.Empty:
                    continue
                if job is None:
                    return
                step, order = job
                self._fetch_order(chan, step, order, stop)
        except InterruptedError:
            return
        except BaseException as exc:  # handed to the consumer, which raises it
            self._ready.put(exc)
        finally:
            chan.close()

    def _fetch_order(self, chan: Channel, step: int, order: list[int], stop: threading.Event) -> None:
        """Fetch ``order`` into the ring, keeping up to a ring's worth of requests in flight.

        Requests run ahead of the copies so that a round trip overlaps the previous copy; the
        replies may arrive out of order (a stage still updating is answered later) and are matched
        by request id. Only the copy needs a ring buffer, so memory stays bounded by the ring.
        """
        sc = self._sc
        ahead = self._ring.capacity
        sent: deque[tuple[int, int]] = deque()  # (request id, stage) in order
        replies: dict[int, tuple[m.Message, list[zmq.Frame]]] = {}
        sent_at: dict[int, tuple[float, int]] = {}  # request id -> (send time, ring waits then)
        sent_ns: dict[int, int] = {}  # request id -> send time, for the timeline
        nxt = 0
        while nxt < len(order) or sent:
            while nxt < len(order) and len(sent) < ahead:
                before = time.monotonic_ns()
                rid = chan.send(m.Fetch(session=sc.session, stage=order[nxt], step=step))
                sent_at[rid] = (time.perf_counter(), self._ring.waits)
                sent_ns[rid] = before
                sent.append((rid, order[nxt]))
                nxt += 1
            rid, stage = sent[0]
            while rid not in replies:
                reply, data = chan.recv(timeout_s=sc.wait_timeout_s, stop=stop)
                replies[reply.id] = (reply, data)
                self._record_latency(reply, sent_at.pop(reply.id, None))
                start = sent_ns.pop(reply.id, None)
                if sc.tracer is not None and start is not None and isinstance(reply, m.Weights):
                    stage_of = reply.stage
                    sc.tracer.add(f"fetch {stage_of}", "fetch", "weight fetches", start, stage=stage_of, step=step)
            sent.popleft()
            reply, data = replies.pop(rid)
            self._ready.put(self._copy_in(stage, raise_or_narrow(reply, m.Weights), data, stop))

    def _record_latency(self, reply: m.Message, sent: tuple[float, int] | None) -> None:
        if sent is None or not isinstance(reply, m.Weights):
            return
        t_sent, waits = sent
        if self._ring.waits != waits:
            self.stats.fetch_latency_skipped += 1
        else:
            self.stats.fetch_latency.record(time.perf_counter() - t_sent)

    def _copy_in(self, stage: int, reply: m.Weights, data: list[zmq.Frame], stop: threading.Event) -> Fetched:
        sc = self._sc
        t0 = time.monotonic_ns()
        idx = self._ring.acquire(stop)
        if sc.tracer is not None and time.monotonic_ns() - t0 > TRACE_MIN_WAIT_NS:
            sc.tracer.add(f"ring full {stage}", "ring", "weight copies", t0, stage=stage)
        t0 = time.monotonic_ns()
        numel = sc.numels[stage]
        base_numel = sc.base_numels[stage] if reply.base_offset is not None else 0
        itemsize = sc.published_dtype.itemsize
        if sc.zero_copy:
            assert sc.published is not None and not data
            view = sc.published[reply.offset : reply.offset + numel * itemsize].view(sc.published_dtype)
            base = None
            if reply.base_offset is not None:
                assert sc.base_published is not None
                end = reply.base_offset + base_numel * itemsize
                base = sc.base_published[reply.base_offset : end].view(sc.published_dtype)
            self.stats.fetches += 1
            return Fetched(stage, idx, view, base=base)
        try:  # the ring buffer holds the stage, then its base's stage (a job on a frozen base)
            buf = self._ring.buffers[idx]
            dst, base_dst = buf[:numel], buf[numel : numel + base_numel]
            after = [self._ring.consumed(idx)]
            own, rest = _split_frames(data, numel * itemsize) if data else ([], [])
            if data and self._receive is not None:  # (the trainer refuses a base here)
                ready = self._receive.load(self._engine, dst, own, after)
            elif data:
                for t in after:
                    t.synchronize()
                copy_frames_into(dst, own)
                if base_numel:
                    copy_frames_into(base_dst, rest)
                ready = DONE
            else:
                assert sc.published is not None
                src = sc.published[reply.offset : reply.offset + numel * itemsize].view(sc.published_dtype)
                ready = self._engine.copy(dst, src, after=after)
                if base_numel:  # the same stream: its ticket comes after the first copy's
                    assert sc.base_published is not None and reply.base_offset is not None
                    base_src = sc.base_published[reply.base_offset : reply.base_offset + base_numel * itemsize]
                    ready = self._engine.copy(base_dst, base_src.view(sc.published_dtype), after=after)
        except BaseException:
            self._ring.release(idx, self._ring.consumed(idx))
            raise
        nbytes = (numel + base_numel) * itemsize
        self.stats.fetches += 1
        nbytes = (numel + base_numel) * itemsize
        self.stats.bytes_fetched += nbytes
        if sc.tracer is not None:  # on a GPU: the time to issue the copy, which runs on its stream
            sc.tracer.add(f"copy {stage}", "copy", "weight copies", t0, stage=stage, bytes=nbytes)
        return Fetched(stage, idx, dst, ready, base_dst if base_numel else None)


def _split_frames(data: list[zmq.Frame], nbytes: int) -> tuple[list[zmq.Frame], list[zmq.Frame]]:
    """The data frames holding the first ``nbytes``, and the rest (tensors start on a frame)."""
    total = 0
    for k, frame in enumerate(data):
        if total == nbytes:
            return data[:k], data[k:]
        total += frames_nbytes([frame])
    return data, []


@dataclass(slots=True)
class _Unsent:
    """A push handed to the sender thread: sent once ``ticket`` (the gradient's copy) is done."""

    message: m.Push
    frames: list[object]
    ticket: CopyTicket


@dataclass(slots=True)
class _Sent:
    slot: int
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
    waits is :class:`ServerUnavailable`, and an error reply is raised there too.

    ``slots`` are host fp32 views: the worker's shared-memory gradient ring, or (``shm=False``) its
    own buffers whose bytes go out as data frames (a slot is busy until its reply, so a buffer is
    never refilled while ZeroMQ may still read it)."""

    def __init__(self, sc: StreamContext, slots: list[torch.Tensor], *, shm: bool, stager: GradientStager) -> None:
        self._sc = sc
        self._slots = slots
        self._shm = shm
        self._stager = stager
        self._cond = threading.Condition()
        self._free = list(range(len(slots)))[::-1]
        self._unsent: deque[_Unsent] = deque()
        self._outstanding: dict[int, _Sent] = {}  # request id -> what was sent
        self._replies = 0  # replies seen: progress, for the wait deadline
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self.stats = StreamStats()
        self._thread = threading.Thread(target=self._run, name="wstream-push", daemon=True)
        self._thread.start()

    # ---- the compute thread ----------------------------------------------------------------------
    def push(self, stage: int, step: int, spec: StageSpec, grads: list[torch.Tensor | None]) -> None:
        """Write the stage's per-parameter gradients into a free slot and have ``push`` sent."""
        slot = self._acquire(stage)
        t0 = time.monotonic_ns()
        numel = spec.numel
        ticket = self._stager.write(self._slots[slot], spec, grads)
        frames: list[object] = [] if self._shm else list(tensor_frames(self._slots[slot][:numel]))
        msg = m.Push(session=self._sc.session, stage=stage, step=step, slot=slot, numel=numel)
        with self._cond:
            self._unsent.append(_Unsent(msg, frames, ticket))
        os.write(self._wake_w, b"x")
        if self._sc.tracer is not None:
            self._sc.tracer.add(f"grad copy {stage}", "push", "compute", t0, stage=stage, step=step)
        self.stats.pushes += 1
        self.stats.bytes_pushed += numel * 4

    def drain(self) -> None:
        """Wait until every push is acknowledged, i.e. the server applied those updates."""
        self._wait_until(lambda: not self._outstanding and not self._unsent, "wait updates")

    def wait_stage(self, stage: int) -> None:
        """Wait until no push of ``stage`` is unacknowledged (its update was applied)."""

        def done() -> bool:
            return all(e.stage != stage for e in self._outstanding.values()) and all(
                u.message.stage != stage for u in self._unsent
            )

        self._wait_until(done, f"wait update {stage}")

    def _acquire(self, stage: int) -> int:
        self._wait_until(lambda: bool(self._free), f"wait grad slot {stage}")
        with self._cond:
            return self._free.pop()

    def _wait_until(self, done: Callable[[], bool], what: str) -> None:
        """Wait (with the lock's condition) until ``done()``; raise what the sender thread met, an
        abort, or :class:`ServerUnavailable` after ``wait_timeout`` without any reply."""
        with self._cond:
            if self._error is None and done():
                return
        t0, t0_ns = time.perf_counter(), time.monotonic_ns()
        limit = self._sc.wait_timeout_s
        with self._cond:
            seen, deadline = self._replies, time.monotonic() + limit
            while True:
                if self._error is not None:
                    raise self._error
                if done():
                    break
                if self._sc.abort.is_set():
                    self._sc.raise_aborted()
                if self._replies != seen:
                    seen, deadline = self._replies, time.monotonic() + limit
                elif time.monotonic() > deadline:
                    self._error = ServerUnavailable(no_answer(self._sc.address, limit, self._sc.curve))
                    raise self._error
                self._cond.wait(0.1)
        self.stats.push_wait_s += time.perf_counter() - t0
        if self._sc.tracer is not None:
            self._sc.tracer.add(what, "wait", "compute", t0_ns)

    def forget_outstanding(self) -> None:
        with self._cond:
            self._outstanding.clear()
            self._unsent.clear()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ---- the sender thread -----------------------------------------------------------------------
    def _run(self) -> None:
        chan = self._sc.channel()
        poller = zmq.Poller()
        poller.register(chan.socket, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                sent = self._send_ready(chan)
                events = dict(poller.poll(0 if sent else 100))
                if self._wake_r in events:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
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
        sent = time.monotonic_ns()
        rid = chan.send(item.message, item.frames, copy=False)
        msg = item.message
        with self._cond:
            if self._unsent and self._unsent[0] is item:  # not forgotten meanwhile
                self._unsent.popleft()
                self._outstanding[rid] = _Sent(msg.slot, msg.stage, msg.step, sent, time.monotonic_ns())
        return True

    def _take_replies(self, chan: Channel) -> None:
        while chan.socket.poll(0, zmq.POLLIN):
            reply, _ = chan.recv(timeout_s=self._sc.wait_timeout_s)
            with self._cond:
                entry = self._outstanding.pop(reply.id, None)
                if entry is None:
                    log.debug("dropping an unexpected reply %s", type(reply).__name__)
                    continue
                self._free.append(entry.slot)
                self._replies += 1
                self._cond.notify_all()
            if self._sc.tracer is not None:  # the send; when the worker saw the reply goes in args
                seen_us = (time.monotonic_ns() - entry.sent_ns) / 1000
                self._sc.tracer.add(
                    f"push {entry.stage}", "push", "gradient pushes", entry.sent_ns, entry.returned_ns,
                    stage=entry.stage, step=entry.step, ack_seen_us=seen_us,
                )
            raise_or_narrow(reply, m.Pushed)


class HeartbeatThread:
    """Keeps the worker's lease alive; on failure records the error and sets ``abort``."""

    def __init__(self, sc: StreamContext, interval_s: float, timeout_s: float | None = None) -> None:
        self._sc = sc
        self._interval = interval_s
        self._timeout_s = sc.timeout_s if timeout_s is None else timeout_s
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
                    log.error("heartbeat failed: %s", exc)
                    sc.abort_reason.append(exc)
                    sc.abort.set()
                    return
        finally:
            chan.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
