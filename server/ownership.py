"""One owner per socket and per store: an exclusive ``flock`` held for as long as the server runs.

ZeroMQ lets a second process bind an ipc path that a first one listens on (it unlinks the socket
file and takes the name over, cutting the first server's workers off), and nothing stopped two
servers from sharing one ``--store`` (one's ``drop`` deleted the other's live files). A lock file
beside each resource, locked with ``flock`` and holding the owner's pid, refuses the second
server with the holder's pid. The kernel releases the lock when the owner exits, however it
exits, so a crashed server never leaves a stale lock behind. The lock files stay (``S.sock.lock``
beside an ipc socket, ``.wstream-server.lock`` in a store): removing one while another process
opens it would let two processes lock two different files of the same name.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class HeldElsewhere(OSError):
    """The resource is locked by another process (``pid``; None when it could not be read)."""

    def __init__(self, path: Path, pid: int | None) -> None:
        super().__init__(f"{path} is locked by pid {pid}")
        self.pid = pid


class OwnerLock:
    """Lock ``path`` (created, mode 0600) for this process, or raise :class:`HeldElsewhere`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file = open(self.path, "a+", opener=lambda p, flags: os.open(p, flags, 0o600))  # noqa: SIM115
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            text = self._file.read().strip()
            self._file.close()
            raise HeldElsewhere(self.path, int(text) if text.isdigit() else None) from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"{os.getpid()}\n")
        self._file.flush()

    def release(self) -> None:
        if not self._file.closed:
            self._file.close()  # closing the descriptor releases the flock


def holder(pid: int | None) -> str:
    """How an error names the process that holds a lock."""
    return f"another wstream-server (pid {pid})" if pid is not None else "another wstream-server"
