"""A queue that other threads post to and the loop thread drains, with a pipe the loop polls next to
its sockets so that a post wakes it at once.

The optimizer pool reports finished updates through one, the snapshot writer its finished
snapshots through another; :meth:`Mailbox.wake` alone also serves to wake the loop to stop.
"""

from __future__ import annotations

import queue
from typing import Generic, TypeVar

from wstream.protocol.wake import WakePipe

T = TypeVar("T")


class Mailbox(Generic[T]):
    """``post`` from any thread; ``drain`` on the loop thread when :meth:`fileno` is readable (or
    any time: draining an empty mailbox costs one failed read)."""

    def __init__(self) -> None:
        self._items: queue.SimpleQueue[T] = queue.SimpleQueue()
        self._pipe = WakePipe()

    def fileno(self) -> int:
        """The read end of the wake-up pipe, to register with a poller."""
        return self._pipe.fileno()

    def post(self, item: T) -> None:
        self._items.put(item)
        self.wake()

    def wake(self) -> None:
        """Make :meth:`fileno` readable (safe from any thread or a signal handler)."""
        self._pipe.wake()

    def drain(self) -> list[T]:
        """Everything posted so far, oldest first. The pipe is emptied before the queue, so a post
        that races with this call is either returned now or wakes the poller again."""
        self._pipe.clear()
        items: list[T] = []
        while True:
            try:
                items.append(self._items.get_nowait())
            except queue.Empty:
                return items

    def close(self) -> None:
        self._pipe.close()
