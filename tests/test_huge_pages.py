"""Huge-page backing of shared memory (NOTE [Huge pages] in protocol/shm.py): what can be checked
on a host without reserved huge pages. The mount is faked by a directory with a 2 MiB "page":
that checks the placement and the size rounding, not the kernel's hugetlbfs."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from wstream.protocol import shm
from wstream.protocol.shm import HugePageMount

MiB = 2**20

MEMINFO = """MemTotal:       24576000 kB
HugePages_Total:      16
HugePages_Free:       12
Hugepagesize:       2048 kB
"""
MOUNTS = """tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0
hugetlbfs /mnt/huge1g hugetlbfs rw,relatime,pagesize=1G 0 0
hugetlbfs /dev/hugepages hugetlbfs rw,relatime,pagesize=2M 0 0
proc /proc proc rw 0 0
"""


@pytest.fixture(autouse=True)
def restore_policy() -> Iterator[None]:
    yield
    shm.configure_huge_pages("off")


def test_meminfo_and_mounts_are_read_with_their_page_sizes() -> None:
    info = shm.parse_meminfo(MEMINFO)
    assert info["HugePages_Free"] == 12 and info["Hugepagesize"] == 2 * MiB
    mounts = shm.parse_hugetlbfs_mounts(MOUNTS, default_page_size=2 * MiB)
    assert mounts == [HugePageMount("/dev/hugepages", 2 * MiB), HugePageMount("/mnt/huge1g", 2**30)]


def test_sizes_round_up_to_whole_pages() -> None:
    assert shm.round_up(1, 2 * MiB) == 2 * MiB
    assert shm.round_up(2 * MiB, 2 * MiB) == 2 * MiB
    assert shm.round_up(2 * MiB + 1, 2 * MiB) == 4 * MiB
    assert shm.round_up(0, 1) == 1 and shm.round_up(4097, 1) == 4097  # ordinary pages: unchanged


def test_auto_without_a_mount_falls_back_to_dev_shm_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="wstream.protocol.shm"):
        policy = shm.configure_huge_pages("auto", mounts=[])
    assert policy.mount is None and "no writable hugetlbfs mount" in caplog.text
    path = shm.create_segment(3 * MiB + 5, expected=2**40)
    try:
        assert os.path.dirname(path) == shm.SHM_DIR and os.path.getsize(path) == 3 * MiB + 5
    finally:
        shm.unlink_segment(path)


def test_on_without_a_mount_is_refused_naming_what_to_set_up() -> None:
    with pytest.raises(ValueError, match="hugetlbfs.*vm.nr_hugepages"):
        shm.configure_huge_pages("on", mounts=[])


def _fake_mount(tmp_path: Path, free: int, mode: shm.HugePagesMode) -> HugePageMount:
    mount = HugePageMount(str(tmp_path), 2 * MiB)
    shm.configure_huge_pages(mode, mounts=[mount])
    shm._policy = shm.HugePagePolicy(mode, mount, free=lambda page: free)
    return mount


def test_large_segments_go_to_huge_pages_in_whole_pages(tmp_path: Path) -> None:
    _fake_mount(tmp_path, free=2**40, mode="auto")
    path = shm.create_segment(MiB, expected=shm.HUGE_PAGES_MIN_BYTES)
    try:
        assert os.path.dirname(path) == str(tmp_path)
        assert shm.page_size_of(path) == 2 * MiB
        assert os.path.getsize(path) == 2 * MiB  # 1 MiB asked: one whole page
        shm.grow_segment(path, 5 * MiB)
        assert os.path.getsize(path) == 6 * MiB
        mapping = shm.map_segment(path, 5 * MiB + 3)
        assert mapping.numel() == 6 * MiB  # a mapping never ends inside a page
        del mapping
        shm.truncate_segment(path, 2 * MiB + 1)
        assert os.path.getsize(path) == 4 * MiB
        assert path in shm.segment_paths(os.getpid())  # reaped and checked like /dev/shm ones
    finally:
        shm.unlink_segment(path)


def test_auto_keeps_small_or_unknown_segments_and_those_that_do_not_fit_in_dev_shm(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _fake_mount(tmp_path, free=64 * MiB, mode="auto")
    with caplog.at_level(logging.INFO, logger="wstream.protocol.shm"):
        for expected in (None, MiB, shm.HUGE_PAGES_MIN_BYTES):  # unknown, small, more than is free
            path = shm.create_segment(MiB, expected=expected)
            assert os.path.dirname(path) == shm.SHM_DIR
            shm.unlink_segment(path)
    assert f"{shm.HUGE_PAGES_MIN_BYTES // MiB * MiB} bytes needs" in caplog.text and "using /dev/shm" in caplog.text


def test_on_puts_every_segment_on_huge_pages(tmp_path: Path) -> None:
    _fake_mount(tmp_path, free=0, mode="on")
    path = shm.create_segment(100)
    try:
        assert os.path.dirname(path) == str(tmp_path) and os.path.getsize(path) == 2 * MiB
    finally:
        shm.unlink_segment(path)


def test_server_with_huge_pages_on_and_no_mount_exits_clearly(tmp_path: Path) -> None:
    if any(os.access(m.path, os.W_OK) for m in shm.hugetlbfs_mounts()):
        pytest.skip("this host has a hugetlbfs mount")
    proc = subprocess.run(
        [sys.executable, "-m", "wstream.server", "--bind", f"ipc://{tmp_path}/s.sock", "--huge-pages", "on"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--huge-pages on: no writable hugetlbfs mount" in proc.stderr


def test_server_default_auto_falls_back_and_trains(tmp_path: Path) -> None:
    from conftest import start_server

    import models
    from wstream.client import SGD, Client

    srv = start_server(tmp_path, "--memory-limit", "1GiB")
    try:
        with Client(srv.address, timeout=30) as client:
            job = client.create_job("hp", models.mixed(), optimizer=SGD(lr=0.1), token="t")
            with job.trainer() as trainer:
                trainer.step(*models.batch("mixed", 0), models.loss_fn)
    finally:
        assert srv.stop(signal.SIGTERM) == 0
    if not shm.hugetlbfs_mounts():
        assert "huge pages: no writable hugetlbfs mount" in srv.log()
