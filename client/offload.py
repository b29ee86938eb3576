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
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Protocol

import torch

Boundary = tuple[Any, ...]


class PendingMove(Protocol):
    nbytes: int

    def result(self) -> Boundary:
        """The copied boundary, once it is safe to use on the consumer's side."""
        ...


class _ThreadMove:
    __slots__ = ("_future", "nbytes")

    def __init__(self, future: concurrent.futures.Future[Boundary], nbytes: int) -> None:
        self._future = future
        self.nbytes = nbytes

    def result(self) -> Boundary:
        return self._future.result()


class _CudaMove:
    __slots__ = ("_value", "_event", "_to_device", "_device", "nbytes")

    def __init__(
        self, value: Boundary, event: torch.cuda.Event, to_device: bool, nbytes: int, device: torch.device
    ) -> None:
        self._value = value
        self._event = event
        self._to_device = to_device
        self._device = device  # the worker's device: its current stream is the compute stream
        self.nbytes = nbytes

    def result(self) -> Boundary:
        if self._to_device:  # the compute stream waits; the host goes on
            stream = torch.cuda.current_stream(self._device)  # not the current device's: it may be another
            stream.wait_event(self._event)
            for t in self._value:
                if isinstance(t, torch.Tensor):
                    t.record_stream(stream)
        else:  # host memory is read by the CPU (or a later copy on the same stream)
            self._event.synchronize()
        return self._value


def _nbytes(b: Boundary) -> int:
    return sum(t.numel() * t.element_size() for t in b if isinstance(t, torch.Tensor))


class HostMover:
    """Copies boundaries device -> host and back off the compute path (see the NOTE above).

    On CUDA the copies run on a dedicated stream into pinned host memory; on a CPU worker, where
    "host" and "device" are the same memory, on one background thread (so the copy overlaps the
    next stages' compute, as a DMA engine would)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: torch.cuda.Stream | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
        else:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="wstream-offload")

    def to_host(self, b: Boundary) -> PendingMove:
        return self._move(b, torch.device("cpu"))

    def to_device(self, pending_host: PendingMove) -> PendingMove:
        """Copy back a boundary that ``to_host`` sent (waits for that copy first, in queue order)."""
        if self._stream is not None:
            return self._move(pending_host.result(), self.device)
        assert self._pool is not None
        future = self._pool.submit(lambda: _copy(pending_host.result(), self.device))
        return _ThreadMove(future, pending_host.nbytes)

    def _move(self, b: Boundary, device: torch.device) -> PendingMove:
        nbytes = _nbytes(b)
        if self._stream is None:
            assert self._pool is not None
            return _ThreadMove(self._pool.submit(_copy, b, device), nbytes)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the source is computed
        pinned = device.type == "cpu"
        out: list[Any] = []
        with torch.cuda.stream(stream):
            for t in b:
                if not isinstance(t, torch.Tensor):
                    out.append(t)
                    continue
                dst = torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pinned)
                dst.copy_(t, non_blocking=True)
                if t.device.type == "cuda":
                    t.record_stream(stream)  # rule 2: the source outlives the copy
                out.append(dst)
            event = torch.cuda.Event()
            event.record(stream)
        return _CudaMove(tuple(out), event, to_device=not pinned, nbytes=nbytes, device=self.device)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def _copy(b: Boundary, device: torch.device) -> Boundary:
    return tuple(
        torch.empty(t.shape, dtype=t.dtype, device=device).copy_(t) if isinstance(t, torch.Tensor) else t for t in b
    )
