"""Helpers shared by the benchmarks: a server subprocess, machine facts, robust timing."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import torch

from wstream.client import local_server


def machine() -> str:
    cpu = platform.processor() or "unknown cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = psutil.virtual_memory().total / 2**30
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, Python {platform.python_version()}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads)"
    )


@contextlib.contextmanager
def server(*extra: str, address: str | None = None, **client_options: Any) -> Iterator[str]:
    """A wstream-server subprocess on ``address`` (default: a fresh ipc endpoint); yields its
    address. ``client_options``: what a ``Client`` needs to reach it (CURVE keys)."""
    with tempfile.TemporaryDirectory() as tmp:
        address = address or f"ipc://{tmp}/bench.sock"
        with local_server(address, *extra, memory_limit=None, reuse=False, **client_options):
            yield address


def median_time(fn: Callable[[], object], *, repeat: int, warmup: int = 1) -> float:
    """Median wall time of ``fn`` over ``repeat`` runs (after ``warmup`` untimed ones)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class FlatStage(torch.nn.Module):
    """A stage that is just one big parameter: cheap to create, for transfer benchmarks."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(numel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def time_fetches(trainer: Any, stages: int, *, rounds: int, repeat: int) -> float:
    """Median seconds for ``trainer``'s prefetcher to fetch every stage ``rounds`` times: the
    worker's real fetch path (request, reply, copy into the ring), driven without compute."""
    pf = trainer.connection.prefetcher
    order = list(range(stages)) * rounds

    def fetch_all() -> None:
        pf.start(0, order)
        for s in order:
            pf.release(pf.get(s))

    return median_time(fetch_all, repeat=repeat)


def unit_bytes_arg(value: str) -> int | str | None:
    """A ``--unit-bytes`` option as ``create_job(unit_bytes=)`` takes it: 'auto', 'none' or bytes."""
    return None if value == "none" else "auto" if value == "auto" else int(value)


def parse_args(p: argparse.ArgumentParser, *, smoke: dict[str, Any]) -> argparse.Namespace:
    """``p``'s arguments, with ``--smoke``: ``smoke`` replaces the defaults by the smallest sizes
    that still go through the whole script (CI runs every bench so, to keep them from rotting;
    the figures of a smoke run are not measurements). Options given on the command line win."""
    unknown = set(smoke) - {a.dest for a in p._actions}
    if unknown:
        raise ValueError(f"smoke sizes for options this script does not have: {sorted(unknown)}")
    p.add_argument("--smoke", action="store_true", help="a tiny run through the whole script (CI); no figures")
    args = p.parse_args()
    if args.smoke:
        p.set_defaults(**smoke)
        args = p.parse_args()
        print("smoke run: the smallest sizes, for CI; these figures are not measurements", flush=True)
    return args

