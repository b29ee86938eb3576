"""The simulator: replays a plan's actions without running anything, checks that they reverse the
chain exactly once each, and counts recomputation and peak memory (slots, states, bytes).

Separate from the planners because it is their referee: every planner returns its plan through
:func:`checked_plan`, and tests and benches replay plans here with measured sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .plan import Action, Op, Plan, PlanError


@dataclass(frozen=True, slots=True)
class Simulation:
    advances: int
    peak_slots: int
    peak_states: int
    peak_bytes: int
    """Most activation bytes live at once: kept states + the current state (+ one tape)."""
    peak_host_bytes: int = 0
    """Most bytes of offloaded states held in host memory at once."""


_GROWS = frozenset((Op.ADVANCE, Op.SNAPSHOT, Op.PREFETCH))
"""The actions after which a peak (kept states, live states, live bytes) can be higher."""


def simulate(
    n: int,
    actions: Sequence[Action],
    *,
    state_bytes: Sequence[int] | None = None,
    tape_bytes: Sequence[int] | None = None,
) -> Simulation:
    """Check that ``actions`` reverse a chain of ``n`` stages exactly once each, in order n-1..0,
    and return the counts. ``state_bytes[i]`` is the size of x_i; ``tape_bytes[i]`` the extra
    memory of F_i's tape while its BACKWARD runs. Raises :class:`PlanError` naming the first bad
    action."""
    sb = state_bytes if state_bytes is not None else [1] * n
    tb = tape_bytes if tape_bytes is not None else [0] * n
    kept: set[int] = set()
    host: set[int] = set()
    current: int | None = 0
    next_backward = n - 1
    advances = peak_slots = peak_states = peak_bytes = peak_host = 0
    kept_bytes = host_bytes = 0

    def live(extra: int = 0) -> int:
        cur = sb[min(current, n - 1)] if current is not None and current not in kept else 0
        return kept_bytes + cur + extra

    def where() -> str:  # named only for an error: building it per action would dominate the replay
        return f"action {k} ({op.name} {i})"

    for k, (op, i) in enumerate(actions):
        if not 0 <= i < n:
            raise PlanError(f"{where()}: stage {i} is outside the chain of {n}")
        if op in (Op.ADVANCE, Op.SNAPSHOT, Op.OFFLOAD, Op.BACKWARD) and current != i:
            raise PlanError(f"{where()}: the current state is {current}, not {i}")
        if op in (Op.RESTORE, Op.FREE) and i not in kept:
            raise PlanError(f"{where()}: x_{i} is not kept")
        if op in (Op.PREFETCH, Op.FREE_HOST) and i not in host:
            raise PlanError(f"{where()}: x_{i} is not in host memory")
        if op == Op.ADVANCE:
            if i > next_backward or (i == next_backward and next_backward != n - 1):
                raise PlanError(f"{where()}: stage {i} is at or past the next stage to reverse ({next_backward})")
            # ADVANCE n-1 (to the chain's output) is allowed before any backward: a chain whose
            # length is learned while running computes x_n before it knows it is the last
            peak_bytes = max(peak_bytes, live(sb[i + 1] if i + 1 < n else sb[i]))
            current = i + 1
            advances += 1
        elif op == Op.SNAPSHOT:
            if i not in kept:
                kept.add(i)
                kept_bytes += sb[i]
        elif op == Op.RESTORE:
            current = i
        elif op == Op.FREE:
            kept.remove(i)
            kept_bytes -= sb[i]
        elif op == Op.OFFLOAD:
            if i not in host:
                host.add(i)
                host_bytes += sb[i]
                peak_host = max(peak_host, host_bytes)
        elif op == Op.PREFETCH:
            if i not in kept:
                kept.add(i)
                kept_bytes += sb[i]
        elif op == Op.FREE_HOST:
            host.remove(i)
            host_bytes -= sb[i]
        elif op == Op.BACKWARD:
            if i != next_backward:
                raise PlanError(f"{where()}: the next stage to reverse is {next_backward}")
            peak_bytes = max(peak_bytes, live(tb[i]))
            next_backward -= 1
            current = None
        if op in _GROWS:  # no other action can raise a peak (a FREE of the current state moves
            # its bytes from "kept" to "current"): skipping them halves a long replay's time
            peak_slots = max(peak_slots, len(kept))
            peak_states = max(peak_states, len(kept) + (1 if current is not None and current not in kept else 0))
            peak_bytes = max(peak_bytes, live())
    if next_backward != -1:
        raise PlanError(f"the plan ends with stages 0..{next_backward} not reversed")
    return Simulation(advances, peak_slots, peak_states, peak_bytes, peak_host)


def checked_plan(name: str, n: int, actions: list[Action]) -> Plan:
    """The :class:`Plan` of ``actions``, checked and counted by :func:`simulate` (every planner
    returns its plan through here)."""
    sim = simulate(n, actions)
    return Plan(name, n, tuple(actions), sim.advances, sim.peak_slots, sim.peak_states)
