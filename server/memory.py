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


CGROUP_ROOT = "/sys/fs/cgroup"
UNLIMITED = 1 << 60
"""cgroup v1 writes "no limit" as a number near 2**63; any limit from here up is none."""


def container_memory_limit(root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> int | None:
    """The memory limit of this process's container: the smallest limit set on its cgroup or an
    ancestor (v2 ``memory.max``, v1 ``memory/…/memory.limit_in_bytes``); None where none is set or
    none can be read. A container's /dev/shm pages count against it, so jobs admitted beyond it end
    the server by the OOM killer instead of being refused."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    places: list[tuple[str, str]] = []  # (the hierarchy's mount, the cgroup's path in it)
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            places.append((os.path.join(root, "memory"), path))
        elif not controllers:  # v2: its own mount, or "unified" beside v1's
            unified = os.path.join(root, "unified")
            places.append((unified if os.path.isdir(unified) else root, path))
    limits = []
    for mount, path in places:
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):  # the cgroup, then each ancestor (inside a container: the mount)
            where = os.path.join(mount, *parts[:depth])
            for name in ("memory.max", "memory.limit_in_bytes"):
                try:
                    with open(os.path.join(where, name)) as f:
                        value = f.read().strip()
                except OSError:
                    continue
                if value.isdigit() and int(value) < UNLIMITED:
                    limits.append(int(value))
    return min(limits, default=None)


def usable_memory() -> int:
    """What this server may fill: the host's physical memory, or less under a container's limit."""
    ram = psutil.virtual_memory().total
    container = container_memory_limit()
    return ram if container is None else min(ram, container)


def memory_limit_warnings(
    limit: int, ram: int | None = None, shm_size: int | None = None, container: int | None = -1
) -> list[str]:
    """What is wrong with ``limit`` on this host: more than its physical memory (``ram``), than its
    container's memory limit (``container``; None: none) or than the size of /dev/shm
    (``shm_size``), where jobs live. Sizes default to this host's."""
    ram = psutil.virtual_memory().total if ram is None else ram
    container = container_memory_limit() if container == -1 else container
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
    if container is not None and container < ram and limit > container:
        out.append(
            f"the memory limit ({format_bytes(limit)}) is more than this container's memory limit "
            f"({format_bytes(container)}), which its {SHM_DIR} counts against: jobs admitted under it end the "
            "server by the OOM killer; lower --memory-limit"
        )
    if shm_size is not None and limit > shm_size:
        out.append(
            f"the memory limit ({format_bytes(limit)}) is more than the size of {SHM_DIR} ({format_bytes(shm_size)}), "
            f"where jobs' weights and gradient rings live: jobs will be refused with {SHM_DIR} full before the "
            f"limit is reached; enlarge {SHM_DIR} or lower --memory-limit"
        )
    return out
