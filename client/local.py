"""A ``wstream-server`` for one program: start it (or find one already there), stop it at the end.

Examples, notebooks and tests want a server without a second terminal::

    with local_server() as address, Client(address) as client:
        ...

Production servers are long-lived processes of their own (``docs/operating.md``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from wstream.protocol import ServerUnavailable

from .wait import wait_for_server

log = logging.getLogger(__name__)


def default_address() -> str:
    """An ipc endpoint private to this user: ``ipc://<tmp>/wstream-<uid>.sock``."""
    return f"ipc://{tempfile.gettempdir()}/wstream-{os.getuid()}.sock"


@contextlib.contextmanager
def local_server(
    address: str | None = None,
    *args: str,
    memory_limit: str | None = "2GiB",
    reuse: bool = True,
    announce: Callable[[str], object] = log.info,
    **client_options: Any,
) -> Iterator[str]:
    """Yield the address of a server: one already answering at ``address`` when ``reuse`` (left
    running at the end), else a ``wstream-server`` subprocess started with ``args`` (more flags)
    and stopped with SIGTERM at the end (it snapshots and cleans its shared memory as usual).
    ``memory_limit``: its ``--memory-limit`` (None: the server's default, or the config file's).
    ``announce`` gets one line saying which (``print`` in examples); ``client_options`` are what a
    :class:`Client` needs to reach the server (CURVE keys)."""
    address = address or default_address()
    if reuse:
        try:
            wait_for_server(address, timeout=1.0, **client_options)
            announce(f"using the wstream-server already running at {address}")
            yield address
            return
        except ServerUnavailable:
            pass
    cmd = [sys.executable, "-m", "wstream.server", "--bind", address, *args]
    if memory_limit is not None:
        cmd += ["--memory-limit", memory_limit]
    if not any(a.startswith("--log-level") for a in args):
        cmd += ["--log-level", "WARNING"]
    proc = subprocess.Popen(cmd)
    try:
        wait_for_server(address, timeout=60, alive=lambda: proc.poll() is None, **client_options)
    except ServerUnavailable:
        proc.kill()
        proc.wait()
        raise ServerUnavailable(f"wstream-server did not come up at {address} (exit code {proc.poll()})") from None
    announce(f"started wstream-server (pid {proc.pid}) at {address}")
    try:
        yield address
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
