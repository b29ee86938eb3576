"""The squared L2 norm of a stage's gradient: the float a push carries (``Push.sumsq``) and the one
the server adds into the step's global norm (exact clipping). One definition for both sides, so a
lone worker's measured norm and the server's are the same float.

# NOTE [Gradient norms]
# ``torch.linalg.vector_norm`` of a float32 tensor on the CPU sums in float32 lanes: on a 32 Mi
# element gradient it was 2.5e-3 off (relative to a float64 sum) and read 35 GB/s on the 2-core
# machine. fp32 dot products (BLAS) of ``NORM_CHUNK``-element pieces, added in float64, were within
# 1e-5 and read 43 GB/s. A gather that writes a sum (or a copy) chunk by chunk and takes each
# chunk's dot right after reads it back from cache: 8.5 ms against 10.5 for an add then a norm
# pass (32 Mi elements, two gradients, 2 threads). So:
# 1. On the CPU, ``squared_norm`` is the float64 sum of the pieces' fp32 dots.
# 2. A piece whose fp32 dot is not finite (inf or nan in the gradient, or a sum of squares past
#    float32's range) is summed again in float64: only a gradient holding inf or nan reads as
#    non-finite, which skips the step (NOTE [The step commit point] rule 2).
# 3. On a CUDA device the norm stays on the device (no synchronisation; ``squared_norm_tensor``):
#    one reduction accumulating in float64, which the device's arithmetic affords.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

NORM_CHUNK = 1 << 18
"""Elements per piece: 1 MiB of fp32, still in cache when the dot reads a piece a sum just wrote.
An fp32 dot's error grows with its length (BLAS sums in a few float32 lanes): on pieces of 2^16,
2^18 and 2^20 elements 0.8e-6, 6e-6 and 5e-5 relative, at 4.1, 3.1 and 2.7 ms per 32 Mi elements."""


def _dot64(piece: torch.Tensor) -> float:
    """``piece . piece``: the fp32 dot, or a float64 sum when that is not finite (rule 2)."""
    value = float(torch.dot(piece, piece))
    if math.isfinite(value):
        return value
    return float(torch.sum(torch.square(piece.double())))


def _total(dots: list[torch.Tensor], pieces: Sequence[torch.Tensor]) -> float:
    if len(dots) == 1:
        value = float(dots[0])
        return value if math.isfinite(value) else _dot64(pieces[0])
    values = torch.stack(dots).double()
    total = float(values.sum())
    if math.isfinite(total):
        return total
    return math.fsum(_dot64(p) for p in pieces)  # rule 2, piece by piece (rare: never on a healthy step)


def squared_norm(grad: torch.Tensor) -> float:
    """||grad||^2 as a Python float (float64): NOTE [Gradient norms]."""
    flat = grad.reshape(-1)
    if flat.device.type != "cpu":
        return float(squared_norm_tensor(flat))
    if flat.dtype != torch.float32:
        return float(torch.sum(torch.square(flat.double())))
    pieces = flat.split(NORM_CHUNK) if flat.numel() > NORM_CHUNK else (flat,)
    return _total([torch.dot(p, p) for p in pieces], pieces)


def squared_norm_tensor(grad: torch.Tensor) -> torch.Tensor:
    """||grad||^2 as a 0-dim float64 tensor on ``grad``'s device, without waiting for it (a CUDA
    worker copies it to the host behind its gradient). On the CPU the same float as
    :func:`squared_norm`."""
    flat = grad.reshape(-1)
    if flat.device.type == "cpu":
        return torch.tensor(squared_norm(flat), dtype=torch.float64)
    return torch.square(torch.linalg.vector_norm(flat, dtype=torch.float64))


def accumulate(dst: torch.Tensor, sources: Sequence[torch.Tensor], *, first: bool) -> None:
    """``dst = sum(sources)`` (``first``: what ``dst`` held is dropped) or ``dst += sum(sources)``,
    in one pass over memory where it can: two first sources are summed by ``torch.add(a, b,
    out=dst)`` (read 8 bytes and write 4 per element, where a copy then an add moved 20)."""
    if not sources:
        raise ValueError("accumulate needs at least one source")
    parts = list(sources)
    if first and len(parts) >= 2:
        torch.add(parts[0], parts[1], out=dst)
        parts = parts[2:]
    elif first:
        dst.copy_(parts[0])
        parts = parts[1:]
    for p in parts:
        dst.add_(p)


def accumulate_with_norm(dst: torch.Tensor, sources: Sequence[torch.Tensor], *, first: bool, norm_numel: int) -> float:
    """:func:`accumulate`, and ||dst[:norm_numel]||^2 of the result, chunk by chunk so that each dot reads a piece just
    written (NOTE [Gradient norms]); the same float as :func:`squared_norm` of the result. All
    tensors are flat float32 on the CPU, of ``dst``'s length."""
    if not sources:
        raise ValueError("accumulate_with_norm needs at least one source")
    numel = dst.numel()
    dots: list[torch.Tensor] = []
    pieces: list[torch.Tensor] = []
    with torch.no_grad():
        for start in range(0, numel, NORM_CHUNK):
            end = min(start + NORM_CHUNK, numel)
            d = dst[start:end]
            accumulate(d, [s[start:end] for s in sources], first=first)
            if start < norm_numel:
                piece = d[: norm_numel - start] if end > norm_numel else d
                pieces.append(piece)
                dots.append(torch.dot(piece, piece))
    if not dots:
        return 0.0
    return _total(dots, pieces)
