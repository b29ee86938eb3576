"""A worker on the server's host keeps to the cores the server leaves (NOTE [Threads of a
co-located server] in server/threads.py, rule 3), and wstream's own threads in a worker compute
alone (NOTE [Helper threads compute alone]).

NOTE [Helper threads compute alone]
A worker's helper threads (the gradient sender, the prefetcher) run torch operations of their own:
a stage's gradient written into its slot and its norm, weights copied into the ring. Left to
torch's defaults, each such thread that reaches a parallel operation becomes the master of a
second OpenMP team. libgomp then manages more threads than there are cores and stops spinning
between parallel regions in *every* team (its "throttled" spin), so each parallel region of the
compute thread pays a sleeping thread's wake-up: measured on 2 cores, plain PyTorch beside a
trainer of 2 compute threads ran a 60 x 256 step in 47-63 ms instead of 21, and the trainer's own
step in 51 ms instead of 31.5 (BENCHMARKS.md, session 17). So:

1. A helper thread computes with one intra-op thread (:func:`serial_thread`): its copies and norms
   are one stage's, and they run beside the compute thread, which has the cores.
2. The process's default (what a thread started later gets from torch) is left as it was:
   ``torch.set_num_threads`` sets both the calling thread's count and that default, so the
   thread that starts a helper sets the default back once the helper has set its own.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

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


def serial_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """Start a daemon thread running ``target`` with torch's intra-op parallelism off in it, the
    process's default left as it was (NOTE [Helper threads compute alone])."""
    default = torch.get_num_threads()
    serial = threading.Event()

    def run() -> None:
        try:
            torch.get_num_threads()  # torch's lazy per-thread setup, which would later apply the default
            torch.set_num_threads(1)
        finally:
            serial.set()
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    serial.wait()
    torch.set_num_threads(default)  # (this thread's count, unchanged, and the default for later threads)
    return thread
