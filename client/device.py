"""The worker's host <-> device data path: page-locked registration of shared memory, copy engines,
the weight ring's size from a budget and the receive ring of remote workers (the gradients' way
back is ``gradient_write.py``).

On a CPU worker every class here still exists and runs the same calls, with a plain ``copy_`` standing
in for the DMA copy and tickets that are complete at once: the CPU suite runs the same logic the GPU
path runs (``tests/test_device.py``); ``@pytest.mark.cuda`` tests cover the streams and events.

# NOTE [Copy ordering on a GPU]
# 1. Weights: the prefetch thread copies a stage host -> device on the H2D engine's stream into a
#    ring buffer and records a *ready* event; the compute stream waits on it (``Prefetcher.get``).
#    The host never blocks on a copy.
# 2. A ring buffer is written again only after the compute stream is done with it: ``release``
#    records a *consumed* event on the compute stream, and the next copy into that buffer makes the
#    copy stream wait on it. Ring buffers, staging buffers and registered host memory live as long
#    as the trainer's connection, so no ``record_stream`` is needed (nothing is freed while in use).
# 3. Gradients: the compute stream scatters a stage's parameter gradients into a device staging
#    buffer in fp32 (the cast from the compute dtype happens there, on the device), the D2H
#    engine's stream waits for that and copies the flat buffer into the (registered) gradient slot;
#    the pusher thread sends ``push`` only once that copy's event has completed. A staging buffer
#    is scattered into again only after its last D2H copy finished (the compute stream waits on it).
# 4. Data frames (remote workers) are copied by the CPU into a receive buffer (page-locked), then
#    host -> device as in 1; a receive buffer is refilled only after its H2D copy completed (the
#    prefetch thread waits on that event, the compute stream does not).
# 5. Registered host memory is unregistered after the device is synchronized and before the mapping
#    goes away: :class:`HostRegistration` holds the mapping until it has unregistered it.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence
from typing import Protocol

import torch

from wstream.protocol.frames import copy_frames_into
from wstream.protocol.units import format_bytes


log = logging.getLogger(__name__)

CUDA_HOST_REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable``: the pages count as pinned in every CUDA context of the process."""


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class HostRegistrationError(RuntimeError):
    """``cudaHostRegister`` refused a mapping (limits on locked memory, or it is registered already)."""


class HostRegistration:
    """Page-locks an existing host mapping for DMA with ``cudaHostRegister``, once.

    ``torch`` cannot both share and pin a tensor, and its caching pinned allocator rounds blocks up
    to powers of two, so long-lived shared-memory mappings are registered in place instead. The
    registration keeps a reference to the tensor that owns the mapping, so the mapping cannot be
    unmapped while it is registered (a stale registration makes the next one at that address fail);
    :meth:`unregister` is idempotent and also runs when the object is collected. On a CPU device
    nothing is registered and the object records 0 bytes in 0 s, so callers need no branch.
    """

    def __init__(self, mapping: torch.Tensor, device: torch.device, *, what: str) -> None:
        self.what = what
        self.nbytes = 0
        self.seconds = 0.0
        self._finalizer: weakref.finalize | None = None
        if device.type != "cuda" or mapping.numel() == 0:
            log.debug("%s: registered 0 bytes in 0 s (%s device)", what, device.type)
            return
        ptr, size = mapping.data_ptr(), tensor_nbytes(mapping)
        t0 = time.perf_counter()
        with torch.cuda.device(device):
            code = int(torch.cuda.cudart().cudaHostRegister(ptr, size, CUDA_HOST_REGISTER_PORTABLE))
        if code != 0:
            raise HostRegistrationError(
                f"cudaHostRegister of {what} ({format_bytes(size)}) failed: {torch.cuda.CudaError(code)} (error "
                f"{code}); check the locked-memory limit (ulimit -l, systemd LimitMEMLOCK) of the worker"
            )
        self.seconds = time.perf_counter() - t0
        self.nbytes = size
        self._finalizer = weakref.finalize(self, _unregister, device, ptr, mapping, what)
        log.info(
            "%s: registered %s in %.3f s (%.2f GB/s of pages)",
            what, format_bytes(size), self.seconds, size / max(self.seconds, 1e-9) / 1e9,
        )

    @property
    def registered(self) -> bool:
        return self._finalizer is not None and self._finalizer.alive

    def unregister(self) -> None:
        """Unregister (once); the caller has made sure no copy still reads or writes the pages."""
        if self._finalizer is not None:
            self._finalizer()


def _unregister(device: torch.device, ptr: int, mapping: torch.Tensor, what: str) -> None:
    """Unregister ``ptr``; ``mapping`` is passed only to keep the mapping alive until now. The
    device is synchronized first: when a trainer is collected without ``close()`` a copy may still
    be reading the pages (after ``close()`` this finds the device idle)."""
    try:
        with torch.cuda.device(device):
            torch.cuda.synchronize(device)
            code = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    except Exception as exc:  # at interpreter exit CUDA may be torn down already; the pages go with it
        log.debug("cudaHostUnregister of %s skipped: %s", what, exc)
        return
    if code != 0:
        log.warning("cudaHostUnregister of %s failed: error %d", what, code)
    del mapping


# ---- copy engines -----------------------------------------------------------------------------


class CopyTicket(Protocol):
    """A copy (or a point in a stream) that others can wait for."""

    def wait_stream(self) -> None:
        """Make the calling thread's current stream wait for it (the host does not block)."""
        ...

    def synchronize(self) -> None:
        """Block the calling thread until it has happened."""
        ...

    def done(self) -> bool: ...


class _Done:
    """A ticket that is complete: every copy on a CPU worker."""

    __slots__ = ()

    def wait_stream(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def done(self) -> bool:
        return True


DONE: CopyTicket = _Done()


class _EventTicket:
    __slots__ = ("_event", "_device")

    def __init__(self, event: torch.cuda.Event, device: torch.device) -> None:
        self._event = event
        self._device = device

    def wait_stream(self) -> None:
        torch.cuda.current_stream(self._device).wait_event(self._event)

    def synchronize(self) -> None:  # the device's context: a sender thread must not make one on GPU 0
        with torch.cuda.device(self._device):
            self._event.synchronize()

    def done(self) -> bool:
        with torch.cuda.device(self._device):
            return bool(self._event.query())


class CopyEngine:
    """Copies between host and device memory off the compute path (NOTE [Copy ordering on a GPU]).

    This base class is the CPU stand-in: a synchronous ``copy_`` on the calling thread, complete
    when it returns. :class:`CudaCopyEngine` issues the same copies on a dedicated stream."""

    def __init__(self, device: torch.device, name: str = "copy") -> None:
        self.device = device
        self.name = name
        self.copies = 0
        self.bytes = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, after: Sequence[CopyTicket] = ()) -> CopyTicket:
        """Copy ``src`` into ``dst`` once every ticket in ``after`` has happened."""
        for t in after:
            t.synchronize()
        dst.copy_(src)
        self._count(dst)
        return DONE

    def mark(self) -> CopyTicket:
        """A ticket for everything issued so far on the calling thread's current stream."""
        return DONE

    def synchronize(self) -> None:
        """Wait for every copy issued so far."""

    def _count(self, dst: torch.Tensor) -> None:
        self.copies += 1
        self.bytes += tensor_nbytes(dst)


class CudaCopyEngine(CopyEngine):
    """Copies on a dedicated CUDA stream; each copy returns a ticket on an event recorded after it."""

    def __init__(self, device: torch.device, name: str = "copy") -> None:
        super().__init__(device, name)
        self.stream = torch.cuda.Stream(device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, after: Sequence[CopyTicket] = ()) -> CopyTicket:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            for t in after:
                t.wait_stream()  # the current stream is ours here
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._count(dst)
        return _EventTicket(event, self.device)

    def mark(self) -> CopyTicket:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return _EventTicket(event, self.device)

    def synchronize(self) -> None:
        self.stream.synchronize()


def copy_engine(device: torch.device, name: str) -> CopyEngine:
    """The engine for ``device``: a CUDA stream of its own, or the synchronous CPU stand-in."""
    return CudaCopyEngine(device, name) if device.type == "cuda" else CopyEngine(device, name)


def synchronize(device: torch.device) -> None:
    """Wait for all work on ``device`` (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- the weight ring's size ---------------------------------------------------------------------

MIN_RING = 2
"""A stage computing and the next one arriving: fewer buffers serialize copy and compute."""


def ring_capacity(budget: int, max_stage_bytes: int, stages: int) -> int:
    """Weight-ring buffers a budget of ``budget`` device bytes holds: floor(budget / largest stage),
    at most one per stage (more would only hold copies of stages already resident), at least
    :data:`MIN_RING`; a budget that cannot hold two of the largest stage is refused, naming both."""
    if budget < 0:
        raise ValueError(f"weight_budget must be >= 0, got {budget}")
    fits = budget // max(max_stage_bytes, 1)
    if fits < MIN_RING:
        raise ValueError(
            f"weight_budget {format_bytes(budget)} ({budget} bytes) holds {fits} of the largest weight stage "
            f"({format_bytes(max_stage_bytes)}, {max_stage_bytes} bytes in the compute dtype; a transfer unit of "
            f"several chain stages where the job has them); the weight ring needs at least {MIN_RING}: give "
            f"weight_budget >= {MIN_RING * max_stage_bytes} bytes, or create the job with a smaller unit_bytes"
        )
    return max(MIN_RING, min(fits, stages))


# ---- remote workers: the receive ring -------------------------------------------------------------


class ReceiveRing:
    """Host buffers that data frames land in before their copy to the device (rule 4 of the NOTE).

    Frames are ZeroMQ's own pageable memory; a DMA copy needs page-locked memory, so the prefetch
    thread copies each stage's frames into one of these (registered on CUDA, plain on a CPU) and
    the H2D copy reads from there. Used by one thread (the prefetcher's)."""

    def __init__(self, capacity: int, nbytes: int, device: torch.device) -> None:
        self.buffers = [torch.empty(max(nbytes, 1), dtype=torch.uint8) for _ in range(capacity)]
        self.registrations = [HostRegistration(b, device, what=f"receive buffer {k}") for k, b in enumerate(self.buffers)]
        self._pending: list[CopyTicket] = [DONE] * capacity
        self._next = 0

    def load(self, engine: CopyEngine, dst: torch.Tensor, frames: Sequence[object], after: Sequence[CopyTicket]) -> CopyTicket:
        """Copy ``frames`` into ``dst`` (a device tensor) through the next receive buffer."""
        k = self._next
        self._next = (k + 1) % len(self.buffers)
        self._pending[k].synchronize()  # its previous H2D copy has read it
        host = self.buffers[k][: tensor_nbytes(dst)].view(dst.dtype)
        copy_frames_into(host, frames)
        ticket = engine.copy(dst, host, after=after)
        self._pending[k] = ticket
        return ticket

    def close(self) -> None:
        for t in self._pending:
            t.synchronize()
        for r in self.registrations:
            r.unregister()


def host_staging(device: torch.device) -> bool:
    """Whether weights from data frames and gradients pass through staging buffers: off the CPU
    (DMA needs page-locked memory and one flat copy), not on it (the ring and the slot are host
    memory already). The CPU suite turns it on to run the GPU path's logic."""
    return device.type != "cpu"
