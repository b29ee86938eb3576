"""The weight side of streaming: the device weight ring and the prefetch thread that fills it.

# NOTE [Residency bound]
# 1. The ring preallocates ``prefetch + 1`` flat buffers, each the size of the largest stage, on
#    the compute device; nothing else on the worker holds stage weights.
# 2. A buffer is *resident* from the prefetcher's ``acquire`` until the trainer's ``release``, so
#    at most ``prefetch + 1`` stages' weights exist at once (``WeightRing.peak`` proves it).
# 3. The prefetcher walks the step's fetch order and blocks when the ring is full, which is what
#    keeps it no more than ``prefetch`` stages ahead of compute.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch
import zmq

from wstream.protocol import ServerUnavailable
from wstream.protocol import messages as m
from wstream.protocol.frames import copy_frames_into, frames_nbytes

from .channel import Channel, raise_or_narrow
from .device import DONE, CopyEngine, CopyTicket, ReceiveRing
from .streaming import TRACE_MIN_WAIT_NS, StreamContext, StreamStats
from .threads import serial_thread
from .waiting import WaitWatch, recv_watched


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

    def release_all(self, consumed: CopyTicket = DONE) -> None:
        """Every buffer free again (a step aborted): ``consumed`` marks the compute stream's work
        so far, which the next copy into any of them waits for (kernels of the aborted step may
        still read them; the old marks are older than those kernels)."""
        with self._cond:
            self._consumed = [consumed] * len(self.buffers)
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
            self._thread = serial_thread(self._run, "wstream-prefetch")
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
                    try:  # what it handed over just before it ended (its error, most likely)
                        item = self._ready.get_nowait()
                        break
                    except queue.Empty:
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
        self._ring.release_all(self._engine.mark())

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
        watch = WaitWatch(sc.endpoint, f"for the weights of step {step} (the updates of the step before)")
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
                reply, data = recv_watched(chan, watch, stop)
                watch.progress()
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
            self.stats.bytes_read_in_place += (numel + base_numel) * itemsize
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
