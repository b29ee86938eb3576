"""Shared-memory segments: files under /dev/shm that the server creates and workers map.

Naming: ``wstream-<server pid>-<32 hex>``. The random part makes names unguessable; the pid lets a
restarted server reap segments left by a crashed one. Files are created ``O_EXCL`` with mode
0600 and fully preallocated, so a full /dev/shm is an error at admission instead of a SIGBUS when a
page is first touched.

# NOTE [Huge pages]
# 1. A GPU worker page-locks the segments it maps (``cudaHostRegister``); on 4 KiB pages that runs
#    at 1-2 GB/s of pages, minutes for hundreds of GB. On 2 MiB (or 1 GiB) pages it is that many
#    times fewer pages. So the server may create segments on a hugetlbfs mount (``--huge-pages``).
# 2. hugetlbfs rather than ``memfd_create(MFD_HUGETLB)``: workers open segments by path, and a
#    memfd is reachable from another process only through ``/proc/<server pid>/fd/<n>``, which
#    needs ptrace rights over the server. A hugetlbfs file is a path like any other.
# 3. Sizes on hugetlbfs are whole huge pages: every size given to create, grow, truncate or map is
#    rounded up to the mount's page size (both ends compute it from the path, see
#    :func:`page_size_of`), so a mapping never ends inside a page (munmap would refuse it).
# 4. ``auto`` uses huge pages for a segment whose expected size is at least
#    :data:`HUGE_PAGES_MIN_BYTES` and fits in the free huge pages, else /dev/shm (logged); ``on``
#    uses them for every segment and refuses one that does not fit (like a full /dev/shm);
#    ``off`` never. Huge pages exist only where an administrator reserved them
#    (``vm.nr_hugepages``), so ``auto`` changes nothing on a host without any.
"""

from __future__ import annotations

import errno
import functools
import logging
import mmap
import os
import secrets
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import psutil

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import torch

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "wstream-"
HUGETLBFS_PREFERRED = "/dev/hugepages"
HUGE_PAGES_MIN_BYTES = 256 * 2**20
"""``auto`` puts segments of at least this size on huge pages (smaller ones register fast anyway)."""

HugePagesMode = Literal["auto", "on", "off"]


class SegmentSpaceError(OSError):
    """/dev/shm has no room for the segment."""


@dataclass(frozen=True, slots=True)
class HugePageMount:
    path: str
    page_size: int


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def parse_meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo`` as numbers: sizes in bytes (the file says kB), counts as they are."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def _size_option(text: str) -> int:
    """``2M`` / ``1G`` / ``2048k`` (hugetlbfs's pagesize= option) in bytes."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    text = text.strip().lower()
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


def parse_hugetlbfs_mounts(mounts: str, default_page_size: int) -> list[HugePageMount]:
    """The hugetlbfs mounts of a ``/proc/mounts`` text, ``/dev/hugepages`` first."""
    found = []
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4 or fields[2] != "hugetlbfs":
            continue
        size = default_page_size
        for opt in fields[3].split(","):
            if opt.startswith("pagesize="):
                size = _size_option(opt.split("=", 1)[1])
        found.append(HugePageMount(fields[1].replace("\\040", " "), size))
    return sorted(found, key=lambda m: m.path != HUGETLBFS_PREFERRED)


@functools.lru_cache(maxsize=1)
def hugetlbfs_mounts() -> tuple[HugePageMount, ...]:
    """This host's hugetlbfs mounts (read once per process)."""
    default = parse_meminfo(_read("/proc/meminfo")).get("Hugepagesize", 2 * 2**20)
    return tuple(parse_hugetlbfs_mounts(_read("/proc/mounts"), default))


def huge_pages_free(page_size: int) -> int:
    """Bytes of free huge pages of ``page_size`` (reserved by ``vm.nr_hugepages`` and unused)."""
    text = _read(f"/sys/kernel/mm/hugepages/hugepages-{page_size // 1024}kB/free_hugepages").strip()
    if text.isdigit():
        return int(text) * page_size
    info = parse_meminfo(_read("/proc/meminfo"))
    if info.get("Hugepagesize") == page_size:
        return info.get("HugePages_Free", 0) * page_size
    return 0


def round_up(nbytes: int, page: int) -> int:
    return -(-max(nbytes, 1) // page) * page


@dataclass(frozen=True, slots=True)
class HugePagePolicy:
    """Where the server creates segments (NOTE [Huge pages], rule 4)."""

    mode: HugePagesMode = "off"
    mount: HugePageMount | None = None
    free: Callable[[int], int] = huge_pages_free

    def directory_for(self, expected: int | None) -> tuple[str, int]:
        """(directory, page size) for a segment expected to grow to ``expected`` bytes (None: unknown)."""
        m = self.mount
        if m is None or self.mode == "off":
            return SHM_DIR, 1
        if self.mode == "on":
            return m.path, m.page_size
        if expected is None or expected < HUGE_PAGES_MIN_BYTES:
            return SHM_DIR, 1
        need, free = round_up(expected, m.page_size), self.free(m.page_size)
        if need <= free:
            return m.path, m.page_size
        log.info("huge pages: a segment of %d bytes needs %d, %d are free in %s; using %s", expected, need, free, m.path, SHM_DIR)
        return SHM_DIR, 1


_policy = HugePagePolicy()


def configure_huge_pages(mode: HugePagesMode, mounts: Sequence[HugePageMount] | None = None) -> HugePagePolicy:
    """Set where this process (the server) creates segments; ``on`` without a writable hugetlbfs
    mount is a ValueError naming what to set up. Returns the policy, which the caller may log."""
    global _policy
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"huge_pages must be auto, on or off, got {mode!r}")
    candidates = [m for m in (hugetlbfs_mounts() if mounts is None else mounts) if os.access(m.path, os.W_OK)]
    mount = candidates[0] if candidates and mode != "off" else None
    if mode == "on" and mount is None:
        raise ValueError(
            "--huge-pages on: no writable hugetlbfs mount (mount -t hugetlbfs -o pagesize=2M none "
            f"{HUGETLBFS_PREFERRED}, and reserve pages with sysctl vm.nr_hugepages=N)"
        )
    if mode == "auto" and mount is None:
        log.info("huge pages: no writable hugetlbfs mount; shared memory in %s on ordinary pages", SHM_DIR)
    elif mount is not None:
        log.info(
            "huge pages (%s): %s, pages of %d bytes, %d bytes free now",
            mode, mount.path, mount.page_size, huge_pages_free(mount.page_size),
        )
    _policy = HugePagePolicy(mode, mount)
    return _policy


def _known_mounts() -> list[HugePageMount]:
    return [*((_policy.mount,) if _policy.mount is not None else ()), *hugetlbfs_mounts()]


def segment_dirs() -> list[str]:
    """Where segments may be: /dev/shm and the hugetlbfs mounts."""
    return list(dict.fromkeys([SHM_DIR, *(m.path for m in _known_mounts())]))


def page_size_of(path: str) -> int:
    """The page size sizes of ``path`` are rounded to: a hugetlbfs mount's, else 1 (no rounding)."""
    for m in _known_mounts():
        if os.path.dirname(path) == m.path:
            return m.page_size
    return 1


def segment_paths(pid: int | None = None, dirs: list[str] | None = None) -> list[str]:
    """Paths of wstream segments in /dev/shm (and hugetlbfs mounts; or in ``dirs``), all or
    those of one server pid."""
    prefix = PREFIX if pid is None else f"{PREFIX}{pid}-"
    paths = []
    for d in segment_dirs() if dirs is None else dirs:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        paths.extend(os.path.join(d, n) for n in names if n.startswith(prefix))
    return sorted(paths)


def create_segment(nbytes: int, *, expected: int | None = None) -> str:
    """Create a preallocated segment of ``nbytes`` (at least one page) and return its path.
    ``expected``: the size it will grow to, if known (decides huge pages under ``auto``)."""
    directory, page = _policy.directory_for(nbytes if expected is None else max(expected, nbytes))
    path = os.path.join(directory, f"{PREFIX}{os.getpid()}-{segment_stamps()}-{secrets.token_hex(16)}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, round_up(nbytes, page))
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        if exc.errno == errno.ENOSPC:
            raise SegmentSpaceError(errno.ENOSPC, f"{_space(directory)}, a segment of {nbytes} bytes does not fit") from None
        raise
    os.close(fd)
    return path


def map_segment(path: str, nbytes: int, *, writable: bool = True) -> torch.Tensor:
    """Map ``path`` shared as a uint8 tensor that owns the mapping (whole huge pages on hugetlbfs;
    the tensor is that long). ``writable=False``: the pages are mapped read-only (``PROT_READ``), so
    a write through the tensor faults instead of changing what every other reader sees."""
    import torch

    size = round_up(nbytes, page_size_of(path))
    if writable:
        return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # torch warns that the buffer is not writable: that is the point
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8)  # (the tensor keeps the mapping alive)


def unlink_segment(path: str) -> bool:
    """Remove ``path``; False when it was gone already (another process reaped it first)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def room_for_segment(expected: int) -> int | None:
    """Free bytes where a segment expected to grow to ``expected`` bytes would be made, when that
    is /dev/shm and it has a size; None otherwise (hugetlbfs: :class:`HugePagePolicy` chose it for
    having the pages; a tmpfs mounted without a size reports none free, and takes any)."""
    directory, _ = _policy.directory_for(expected)
    if directory != SHM_DIR:
        return None
    st = os.statvfs(SHM_DIR)
    if st.f_blocks == 0:
        return None
    return shm_free_bytes()


def _space(directory: str) -> str:
    """What is free where a segment did not fit, for the error."""
    if directory == SHM_DIR:
        return f"{SHM_DIR} has {shm_free_bytes()} bytes free"
    page = page_size_of(os.path.join(directory, "x"))
    return f"{directory} has {huge_pages_free(page)} bytes of free huge pages ({page}-byte pages)"


_OWN_STAMPS: tuple[int, int, int] | None = None  # (pid, ticks, wall) of this process, kept: a fork gets its own


def segment_stamp(pid: int | None = None) -> int:
    """The start time of process ``pid`` (default: this one), as a segment's name carries its
    creator's: a pid alone does not tell a live creator from an earlier process that had the same
    pid (a server restarted in a container is pid 1 again). On Linux it is the process's start in
    clock ticks after boot (``/proc/PID/stat``), which no change of the wall clock moves: a start
    time read as wall-clock time (``psutil``'s) is boot time plus that, and a clock step in
    between made a live server's stamp read differently, so another server reaped its segments."""
    if pid is not None and pid != os.getpid():
        return _start_ticks(pid)
    return _own_stamps()[1]


def segment_stamps(pid: int | None = None) -> str:
    """What a segment's name carries of its creator after its pid: ``<start as wall-clock time,
    1/100 s>-<start in ticks after boot>`` (NOTE in :func:`_creator_alive`)."""
    if pid is not None and pid != os.getpid():
        return f"{_wall_stamp(pid)}-{_start_ticks(pid)}"
    _, ticks, wall = _own_stamps()
    return f"{wall}-{ticks}"


def _own_stamps() -> tuple[int, int, int]:
    global _OWN_STAMPS
    me = os.getpid()
    if _OWN_STAMPS is None or _OWN_STAMPS[0] != me:
        _OWN_STAMPS = (me, _start_ticks(me), _wall_stamp(me))
    return _OWN_STAMPS


def _wall_stamp(pid: int) -> int:
    """Process ``pid``'s start as wall-clock time, in hundredths of a second (older servers' stamp)."""
    return int(psutil.Process(pid).create_time() * 100)


def _start_ticks(pid: int) -> int:
    """Process ``pid``'s start in clock ticks after boot (``psutil.NoSuchProcess`` if it is gone);
    where there is no ``/proc``, its start as wall-clock time."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            raise psutil.NoSuchProcess(pid) from None
        return _wall_stamp(pid)
    # "pid (comm) state ... starttime": comm may hold spaces and ')', so fields count from the last ')'
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def _creator_alive(name: str) -> bool | None:
    """Whether the process that made segment ``name`` (without its directory) still runs; None
    when the name is not a wstream segment's.

    # NOTE [Segment names across server versions]
    # 1. ``pid-random``: the oldest servers' names; the pid alone decides (this process's is alive).
    # 2. ``pid-wall-random``: the creator's start as wall-clock time. Read again after a clock step
    #    (NTP, a VM's resync) it differs, so a live server's segments looked stale: kept only to
    #    read those servers' names.
    # 3. ``pid-wall-ticks-random`` (now): the start in ticks after boot decides, which no clock
    #    step moves; the wall-clock stamp stays second, where servers of rule 2 read theirs, so an
    #    older server starting beside a newer one does not take its segments for stale ones."""
    parts = name[len(PREFIX) :].split("-")
    try:
        pid = int(parts[0])
    except ValueError:
        return None
    if len(parts) == 2:  # rule 1
        return pid == os.getpid() or psutil.pid_exists(pid)
    try:
        if len(parts) == 3:  # rule 2
            return _wall_stamp(pid) == int(parts[1])
        return segment_stamp(pid) == int(parts[2])  # rule 3
    except (psutil.NoSuchProcess, psutil.ZombieProcess, ValueError):
        return False
    except psutil.AccessDenied:
        return True


def reap_stale_segments(dirs: list[str] | None = None) -> list[str]:
    """Unlink segments whose creating server process no longer exists (its pid gone, or held by
    another process that started later); return what this call removed (servers starting at
    once may share the work). ``dirs``: where to look (default :func:`segment_dirs`)."""
    removed = []
    for path in segment_paths(dirs=dirs):
        if _creator_alive(os.path.basename(path)) is False and unlink_segment(path):
            removed.append(path)
    if removed:
        log.info("reaped %d stale shared-memory segment(s) of dead servers", len(removed))
    return removed


def grow_segment(path: str, nbytes: int) -> None:
    """Extend ``path`` to ``nbytes``, preallocated (raises :class:`SegmentSpaceError` when full)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, round_up(nbytes, page_size_of(path)))
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise SegmentSpaceError(
                errno.ENOSPC, f"{_space(os.path.dirname(path))}, growing a segment to {nbytes} bytes failed"
            ) from None
        raise
    finally:
        os.close(fd)


def truncate_segment(path: str, nbytes: int) -> None:
    os.truncate(path, round_up(nbytes, page_size_of(path)))
