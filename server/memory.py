"""Admission control: every job and gradient ring reserves its bytes before allocating them."""

from __future__ import annotations

import os

import psutil

from wstream.protocol import MemoryLimitError, format_bytes
from wstream.protocol.shm import SHM_DIR


class MemoryAccount:
    """Bytes reserved against the server's ``--memory-limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    @property
    def free(self) -> int:
        return self.limit - self.used

    def check(self, nbytes: int, what: str) -> None:
        """Raise :class:`MemoryLimitError` with the numbers unless ``nbytes`` would fit now."""
        if nbytes > self.free:
            raise MemoryLimitError(
                f"{what} needs {format_bytes(nbytes)} ({nbytes} bytes) but only {format_bytes(self.free)} "
                f"({self.free} bytes) of the server's {format_bytes(self.limit)} memory limit is free"
            )

    def reserve(self, nbytes: int, what: str) -> None:
        """Reserve ``nbytes`` for ``what`` or raise :class:`MemoryLimitError` with the numbers."""
        self.check(nbytes, what)
        self.used += nbytes

    def release(self, nbytes: int) -> None:
        self.used -= nbytes
        assert self.used >= 0, "memory account went negative: this is a bug in wstream"


def memory_limit_warnings(limit: int, ram: int | None = None, shm_size: int | None = None) -> list[str]:
    """What is wrong with ``limit`` on this host: more than its physical memory (``ram``) or than
    the size of /dev/shm (``shm_size``), where jobs live. Sizes default to this host's."""
    ram = psutil.virtual_memory().total if ram is None else ram
    if shm_size is None:
        try:
            st = os.statvfs(SHM_DIR)
            shm_size = st.f_blocks * st.f_frsize
        except OSError:
            shm_size = None
    out = []
    if limit > ram:
        out.append(
            f"the memory limit ({format_bytes(limit)}) is more than this host's physical memory "
            f"({format_bytes(ram)}): jobs admitted under it may be swapped out or end the server by the OOM "
            "killer; lower --memory-limit"
        )
    if shm_size is not None and limit > shm_size:
        out.append(
            f"the memory limit ({format_bytes(limit)}) is more than the size of {SHM_DIR} ({format_bytes(shm_size)}), "
            f"where jobs' weights and gradient rings live: jobs will be refused with {SHM_DIR} full before the "
            f"limit is reached; enlarge {SHM_DIR} or lower --memory-limit"
        )
    return out
