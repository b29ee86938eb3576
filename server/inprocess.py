"""A ``wstream-server`` inside the calling process, on a thread: for tests and notebooks.

The very same :class:`~wstream.server.Server` as the ``wstream-server`` command (handlers, job
state, shared memory, snapshots, metrics), run by ``Server.run()`` on a background thread instead
of in a process of its own: no interpreter to start, no torch to import, nothing to reap. Clients
reach it at its endpoint as usual (by default a fresh ``ipc://`` socket, so a worker subprocess or
the ``wstream`` command can reach it too)::

    with InProcessServer(memory_limit=2**30) as srv, Client(srv.address) as client:
        ...

What it does not give is isolation: the server shares this process's signals, GIL and fate.
Tests of transport faults, crashes, signals and shared memory across processes start a real
``wstream-server`` process instead (``tests/conftest.py`` has both).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import uuid
from types import TracebackType
from typing import Any

from .config import ServerConfig
from .service import Server

log = logging.getLogger(__name__)


class InProcessServer:
    """A :class:`Server` on a daemon thread of this process. ``config`` or keyword arguments of
    :class:`ServerConfig` (not both); without ``bind`` it listens on a new ipc socket in the
    temporary directory. The sockets are bound when the constructor returns, so requests may be
    sent at once (they wait in the socket until the loop starts)."""

    def __init__(self, config: ServerConfig | None = None, **fields: Any) -> None:
        if config is not None and fields:
            raise ValueError("give a ServerConfig or its fields as keyword arguments, not both")
        self._own_socket: str | None = None  # the ipc path it chose itself: removed at stop
        if config is None:
            if "bind" not in fields:
                path = os.path.join(tempfile.gettempdir(), f"wstream-inprocess-{uuid.uuid4().hex[:12]}.sock")
                fields["bind"] = [f"ipc://{path}"]
                self._own_socket = path
            config = ServerConfig(**fields)
        self.server = Server(config)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="wstream-server", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """The first endpoint it listens on (as bound: a tcp port 0 is resolved)."""
        return self.server.endpoints[0]

    def _run(self) -> None:
        try:
            self.server.run()
        except BaseException as exc:  # reported by stop(): a test must not pass over a dead server
            log.exception("the in-process wstream-server failed")
            self._error = exc

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the loop, wait for the server's shut-down (final snapshots, shared memory removed)
        and re-raise whatever ended its thread with an error."""
        self.server.stop()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the in-process wstream-server at {self.address} did not stop within {timeout:g} s")
        if self._own_socket is not None:  # a name nobody else uses: its socket and lock files go too
            for leftover in (self._own_socket, self._own_socket + ".lock"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover)
        if self._error is not None:
            raise RuntimeError(f"the in-process wstream-server at {self.address} failed: {self._error!r}") from self._error

    def __enter__(self) -> InProcessServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
