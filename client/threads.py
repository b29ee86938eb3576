"""A worker on the server's host keeps to the cores the server leaves (NOTE [Threads of a
co-located server] in server/threads.py, rule 3)."""

from __future__ import annotations

import logging
import os

import torch

from wstream.protocol.host import host_cores

log = logging.getLogger(__name__)


def share_cores(server_threads: int, server_pid: int, chosen: int | None) -> None:
    """Set this process's torch threads for a worker on the server's host: ``chosen``, or (None)
    no more than the cores ``server_threads`` leave. Nothing for a server in this very process,
    or one that did not say its threads."""
    if server_pid == os.getpid() or not server_threads:
        return
    now = torch.get_num_threads()
    want = chosen if chosen is not None else min(now, max(1, host_cores() - server_threads))
    if want != now:
        torch.set_num_threads(want)
        log.info(
            "torch threads of this worker: %d (was %d); the server on this host updates with %d of %d cores",
            want, now, server_threads, host_cores(),
        )
