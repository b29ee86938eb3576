"""Shared-memory segments: files under /dev/shm that the server creates and workers map.

Naming: ``wstream-<server pid>-<32 hex>``. The random part makes names unguessable; the pid lets a
restarted server reap segments left by a crashed one. Files are created ``O_EXCL`` with mode
0600 and fully preallocated, so a full /dev/shm is an error at admission instead of a SIGBUS when a
page is first touched.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "wstream-"


class SegmentSpaceError(OSError):
    """/dev/shm has no room for the segment."""


def segment_paths(pid: int | None = None) -> list[str]:
    """Paths of wstream segments in /dev/shm, all or those of one server pid."""
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    prefix = PREFIX if pid is None else f"{PREFIX}{pid}-"
    return sorted(os.path.join(SHM_DIR, n) for n in names if n.startswith(prefix))


def create_segment(nbytes: int) -> str:
    """Create a preallocated segment of ``nbytes`` (at least one page) and return its path."""
    path = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-{secrets.token_hex(16)}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(nbytes, 1))
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        if exc.errno == errno.ENOSPC:
            free = shm_free_bytes()
            raise SegmentSpaceError(
                errno.ENOSPC, f"{SHM_DIR} has {free} bytes free, a segment of {nbytes} bytes does not fit"
            ) from None
        raise
    os.close(fd)
    return path


def map_segment(path: str, nbytes: int) -> torch.Tensor:
    """Map ``path`` shared, read-write, as a uint8 tensor that owns the mapping."""
    import torch

    return torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)


def unlink_segment(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def reap_stale_segments() -> list[str]:
    """Unlink segments whose creating server process no longer exists; return what was removed."""
    removed = []
    for path in segment_paths():
        parts = os.path.basename(path)[len(PREFIX) :].split("-", 1)
        try:
            pid = int(parts[0])
        except ValueError:
            continue
        if pid != os.getpid() and not psutil.pid_exists(pid):
            unlink_segment(path)
            removed.append(path)
    if removed:
        log.info("reaped %d stale shared-memory segment(s) of dead servers", len(removed))
    return removed


def grow_segment(path: str, nbytes: int) -> None:
    """Extend ``path`` to ``nbytes``, preallocated (raises :class:`SegmentSpaceError` when full)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise SegmentSpaceError(
                errno.ENOSPC, f"{SHM_DIR} has {shm_free_bytes()} bytes free, growing a segment to {nbytes} bytes failed"
            ) from None
        raise
    finally:
        os.close(fd)


def truncate_segment(path: str, nbytes: int) -> None:
    os.truncate(path, max(nbytes, 1))
