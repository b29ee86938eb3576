"""The optimizer pool's tasks on a stage (:class:`~wstream.server.stage_state.StageState`), run off
the loop thread: a gather of workers' gradients into its accumulator, the norm of a sum no gather
measured, and the update of a committed step (NOTE [The step commit point] and [Held gradient
slots] in step_commit.py say when each runs; NOTE [Buffers] in stage_state.py what happens to a
stage's buffers).
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, Union

import torch

from wstream.protocol.grad_norm import accumulate, accumulate_with_norm, squared_norm
from wstream.protocol.layout import publish_master

from .native import sum_with_norm as native_sum_with_norm
from .snapshot import Snapshot
from .stage_state import StageState


class UpdatedJob(Protocol):
    """What the pool's tasks need of their job (``wstream.server.job.Job``)."""

    name: str
    snapshot: Snapshot | None

    @property
    def attempt(self) -> int: ...


@dataclass(slots=True)
class GatherTask:
    """Add workers' gradients (their slots) into the stage's accumulator, off the loop thread, in one
    pass over memory: the first gradients of an attempt are summed into it (read 8 bytes and
    write 4 per parameter, where copying the first and adding the second took 20), and the task
    that brings the ``expected``-th gradient of its attempt also computes the squared norm of the
    sum as it writes it, unless it is a lone worker's, which came with its norm. The server's
    native kernel does both where it is built (streamed stores, the norm in float64: NOTE [Native
    kernels] in wstream/server/native.py), except the norm of a lone worker's gradient, which is
    ``squared_norm``'s as the worker's own would be (NOTE [Gradient norms] in
    wstream/protocol/grad_norm.py)."""

    job: UpdatedJob
    stage: StageState
    workers: tuple[int, ...]
    sources: tuple[torch.Tensor, ...]
    """Each worker's slot (its push-layout elements), in ``workers`` order."""
    attempt: int
    expected: int
    sumsq: float | None = None
    """The worker's squared norm of its gradient (``Push.sumsq``): the stage's when it is the only
    gradient expected, so that no pass over the sum is needed."""
    norms: tuple[float | None, ...] = ()
    """Each source's own squared norm as its push said it (None: not said), in ``sources`` order:
    the key of the order they are summed in (:func:`in_value_order`)."""
    seconds: float = 0.0
    submitted_ns: int = field(default_factory=time.monotonic_ns)
    started_ns: int = 0
    thread: str = ""

    def run(self) -> GatherTask:
        self.started_ns = time.monotonic_ns()
        self.thread = threading.current_thread().name
        t0 = time.perf_counter()
        st = self.stage
        assert st.grad is not None
        with st.grad_lock:
            if self.attempt == self.job.attempt:  # else: a discarded attempt's, nothing to add
                attempt, count = st.acc
                if attempt != self.attempt:
                    count = 0
                sources = self.sources
                if len(sources) + (count > 0) >= 3:  # a + b is b + a, in fp32 too; three terms are not
                    sources = in_value_order(sources, self.norms)
                total = count + len(sources)
                last = total == self.expected
                several = total > 1  # the norm of a sum of several workers' gradients: the native kernel's (NOTE [Native kernels] rule 3)
                if last and not (total == 1 and self.sumsq is not None):
                    # the sum and its norm in one pass (NOTE [Gradient norms])
                    norm = native_sum_with_norm(st.grad, sources, first=count == 0, norm_numel=st.grad_numel) if several else None
                    if norm is None:
                        norm = accumulate_with_norm(st.grad, sources, first=count == 0, norm_numel=st.grad_numel)
                else:  # no norm to take: a streamed copy or sum (NOTE [Native kernels] rule 1)
                    norm = self.sumsq
                    if native_sum_with_norm(st.grad, sources, first=count == 0, norm_numel=0) is None:
                        accumulate(st.grad, sources, first=count == 0)
                st.acc = (self.attempt, total)
                if last:
                    assert norm is not None
                    st.sumsq = (self.attempt, total, norm)
        self.seconds = time.perf_counter() - t0
        return self


def in_value_order(sources: Sequence[torch.Tensor], norms: Sequence[float | None] = ()) -> tuple[torch.Tensor, ...]:
    """``sources`` in the order a sum of them is taken in (NOTE [Held gradient slots] rule 4): by
    their squared norms (a push's own, else measured here), then by their first differing element;
    equal ones in any order (it makes no difference). An fp32 sum of three or more terms depends on
    their order: summed as they arrived, two runs on the same data differed in the last bit, and a
    run in which a worker was restarted was not the run without it. In this order the sum is a
    function of the gradients alone. A non-finite norm sorts last (its step is skipped anyway)."""
    keyed = []
    for k, source in enumerate(sources):
        norm = norms[k] if k < len(norms) else None
        keyed.append((squared_norm(source) if norm is None else norm, source))

    def compare(x: tuple[float, torch.Tensor], y: tuple[float, torch.Tensor]) -> int:
        (nx, tx), (ny, ty) = x, y
        if nx != ny:
            return _order(nx, ny)
        if torch.equal(tx, ty):  # (workers on the same data) either order sums the same
            return 0
        differ = torch.ne(tx, ty)  # equal norms of different gradients: rare, and a pass to find where
        if not bool(differ.any()):  # NaN where the other is NaN, and equal elsewhere
            return 0
        at = int(differ.nonzero()[0])
        return _order(float(tx[at]), float(ty[at]))

    return tuple(source for _, source in sorted(keyed, key=functools.cmp_to_key(compare)))


def _order(a: float, b: float) -> int:
    """-1, 0 or 1 as ``a`` sorts before, with or after ``b``: numbers ascending, NaN last."""
    ka, kb = (math.isnan(a), 0.0 if math.isnan(a) else a), (math.isnan(b), 0.0 if math.isnan(b) else b)
    return (ka > kb) - (ka < kb)


@dataclass(slots=True)
class NormTask:
    """The squared norm of a stage whose last expected gradient came without a task knowing it
    was the last (a worker that had pushed nothing left the step)."""

    job: UpdatedJob
    stage: StageState
    attempt: int
    seconds: float = 0.0

    def run(self) -> NormTask:
        t0 = time.perf_counter()
        st = self.stage
        assert st.grad is not None
        with st.grad_lock:
            attempt, count = st.acc
            if attempt == self.attempt == self.job.attempt:
                st.sumsq = (attempt, count, squared_norm(st.gradient))
        self.seconds = time.perf_counter() - t0
        return self


class Parked:
    """What a parked update's run returns (:meth:`UpdateTask.run`)."""


PARKED = Parked()


@dataclass(slots=True)
class UpdateTask:
    """One stage's update of a committed step, run off the loop thread: the optimizer on the
    accumulated gradient (divided by ``grad_scale``: the number of workers over the clipping
    factor) at learning rate ``lr``, the buffers set to the ``workers``' mean, then publication of
    the new weights into the next version's slot when it is not the master (the native AdamW
    writes the trained parameters there as it updates them; the rest is copied). ``apply`` False
    (a skipped step, or a stage with nothing to train) only publishes, so the version can move
    on."""

    job: UpdatedJob
    stage: StageState
    grad_scale: float = 1.0
    lr: float | None = None
    apply: bool = True
    workers: int = 1
    source: torch.Tensor | None = None
    """The step's gradient (then the buffers) when it is read in place from a held slot; None:
    the stage's accumulator ``grad``."""
    resubmit: Callable[[UpdateTask], None] | None = None
    """How a parked update goes back to the pool (the loop's ``submit``; NOTE [Consistent
    snapshots] rule 3 in snapshot.py): None, an update that cannot be parked."""
    seconds: float = 0.0
    submitted_ns: int = field(default_factory=time.monotonic_ns)
    started_ns: int = 0
    thread: str = ""

    def _resume(self) -> None:
        assert self.resubmit is not None, "an update without resubmit was parked (a bug in wstream)"
        try:
            self.resubmit(self)
        except RuntimeError:  # the pool has shut down (the server is stopping): dropped as a queued update is
            pass

    def run(self) -> UpdateTask | Parked:
        """The update, or :data:`PARKED` when it must wait for room in a snapshot's buffer: the
        pool thread goes on to other tasks, and this one is submitted again (a run's result says
        so, not the task: the second run may start before the first run's result is read)."""
        self.started_ns = time.monotonic_ns()  # (a resumed run sets them again)
        self.thread = threading.current_thread().name
        t0 = time.perf_counter()
        st = self.stage
        snap = self.job.snapshot
        if snap is not None and snap.step == st.version:  # NOTE [Consistent snapshots], rules 2 and 3
            nbytes = st.state_nbytes + (st.slots[0].nbytes if snap.previous else 0)  # (rule 5: the version before too)
            if not snap.capture_before_update(st.index, st.lock, st.capture, nbytes, self._resume):
                return PARKED
        with st.lock:
            target = st.slots[st.slot_for(st.version + 1)]
            publish = None if target is st.master else target
            published = False  # whether the optimizer wrote the trained parameters into ``target``
            if self.apply and st.grad is not None:
                grad = st.grad if self.source is None else self.source
                published = st.optimizer.step(
                    grad[: st.grad_numel], grad_scale=None if self.grad_scale == 1.0 else self.grad_scale, lr=self.lr, publish=publish
                )
                for master_at, at, n, counts in st.buffers:  # the workers' mean (the sum divided: exact for W = 1)
                    buffer = st.master[master_at : master_at + n]
                    if counts:
                        buffer.add_(grad[at : at + n] / self.workers)
                    else:
                        torch.div(grad[at : at + n], self.workers, out=buffer)
            if publish is not None:  # where the optimizer wrote the trained parameters, the rest: frozen ones, buffers, gaps
                publish_master(publish, st.master, st.exact_ints, st.optimizer.untrained if published else None)
        self.seconds = time.perf_counter() - t0
        return self


PoolTask = Union[UpdateTask, GatherTask, NormTask]
"""What the loop hands the optimizer pool."""
