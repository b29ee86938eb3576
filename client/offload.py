"""Asynchronous moves of stage inputs between the worker's device and host memory.

The ``offload`` plan stores some stage inputs to host memory during the forward sweep and brings
them back ahead of the backward sweep. Those copies must not sit on the compute path, or the plan
loses what it set out to win (after Kukreja, Hueckelheim and Gorman 2018: copy as often as the
transfer keeps up, never making compute wait).

# NOTE [Ordering of offload copies]
# 1. A copy starts when the plan says OFFLOAD/PREFETCH and returns at once with a ``PendingMove``.
# 2. The source of a copy stays referenced by the move until it completes, so the executor may
#    drop its own reference at once (the plan's next ADVANCE replaces the current input).
# 3. Copies run in issue order on one queue (one CUDA stream, or one thread on a CPU worker), so
#    a PREFETCH of an input always reads a finished OFFLOAD of it.
# 4. A consumer waits with ``result()``: on CUDA that makes the compute stream wait for the copy
#    (the host does not block) and marks the device tensors as used by the compute stream; on CPU
#    it joins the copy thread's future.
# 5. At most one OFFLOAD is in flight: ``to_host`` waits for the one before it (the plan's budget
#    counts one source still copying). When copies keep up this costs nothing; when they fall
#    behind compute, compute waits instead of every offloaded input staying alive on the device.
# 6. A copy keeps each tensor's layout (strides), and moves only the tensors on the worker's
#    device: a CPU tensor in a GPU worker's boundary (``lengths`` for ``pack_padded_sequence``)
#    is host memory already, and comes back where it was.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Protocol

import torch

Boundary = tuple[Any, ...]


class PendingMove(Protocol):
    nbytes: int
    moved: tuple[bool, ...]
    """Which entries of the boundary this move copied (NOTE rule 6)."""

    def result(self) -> Boundary:
        """The copied boundary, once it is safe to use on the consumer's side."""
        ...


class _ThreadMove:
    __slots__ = ("_future", "nbytes", "moved")

    def __init__(self, future: concurrent.futures.Future[Boundary], nbytes: int, moved: tuple[bool, ...]) -> None:
        self._future = future
        self.nbytes = nbytes
        self.moved = moved

    def result(self) -> Boundary:
        return self._future.result()


class _CudaMove:
    __slots__ = ("_value", "_event", "_to_device", "_device", "nbytes", "moved")

    def __init__(
        self, value: Boundary, event: torch.cuda.Event, to_device: bool, nbytes: int, device: torch.device,
        moved: tuple[bool, ...],
    ) -> None:
        self.moved = moved
        self._value = value
        self._event = event
        self._to_device = to_device
        self._device = device  # the worker's device: its current stream is the compute stream
        self.nbytes = nbytes

    def result(self) -> Boundary:
        if self._to_device:  # the compute stream waits; the host goes on
            stream = torch.cuda.current_stream(self._device)  # not the current device's: it may be another
            stream.wait_event(self._event)
            for t, moved in zip(self._value, self.moved):
                if moved:
                    t.record_stream(stream)
        else:  # host memory is read by the CPU (or a later copy on the same stream)
            self._event.synchronize()
        return self._value


def _nbytes(b: Boundary, moved: tuple[bool, ...]) -> int:
    return sum(t.numel() * t.element_size() for t, m in zip(b, moved) if m)


class HostMover:
    """Copies boundaries device -> host and back off the compute path (see the NOTE above).

    On CUDA the copies run on a dedicated stream into pinned host memory; on a CPU worker, where
    "host" and "device" are the same memory, on one background thread (so the copy overlaps the
    next stages' compute, as a DMA engine would)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._last_offload: PendingMove | None = None  # rule 5
        self._stream: torch.cuda.Stream | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
        else:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="wstream-offload")

    def to_host(self, b: Boundary) -> PendingMove:
        if self._last_offload is not None:  # rule 5
            self._last_offload.result()
        # rule 6: a GPU worker copies what is on its GPU; a CPU worker every tensor
        on_device = [isinstance(t, torch.Tensor) and (self._stream is None or t.device.type == "cuda") for t in b]
        self._last_offload = move = self._move(b, torch.device("cpu"), tuple(on_device))
        return move

    def to_device(self, pending_host: PendingMove) -> PendingMove:
        """Copy back a boundary that ``to_host`` sent (waits for that copy first, in queue order)."""
        moved = pending_host.moved
        if self._stream is not None:
            return self._move(pending_host.result(), self.device, moved)
        assert self._pool is not None
        future = self._pool.submit(lambda: _copy(pending_host.result(), self.device, moved))
        return _ThreadMove(future, pending_host.nbytes, moved)

    def _move(self, b: Boundary, device: torch.device, moved: tuple[bool, ...]) -> PendingMove:
        """Copy the ``moved`` entries of ``b`` to ``device`` (the others pass through)."""
        nbytes = _nbytes(b, moved)
        if self._stream is None:
            assert self._pool is not None
            return _ThreadMove(self._pool.submit(_copy, b, device, moved), nbytes, moved)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the source is computed
        pinned = device.type == "cpu"
        out: list[Any] = []
        with torch.cuda.stream(stream):
            for t, move in zip(b, moved):
                if not move:  # rule 6
                    out.append(t)
                    continue
                dst = torch.empty_like(t, device=device, pin_memory=pinned)  # rule 6: the same strides
                dst.copy_(t, non_blocking=True)
                if t.device.type == "cuda":
                    t.record_stream(stream)  # rule 2: the source outlives the copy
                out.append(dst)
            event = torch.cuda.Event()
            event.record(stream)
        return _CudaMove(tuple(out), event, to_device=not pinned, nbytes=nbytes, device=self.device, moved=moved)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def _copy(b: Boundary, device: torch.device, moved: tuple[bool, ...]) -> Boundary:
    return tuple(torch.empty_like(t, device=device).copy_(t) if m else t for t, m in zip(b, moved))
