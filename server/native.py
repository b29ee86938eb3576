"""Two native kernels of the server's per-stage work, where torch has no fused op: built at first
use from ``native_update.c`` by the host's C compiler and called through ctypes.

# NOTE [Native kernels]
# 1. *The sum of several workers' gradients and its norm* (a gather of W >= 2 pushes, NOTE [Held
#    gradient slots] rule 4). torch writes the sum with ``torch.add(out=)`` and takes each piece's
#    dot after it: 16 bytes per parameter (the store reads its line first) and an fp32 dot per
#    piece. One C pass with streamed stores moves 12 and adds the squares as it goes: 32 M
#    parameters, two workers, 2 threads, 10.3 -> 6.5 ms on the 2-core machine.
# 2. *AdamW and the published copy in one pass* (a stage whose published slot is not its master:
#    bf16 weights or double buffering). torch's fused AdamW then ``copy_`` into the slot reads the
#    master again and reads each line it writes: 36 bytes per parameter (bf16) where one pass
#    moves 30. The arithmetic is torch's fused CPU kernel's (its scalars in float64, the elements
#    in float32, its two fused multiply-adds), so the master and the moments are torch's to the
#    bit, but in a parameter's last ``numel % 16`` elements, which torch computes by another loop
#    (there within a rounding). The bf16 copy is the master rounded to nearest even, as
#    ``Tensor.to(torch.bfloat16)`` rounds it. The same kernel runs an update with a ``grad_scale``
#    (several workers' mean, clipping), which torch's fused kernel makes write the divided gradient
#    back over the gradient it read: 32 bytes per parameter where 28 do (15.2 -> 12.8 ms on 32 M).
# 3. The norm of a sum of several gradients is this kernel's float: the sum of ``NORM_CHUNK``-
#    element pieces' squares, each piece summed in float64 lanes (squares of float32 are exact
#    there, and cannot overflow), the pieces added in order: within ~1e-15 of the exact sum, where
#    ``squared_norm``'s BLAS dots are within ~1e-6. A lone worker's norm is still
#    ``squared_norm``'s, so held and gathered pushes of one worker add the same float. The pieces
#    sit at fixed offsets of the stage, so the float does not depend on the thread count.
# 4. Built with ``cc -O3 -march=native`` (about 0.3 s) into a cache keyed by the source, the
#    flags, the compiler's version and the CPU's flags (a shared home on another CPU builds its
#    own), then loaded with ctypes, which lets go of the GIL for the call. A stage is split into
#    ranges over ``torch.get_num_threads()`` threads, as torch's own kernels split it.
# 5. No compiler, a failed build or ``WSTREAM_NATIVE=0``: the torch paths run (a warning says why,
#    once). Nothing else changes: the optimizer state is torch's, in torch's keys, either way.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch

from wstream.protocol.grad_norm import NORM_CHUNK

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_update.c")
VERSION = 1
"""``wstream_native_version()`` of the source this module calls."""
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-shared")
SPLIT_MIN = 1 << 19
"""Elements per thread below which a range is not split (a thread hand-off costs ~20 us)."""
STREAM_MIN = 1 << 20
"""Elements from which the kernels stream their stores past the cache (the sum into the
accumulator, an fp32 published copy): a smaller stage's may still be in cache when the update (or
the next fetch) reads it."""
OUT_KINDS = {torch.bfloat16: 1, torch.float32: 2}
"""The published dtypes :func:`adamw` writes beside the master."""

_P = ctypes.c_void_p
_lock = threading.Lock()
_loaded: list[ctypes.CDLL | None] = []  # empty: not tried yet
_pool: ThreadPoolExecutor | None = None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("WSTREAM_NATIVE_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "wstream" / "native"


def _build() -> ctypes.CDLL | None:
    """Compile (or find in the cache) and load the library; None, with a warning, when it cannot."""
    if os.environ.get("WSTREAM_NATIVE", "1") == "0":
        log.info("WSTREAM_NATIVE=0: the torch update paths run")
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler (cc) found: the server's native update kernels are off, torch's run (NOTE [Native kernels])")
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
        source = SOURCE.read_bytes()
        key = hashlib.sha256(
            b"\0".join([source, " ".join(FLAGS).encode(), version.encode(), _cpu_flags().encode(), platform.machine().encode()])
        ).hexdigest()[:20]
        path = _compiled(cc, key)
        lib = ctypes.CDLL(str(path))
        if lib.wstream_native_version() != VERSION:
            raise OSError(f"{path} is version {lib.wstream_native_version()}, this wstream calls version {VERSION}")
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("the server's native update kernels are off, torch's run (NOTE [Native kernels]): %s", exc)
        return None
    lib.wstream_sum_sumsq.argtypes = [_P, _P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, _P, ctypes.c_int]
    lib.wstream_sum_sumsq.restype = None
    lib.wstream_adamw.argtypes = [_P, _P, _P, _P, ctypes.c_int64] + [ctypes.c_float] * 8 + [_P, ctypes.c_int, ctypes.c_int]
    lib.wstream_adamw.restype = None
    log.info("native update kernels loaded from %s", path)
    return lib


def _compiled(cc: str, key: str) -> Path:
    """The library built from the source under ``key``, compiled unless the cache holds it
    (written to a temporary name, then renamed: concurrent servers each see a whole file)."""
    for directory in (_cache_dir(), Path(tempfile.gettempdir()) / f"wstream-native-{os.getuid()}"):
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        path = directory / f"update-{key}.so"
        if path.exists():
            return path
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
        try:
            done = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise OSError(f"{cc} failed to build {SOURCE.name}: {done.stderr.strip()[-2000:]}")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path
    raise OSError(f"no writable directory for the native kernels (tried {_cache_dir()} and the temporary directory)")


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on the first call (thread-safe); None where they cannot be."""
    if not _loaded:
        with _lock:
            if not _loaded:
                _loaded.append(_build())
    return _loaded[0]


def available() -> bool:
    return library() is not None


@contextmanager
def turned_off() -> Iterator[None]:
    """Run the torch paths inside the block, as without a compiler (benchmarks and tests compare
    the two in one process); not for use while a server runs updates."""
    library()
    with _lock:
        saved = _loaded[0]
        _loaded[0] = None
    try:
        yield
    finally:
        _loaded[0] = saved


def _ranges(n: int, align: int) -> list[tuple[int, int]]:
    """``[0, n)`` split into up to ``torch.get_num_threads()`` ranges that start on ``align``."""
    if n <= 0:
        return []
    parts = max(1, min(torch.get_num_threads(), n // SPLIT_MIN))
    size = -(-n // parts)
    size = -(-size // align) * align
    return [(lo, min(n, lo + size)) for lo in range(0, n, size)]


def _run(calls: list[Callable[[], None]]) -> None:
    """Run the calls, on the pool's threads when there are several."""
    global _pool
    if not calls:
        return
    if len(calls) == 1:
        calls[0]()
        return
    if _pool is None:
        with _lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="wstream-native")
    others = [_pool.submit(c) for c in calls[1:]]
    try:
        calls[0]()
    finally:
        for fut in others:
            fut.result()


def _addr(t: torch.Tensor, at: int = 0) -> int:
    return t.data_ptr() + at * t.element_size()


def _fits(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 1 and t.is_contiguous() for t in tensors)


def fits_output(out: torch.Tensor, numel: int) -> bool:
    """Whether :func:`adamw` can write ``out`` (a published copy of ``numel`` elements) and the
    kernels are loaded."""
    return (
        out.dtype in OUT_KINDS and out.numel() == numel and out.dim() == 1 and out.is_contiguous()
        and out.device.type == "cpu" and available()
    )


def sum_with_norm(dst: torch.Tensor, sources: Sequence[torch.Tensor], *, first: bool, norm_numel: int) -> float | None:
    """``dst = sum(sources)`` (``first``) or ``dst += sum(sources)``, and ||dst[:norm_numel]||^2
    (NOTE rules 1 and 3); None, having done nothing, when the kernels are off or the tensors are not
    flat contiguous fp32 of one length (the caller runs torch's path)."""
    lib = library()
    n = dst.numel()
    if lib is None or not sources or len(sources) > 63 or not _fits(dst, *sources) or any(s.numel() != n for s in sources):
        return None
    pieces = max(1, -(-min(norm_numel, n) // NORM_CHUNK))
    sums = torch.zeros(pieces, dtype=torch.float64)
    summed = list(sources) if first else [dst, *sources]  # (dst + a) + b: torch's order of adds
    calls = []
    for lo, hi in _ranges(n, NORM_CHUNK):
        srcs = (_P * len(summed))(*(_addr(s, lo) for s in summed))
        calls.append(partial(lib.wstream_sum_sumsq, _addr(dst, lo), srcs, len(summed), hi - lo,
                             max(0, min(norm_numel, n) - lo), NORM_CHUNK, _addr(sums, lo // NORM_CHUNK), int(n >= STREAM_MIN)))
    _run(calls)
    return float(sums.sum())


def adamw(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    step: float,
    grad_scale: float,
    out: torch.Tensor | None,
) -> bool:
    """One AdamW step of ``param`` (its ``step``-th, counted from 1) with ``grad / grad_scale``, the
    new values also written to ``out`` (bf16 or fp32, ``param``'s length) when given (NOTE rule 2).
    False, having done nothing, when the kernels are off or a tensor does not fit."""
    lib = library()
    n = param.numel()
    if lib is None or not _fits(param, exp_avg, exp_avg_sq, grad) or any(t.numel() != n for t in (exp_avg, exp_avg_sq, grad)):
        return False
    if out is not None and not fits_output(out, n):
        return False
    kind = 0 if out is None else OUT_KINDS[out.dtype]
    beta1, beta2 = betas
    scalars = (  # torch's, in float64 (NOTE rule 2); ctypes rounds them to float32 as torch does
        1.0 - lr * weight_decay, 1.0 - beta1, beta2, 1.0 - beta2, eps, grad_scale, -lr / (1.0 - beta1**step),
        math.sqrt(1.0 - beta2**step),
    )
    calls = [
        partial(lib.wstream_adamw, _addr(param, lo), _addr(exp_avg, lo), _addr(exp_avg_sq, lo), _addr(grad, lo), hi - lo,
                *scalars, _addr(out, lo) if out is not None else None, kind, int(n >= STREAM_MIN))
        for lo, hi in _ranges(n, 16)
    ]
    _run(calls)
    return True
