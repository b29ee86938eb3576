"""Training throughput: samples and tokens per second over the last steps, for stats and bars.

A step's samples are the first dimension of its first input tensor; its tokens are that tensor's
elements when it holds integer ids (a language model's ``(batch, seq)`` token ids), else unknown.
Rates are over a window of recent steps (sum of work / sum of step time), so one slow step (a
profile, a reconnect) does not stay in the figure for long.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

WINDOW_STEPS = 20


def work_of(inputs: Any) -> tuple[int, int | None]:
    """``(samples, tokens)`` of a step's inputs (tokens None when they are not integer ids)."""
    first = inputs
    while isinstance(first, (tuple, list)) and first:
        first = first[0]
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        return 0, None
    tokens = first.numel() if not first.is_floating_point() and not first.is_complex() else None
    return first.shape[0], tokens


class Throughput:
    """The rates of the last :data:`WINDOW_STEPS` steps."""

    def __init__(self, window: int = WINDOW_STEPS) -> None:
        self._steps: deque[tuple[int, int | None, float]] = deque(maxlen=window)

    def add(self, samples: int, tokens: int | None, seconds: float) -> None:
        self._steps.append((samples, tokens, seconds))

    @property
    def samples_per_s(self) -> float | None:
        seconds = sum(s for _, _, s in self._steps)
        return sum(n for n, _, _ in self._steps) / seconds if seconds > 0 else None

    @property
    def tokens_per_s(self) -> float | None:
        """None when a step in the window had no token count."""
        seconds = sum(s for _, _, s in self._steps)
        if seconds <= 0 or any(t is None for _, t, _ in self._steps):
            return None
        return sum(t or 0 for _, t, _ in self._steps) / seconds
