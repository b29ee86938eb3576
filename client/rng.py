"""Per-stage RNG record and replay: a recomputed stage draws the random numbers of its first run.

Separate from the executor because it is the one place that reads and sets torch's global RNG
state; the executor asks for a context around each stage run, the profiler for a forked RNG.

# NOTE [Quiet stretches]
# Recording a first run's RNG state costs two reads of the generator's 5 KiB state and a compare,
# about 15 us in a deep chain's forward sweep (the copies push the stage's own data out of the
# cache), more than half of a small stage's compute; and most stages draw nothing. So:
#   1. A first run on micro-batch 0 that drew nothing puts its position in ``StageRng.quiet``; one
#      that drew takes it out.
#   2. The executor runs consecutive first runs of quiet positions on one fetch as a *stretch*:
#      the RNG state is read before it, the stages run with no record, and one compare after it
#      says whether any of them drew. If none did, each gets the record None (what it would have
#      recorded), so its reruns need no replay. The stretch keeps its input until that compare
#      (one stage input more than the plan counts, for the length of one fetch).
#   3. If one did, the stretch is undone: the live RNG is set back to its state before the
#      stretch, its positions leave ``quiet``, and the stretch runs again from its input, each stage
#      recording its own state. The stages compute the same values the second time (same input,
#      same weights, same random numbers), so the step is what it would have been without
#      stretches: only a stage whose drawing changes from step to step costs a second run.
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
        # positions whose last recorded first run (micro-batch 0) drew no random number: their next
        # first runs go in quiet stretches (NOTE [Quiet stretches]); never filled without ``preserve``
        self.quiet: set[int] = set()

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

    def state(self) -> RngState:
        """The live RNG's state now."""
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def unmoved_since(self, before: RngState) -> bool:
        """Whether the live RNG is still at ``before`` (nothing drew a random number since)."""
        after = self.state()
        return _same(before[0], after[0]) and (before[1] is None or _same(before[1], after[1]))

    def set_state(self, state: RngState) -> None:
        """Set the live RNG back to ``state``."""
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.device)

    @contextlib.contextmanager
    def restored(self, state: RngState) -> Iterator[None]:
        """Run with the RNG set to ``state`` in a fork (the live RNG is untouched afterwards)."""
        with self.forked():
            self.set_state(state)
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
        self.before = self.rng.state()

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:  # the run failed: nothing is recorded, a retry is a first run again
            return
        rng, (position, lane) = self.rng, self.key
        moved = not rng.unmoved_since(self.before)
        self.states[self.key] = self.before if moved else None
        if lane == 0:
            if moved:
                rng.quiet.discard(position)
            else:
                rng.quiet.add(position)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two RNG states (CPU byte tensors) are equal: their bytes compared (2 us for the CPU
    generator's 5 KiB, ``torch.equal`` 4.7 us; it runs once per first run of every stage)."""
    return a.numpy().tobytes() == b.numpy().tobytes()
