"""A stage's gradients into its host gradient slot: the GPU worker's staging buffers and D2H copy
(NOTE [Copy ordering on a GPU] rule 3 in ``device.py``), the CPU worker's write deferred to the
pusher's sender thread, and the squared norm every push carries.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from wstream.protocol import StageSpec
from wstream.protocol.grad_norm import squared_norm, squared_norm_tensor
from wstream.protocol.layout import grad_layout, push_layout

from .device import DONE, CopyEngine, CopyTicket, tensor_nbytes
from .scatter import scatter_grads

if TYPE_CHECKING:
    from .timeline import Tracer


class DeferredWrite:
    """A CPU worker's write of one push into its slot, run once by the first thread that needs it
    (:class:`GradientStager`, ``deferred``): the pusher's sender thread just before it sends the
    push, or the compute thread when too many writes are pending. Its error, if any, is raised to
    every thread that waits for it."""

    __slots__ = ("_lock", "_write", "_sumsq", "_error")

    def __init__(self, write: Callable[[], float]) -> None:
        self._lock = threading.Lock()
        self._write: Callable[[], float] | None = write
        self._sumsq = 0.0
        self._error: BaseException | None = None

    def synchronize(self) -> None:
        with self._lock:
            write, self._write = self._write, None
            if write is not None:
                try:
                    self._sumsq = write()
                except BaseException as exc:
                    self._error = exc
            if self._error is not None:
                raise self._error

    def wait_stream(self) -> None:
        self.synchronize()

    def done(self) -> bool:
        return self._write is None and not self._lock.locked()

    def sumsq(self) -> float:
        self.synchronize()
        return self._sumsq


MAX_DEFERRED_WRITES = 1
"""Pushes whose gradients a CPU worker keeps unwritten at most: the next push writes the oldest
itself if the sender thread has not (the compute thread then waits on it instead of running
ahead), so the deferral keeps at most one stage's gradients alive longer than an inline write
would. One is enough: a write (~0.4 ms per 1 M parameters here) is shorter than the backward of
the stage that follows it."""


class GradientStager:
    """Writes a stage's per-parameter gradients into a host fp32 gradient slot (rule 3 of the NOTE).

    ``staged=False`` (a CPU worker): scattered straight into the slot, one pass, and its norm
    taken; ``deferred`` (the default there) leaves both to the pusher's sender thread, which runs
    them just before it sends the push: beside the next stages' backward, on a core the compute
    thread does not use (the server's, idle until the commit), where inline they cost the
    backward ~0.4 ms per 1 M parameters on its own core (BENCHMARKS.md, session 14).
    ``staged=True`` (the default off the CPU): scattered into one of two device fp32 buffers on the
    compute stream, then one D2H copy of the flat buffer on ``engine``'s stream. The gradient slot
    stays fp32 (the server's protocol): the cast from a bf16 compute dtype is done on the device,
    where it is free, rather than on the server, whose memory bandwidth the optimizer needs."""

    def __init__(
        self, device: torch.device, max_numel: int, engine: CopyEngine, *, staged: bool | None = None,
        deferred: bool | None = None, tracer: Callable[[], Tracer | None] = lambda: None,
    ) -> None:
        self.engine = engine
        staged = device.type != "cpu" if staged is None else staged
        self.deferred = not staged if deferred is None else deferred and not staged
        self._pending: deque[DeferredWrite] = deque()
        self._tracer = tracer
        self.buffers = [torch.empty(max_numel, dtype=torch.float32, device=device) for _ in range(2)] if staged else []
        self._pinned = device.type == "cuda"
        self._last: list[CopyTicket] = [DONE, DONE]
        self._next = 0

    @property
    def nbytes(self) -> int:
        return sum(tensor_nbytes(b) for b in self.buffers)

    def write(self, slot: torch.Tensor, spec: StageSpec, grads: list[torch.Tensor | None]) -> CopyTicket:
        """Start writing ``grads`` into ``slot``'s first ``push_layout(spec).numel`` elements (the
        stage's gradient, in which frozen parameters have none, then its buffers' values); the
        ticket says when it is there."""
        return self.write_measured(slot, spec, grads)[0]

    def write_measured(
        self, slot: torch.Tensor, spec: StageSpec, grads: list[torch.Tensor | None], *, stage: int = -1,
        step: int = -1, borrowed: bool = False, grad_numel: int | None = None,
    ) -> tuple[CopyTicket, Callable[[], float]]:
        """:meth:`write`, and the squared norm of the gradient part, the float a push carries
        (``Push.sumsq``): ``squared_norm`` of the fp32 gradient written (buffers left out; NOTE
        [Gradient norms] in wstream/protocol/grad_norm.py). On a CPU worker it is measured on the slot
        right after the write (deferred with it); staged, on the device buffer on the compute
        stream, its one float copied with the gradient. Call
        the function once the ticket is done. ``borrowed``: the caller reuses ``grads``' memory
        once this returns (a CPU worker then writes them at once, not deferred); ``stage`` and
        ``step`` name the write in a timeline. ``grad_numel``: how many leading elements are the
        gradient, for a push already flat (``flat_spec``, whose layout cannot tell its buffers)."""
        numel = push_layout(spec).numel
        grad_numel = grad_layout(spec).numel if grad_numel is None else grad_numel
        if not self.buffers:
            if borrowed or not self.deferred:
                sumsq = _write_and_measure(slot[:numel], spec, grads, grad_numel)
                return DONE, lambda: sumsq
            return self._defer(slot[:numel], spec, grads, grad_numel, stage, step)
        k = self._next
        self._next = 1 - k
        self._last[k].wait_stream()  # the compute stream waits until its last D2H has read it
        buf = self.buffers[k][:numel]
        scatter_grads(buf, spec, grads)
        norm = squared_norm_tensor(buf[:grad_numel])  # on the compute stream, before the mark
        host = torch.empty((), dtype=torch.float64, pin_memory=self._pinned)  # one per push: read later
        after = [self.engine.mark()]
        self._last[k] = self.engine.copy(slot[:numel], buf, after=after)
        ticket = self.engine.copy(host, norm, after=after)  # the same stream, after the gradient
        kept = (host, norm)  # ``norm`` lives until the copy stream has read it (the ticket)
        return ticket, lambda: float(kept[0])

    def _defer(
        self, dst: torch.Tensor, spec: StageSpec, grads: list[torch.Tensor | None], grad_numel: int, stage: int, step: int
    ) -> tuple[CopyTicket, Callable[[], float]]:
        pending = self._pending
        while pending and pending[0].done():
            pending.popleft()
        if len(pending) >= MAX_DEFERRED_WRITES:
            pending.popleft().synchronize()  # waits for the sender thread, or writes it here
        tracer = self._tracer()
        compute = threading.current_thread()

        def write() -> float:
            t0 = time.monotonic_ns()
            sumsq = _write_and_measure(dst, spec, grads, grad_numel)
            if tracer is not None:
                lane = "compute" if threading.current_thread() is compute else "gradient pushes"
                tracer.add(f"grad copy {stage}", "push", lane, t0, stage=stage, step=step)
            return sumsq

        ticket = DeferredWrite(write)
        pending.append(ticket)
        return ticket, ticket.sumsq


def _write_and_measure(dst: torch.Tensor, spec: StageSpec, grads: list[torch.Tensor | None], grad_numel: int) -> float:
    """A CPU worker's write of a push into ``dst`` and the squared norm of its gradient part."""
    scatter_grads(dst, spec, grads)
    return squared_norm(dst[:grad_numel])
