"""Tensor bytes in data frames: cut into chunks of ``CHUNK_BYTES`` for sending, copied back out.

Sending uses zero-copy views of the tensor's memory (the caller keeps the tensor alive until the
peer has answered); receiving copies each frame straight into its place in the destination.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .messages import CHUNK_BYTES

if TYPE_CHECKING:
    import torch


def _buffer(frame: Any) -> memoryview:
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame).cast("B")


def frames_nbytes(frames: Sequence[Any]) -> int:
    """Total payload bytes of received (``zmq.Frame``) or outgoing (buffer) data frames."""
    return sum(len(_buffer(f)) for f in frames)


def tensor_frames(tensor: torch.Tensor, chunk: int = CHUNK_BYTES) -> list[memoryview]:
    """Zero-copy data frames of a contiguous CPU tensor (keep ``tensor`` alive until sent)."""
    import torch

    # as bytes: NumPy has no bfloat16, and a byte view is all a frame needs
    flat = memoryview(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()).cast("B")
    if len(flat) == 0:
        return [flat]
    return [flat[i : i + chunk] for i in range(0, len(flat), chunk)]


def copy_frames_into(dst: torch.Tensor, frames: Sequence[Any]) -> None:
    """Copy the bytes of ``frames`` in order into contiguous ``dst``; sizes must match exactly."""
    import torch

    out = dst.view(-1).view(torch.uint8)
    offset = 0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for f in frames:
            buf = _buffer(f)
            if len(buf) == 0:
                continue
            out[offset : offset + len(buf)].copy_(torch.frombuffer(buf, dtype=torch.uint8))
            offset += len(buf)
    if offset != out.numel():
        raise ValueError(f"data frames hold {offset} bytes, the tensor takes {out.numel()}")
