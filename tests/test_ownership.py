"""One owner per socket and per store: a second ``wstream-server`` on the same ipc path or the
same ``--store`` is refused, naming the server that holds it, and the first serves on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import start_server
from wstream.client import Client

pytestmark = pytest.mark.server_process  # real server processes, each holding its socket and store


def second_server(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wstream.server", *args], capture_output=True, text=True, timeout=120
    )


def test_a_second_server_on_the_same_ipc_socket_is_refused_and_the_first_serves_on(tmp_path: Path) -> None:
    first = start_server(tmp_path)
    try:
        second = second_server("--bind", first.address)
        assert second.returncode == 2, second.stderr
        assert f"cannot listen on {first.address}: another wstream-server (pid {first.proc.pid}) holds it" in second.stderr
        with Client(first.address, timeout=30) as client:
            assert client.status().pid == first.proc.pid  # still reachable, still the first
    finally:
        assert first.stop() == 0


def test_a_second_server_on_the_same_store_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    first = start_server(tmp_path, "--store", str(store), name="first")
    try:
        second = second_server("--bind", f"ipc://{tmp_path}/second.sock", "--store", str(store))
        assert second.returncode == 2, second.stderr
        assert f"store {store} is in use by another wstream-server (pid {first.proc.pid})" in second.stderr
    finally:
        assert first.stop() == 0
    # once the first has stopped, the store is free again
    again = start_server(tmp_path, "--store", str(store), name="again")
    assert again.stop() == 0
