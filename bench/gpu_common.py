"""Helpers of the GPU benchmarks: refuse clearly without CUDA, print what the figures ran on, and
time GPU work (between device synchronizes: the host only issues it)."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from common import machine


def require_cuda(script: str, *, smoke: bool = False, cpu_smoke: bool = False) -> torch.device:
    """The CUDA device, or exit 2 with a message saying what this benchmark needs. A smoke run
    (``--smoke``, as CI runs every bench) without CUDA exits 0 after saying so: it has parsed its
    arguments and loaded every import, which is what can be checked without a GPU. A script whose
    whole path also runs on the CPU (``cpu_smoke``) gets the CPU device for its smoke run instead,
    so that CI runs every line of it and a GPU session's minutes are not spent on a script that
    rotted (the figures it prints then are no GPU figures, and it says so)."""
    if not torch.cuda.is_available():
        why = "this torch has no CUDA support" if torch.version.cuda is None else "no CUDA device is visible"
        if smoke and cpu_smoke:
            print(f"{script} --smoke: no CUDA here ({why}); its whole path runs on the CPU, no GPU figure measured")
            return torch.device("cpu")
        if smoke:
            print(f"{script} --smoke: no CUDA here ({why}); arguments and imports checked, no GPU figure measured")
            sys.exit(0)
        print(
            f"{script}: needs a CUDA GPU and a CUDA build of torch ({why}; torch {torch.__version__}). "
            "Nothing was measured. On the device machine: bash bench/gpu_all.sh (BENCHMARKS.md).",
            file=sys.stderr,
        )
        sys.exit(2)
    return torch.device("cuda")


def driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as exc:
        return f"unknown ({exc.__class__.__name__})"


def header(device: torch.device) -> None:
    """What the figures ran on: GPU, driver, torch and CUDA versions, host."""
    if device.type != "cuda":
        print(f"device: {device} (a smoke run, not a GPU figure); torch {torch.__version__}; host: {machine()}")
        return
    props = torch.cuda.get_device_properties(device)
    print(f"gpu: {torch.cuda.get_device_name(device)} ({props.total_memory / 2**30:.1f} GiB)")
    print(f"driver: {driver_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"host: {machine()}")
    sys.stdout.flush()


def gpu_seconds(fn: Callable[[], object], *, repeat: int, warmup: int = 1) -> float:
    """Median wall seconds of ``fn`` from one full device synchronize to the next (so work that
    ``fn`` only issued, on any stream, is counted)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def synchronize(device: torch.device) -> None:
    """Wait for the work issued on ``device`` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int:
    """Peak bytes allocated on ``device`` since :func:`reset_peak_memory`; 0 off CUDA (not measured)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def gb_per_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The GPT of figures 2 and 4 (one definition, so that DeepSpeed runs the same model and batches)."""
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batches", default="4,8,16", help="batch sizes (sequences per step)")
