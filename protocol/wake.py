"""A wake-up pipe: the way a thread that waits in a ZeroMQ poll is woken by another thread.

ZeroMQ's poller watches file descriptors next to its sockets, so the read end of a pipe is the
portable way to say "look at your queue" to a thread blocked in ``poll``. The server's loop
(``wstream.server.mailbox``) and the worker's gradient sender (``wstream.client.push``) both
wait so; this is the one implementation of the pipe they share.
"""

from __future__ import annotations

import os


class WakePipe:
    """``wake()`` from any thread (or a signal handler) makes :meth:`fileno` readable until the
    waiting thread calls :meth:`clear`. Both ends are non-blocking: a full pipe is already awake."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def fileno(self) -> int:
        """The read end, to register with a poller."""
        return self._r

    def wake(self) -> None:
        try:
            os.write(self._w, b"x")
        except OSError:
            pass  # full of wake-ups already (or closed at shutdown)

    def clear(self) -> None:
        """Empty the pipe (call before looking at what the wake-ups were for, so that a wake-up
        that races with the look makes the pipe readable again)."""
        try:
            os.read(self._r, 4096)
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)
