"""Per-stage RNG record and replay: a recomputed stage draws the random numbers of its first run.

Separate from the executor because it is the one place that reads and sets torch's global RNG
state; the executor asks for a context around each stage run, the profiler for a forked RNG.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

RngState = tuple[torch.Tensor, "torch.Tensor | None"]
"""The CPU generator's state and, on a CUDA worker, the device's."""


class StageRng:
    """Records each stage run's RNG state on its first run and replays it on every re-run.

    A stage's first run (per micro-batch) uses the live RNG and records its state, so the RNG
    ends where plain training leaves it; every re-run replays the recorded state in a forked RNG.
    (Stage-major order draws random numbers stage by stage, so with k > 1 dropout masks differ
    from those of micro-batch-major accumulation; their distribution does not.) With
    ``preserve=False`` nothing is recorded and a re-run draws fresh numbers."""

    def __init__(self, device: torch.device, preserve: bool) -> None:
        self.device = device
        self.preserve = preserve

    def around(self, states: dict[tuple[int, int], Any], i: int, lane: int = 0) -> contextlib.AbstractContextManager[None]:
        """The context to run position ``i`` for micro-batch ``lane`` in; ``states`` is the
        step's record, (position, micro-batch) -> state of its first run, or None where that run
        drew no random number (the RNG state did not move): its re-runs need no replay, and a
        chain without dropout keeps no 5 KiB state per stage."""
        if not self.preserve:
            return contextlib.nullcontext()
        key = (i, lane)
        if key not in states:
            return _Recording(self, states, key)
        state = states[key]
        return contextlib.nullcontext() if state is None else self.restored(state)

    def _state(self) -> RngState:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    @contextlib.contextmanager
    def restored(self, state: RngState) -> Iterator[None]:
        """Run with the RNG set to ``state`` in a fork (the live RNG is untouched afterwards)."""
        with self.forked():
            torch.set_rng_state(state[0])
            if state[1] is not None:
                torch.cuda.set_rng_state(state[1], self.device)
            yield

    def forked(self) -> contextlib.AbstractContextManager[Any]:
        """A fork of the CPU RNG and, on a CUDA worker, the device's: whatever runs inside leaves
        the live RNG where it was."""
        devices = [self.device] if self.device.type == "cuda" else []
        return torch.random.fork_rng(devices=devices)


class _Recording:
    """A first run's context: records the RNG state it starts from, or None where it drew nothing
    (a class, not a generator: it wraps millions of stage runs in a deep chain)."""

    __slots__ = ("rng", "states", "key", "before")

    def __init__(self, rng: StageRng, states: dict[tuple[int, int], Any], key: tuple[int, int]) -> None:
        self.rng, self.states, self.key = rng, states, key

    def __enter__(self) -> None:
        self.before = self.rng._state()

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:  # the run failed: nothing is recorded, a retry is a first run again
            return
        before, after = self.before, self.rng._state()
        moved = not torch.equal(before[0], after[0]) or (before[1] is not None and not torch.equal(before[1], after[1]))
        self.states[self.key] = before if moved else None
