"""How many threads the server computes with, and how it waits between updates.

NOTE [Threads of a co-located server]
A worker and the server usually share one host, and on a CPU worker, its cores. Two OpenMP pools
that each take every core and spin between parallel regions (libgomp's default) steal each
other's cores: a chain of 120 small stages ran 13.6x slower than plain PyTorch that way, and
2.3x with passive waiting alone (issue 17). So by default:

1. The ``wstream-server`` process waits passively (``OMP_WAIT_POLICY=PASSIVE``, set before torch
   loads, unless the environment sets it): an idle update thread sleeps instead of spinning.
2. It computes with half the cores, at least one (``--torch-threads`` overrides).
3. It tells its workers how many (``attached.compute_threads``), and a worker on the same host
   (it maps the job's shared memory) keeps its own torch threads at no more than the cores left
   (``client/threads.py``), so the two never ask for more threads than there are cores.

An in-process server (``InProcessServer``) shares its process's torch thread pool with the code
around it: it changes neither (a worker in that process sees ``server_pid`` equal to its own).
"""

from __future__ import annotations

import os
import sys

from wstream.protocol.host import host_cores


def wait_passively() -> None:
    """Have OpenMP threads sleep between parallel regions; effective only before torch loads."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def default_compute_threads(cores: int | None = None) -> int:
    """Rule 2 of the NOTE: half the cores, at least one."""
    return max(1, (host_cores() if cores is None else cores) // 2)
