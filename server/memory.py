"""Admission control: every job and gradient ring reserves its bytes before allocating them."""

from __future__ import annotations

from wstream.protocol import MemoryLimitError, format_bytes


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
