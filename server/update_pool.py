"""The optimizer pool: stage updates run on its threads and come back to the loop thread through a
:class:`~wstream.server.mailbox.Mailbox`, which is the only way they touch the loop's state."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from .job import PoolTask
from .pool_tasks import PARKED, Parked
from .mailbox import Mailbox

Completion = tuple[PoolTask, BaseException | None]
"""A finished task and its error (None when it succeeded)."""


class UpdatePool:
    """``submit`` on the loop thread; the task's ``run`` on a pool thread; the finished task is
    :meth:`drain`-ed back on the loop thread."""

    def __init__(self, workers: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="wstream-opt")
        self.done: Mailbox[Completion] = Mailbox()

    def submit(self, task: PoolTask) -> None:
        fut = self._pool.submit(task.run)
        fut.add_done_callback(lambda f, t=task: self._finished(t, f))

    def _finished(self, task: PoolTask, fut: Future[PoolTask | Parked]) -> None:
        if not fut.cancelled() and fut.exception() is None and fut.result() is PARKED:
            return  # not done: it is submitted again when it can go on (NOTE [Consistent snapshots] rule 3)
        self.done.post((task, None if fut.cancelled() else fut.exception()))

    def fileno(self) -> int:
        return self.done.fileno()

    def drain(self) -> list[Completion]:
        return self.done.drain()

    def shutdown(self) -> None:
        """Cancel the queued updates and wait for the running ones (their completions are dropped)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
