"""Checkpoint plans: pure data describing how to run forward and backward over a chain of stages.

A chain is ``x_{i+1} = F_i(x_i)`` for stages ``0 .. n-1``. A plan is a list of actions over it:

* ``ADVANCE i``  -- run F_i without autograd from the current state x_i; the current state becomes
  x_{i+1} (the previous one is dropped unless it is also a snapshot).
* ``SNAPSHOT i`` -- keep the current state x_i in a slot.
* ``RESTORE i``  -- make the kept x_i the current state (it stays kept).
* ``FREE i``     -- drop the kept x_i.
* ``BACKWARD i`` -- run F_i with autograd from the current state x_i, backpropagate dx_{i+1} (the
  loss for i = n-1) into dx_i and the stage's parameter gradient; the current state is dropped.
* ``OFFLOAD i``  -- copy the current state x_i to host memory (asynchronously on a GPU); the
  device keeps nothing of it unless it is also kept there.
* ``PREFETCH i`` -- copy the host copy of x_i back; it becomes a device-kept state (RESTORE-able).
* ``FREE_HOST i`` -- drop the host copy of x_i.

Cost model (Griewank and Walther's, as in ../shared/REFERENCES.md): ``slots`` counts kept states,
the one holding x_0 included; one stage's tape is live at a time; each stage runs once with
autograd (its BACKWARD). The number of ADVANCEs is the recomputation a plan costs; keeping every
boundary (``store_all``) needs n-1 of them, the least possible. With streamed weights every
ADVANCE and BACKWARD of stage i also fetches w_i.

Nothing here imports torch: planners are pure functions and plans are checked by :func:`simulate`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache


class Op(enum.IntEnum):
    ADVANCE = 0
    SNAPSHOT = 1
    RESTORE = 2
    FREE = 3
    BACKWARD = 4
    OFFLOAD = 5
    PREFETCH = 6
    FREE_HOST = 7


Action = tuple[Op, int]


class PlanError(ValueError):
    """A plan that cannot run, or a request no plan can satisfy."""


@dataclass(frozen=True, slots=True)
class Plan:
    """A checkpoint plan for a chain of ``n`` stages, with what it costs."""

    name: str
    n: int
    actions: tuple[Action, ...]
    advances: int
    """Untaped forward evaluations (the recomputation); the total forward count is n + advances."""
    peak_slots: int
    """Most states kept at once (x_0 included): Griewank and Walther's slots."""
    peak_states: int
    """Most states alive at once: the kept ones plus the current one when it is not kept."""

    def fetch_order(self) -> list[int]:
        """The chain positions of the compute actions, in order: the trainer fetches each one's
        weight stage (a position tied to an earlier stage fetches that stage again)."""
        return [i for op, i in self.actions if op in (Op.ADVANCE, Op.BACKWARD)]

    @property
    def forward_evaluations(self) -> int:
        return self.n + self.advances


@dataclass(frozen=True, slots=True)
class Simulation:
    advances: int
    peak_slots: int
    peak_states: int
    peak_bytes: int
    """Most activation bytes live at once: kept states + the current state (+ one tape)."""
    peak_host_bytes: int = 0
    """Most bytes of offloaded states held in host memory at once."""


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

    for k, (op, i) in enumerate(actions):
        where = f"action {k} ({op.name} {i})"
        if not 0 <= i < n:
            raise PlanError(f"{where}: stage {i} is outside the chain of {n}")
        if op in (Op.ADVANCE, Op.SNAPSHOT, Op.OFFLOAD, Op.BACKWARD) and current != i:
            raise PlanError(f"{where}: the current state is {current}, not {i}")
        if op in (Op.RESTORE, Op.FREE) and i not in kept:
            raise PlanError(f"{where}: x_{i} is not kept")
        if op in (Op.PREFETCH, Op.FREE_HOST) and i not in host:
            raise PlanError(f"{where}: x_{i} is not in host memory")
        if op == Op.ADVANCE:
            if i > next_backward or (i == next_backward and next_backward != n - 1):
                raise PlanError(f"{where}: stage {i} is at or past the next stage to reverse ({next_backward})")
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
                raise PlanError(f"{where}: the next stage to reverse is {next_backward}")
            peak_bytes = max(peak_bytes, live(tb[i]))
            next_backward -= 1
            current = None
        peak_slots = max(peak_slots, len(kept))
        peak_states = max(peak_states, len(kept) + (1 if current is not None and current not in kept else 0))
        peak_bytes = max(peak_bytes, live())
    if next_backward != -1:
        raise PlanError(f"the plan ends with stages 0..{next_backward} not reversed")
    return Simulation(advances, peak_slots, peak_states, peak_bytes, peak_host)


def _plan(name: str, n: int, actions: list[Action]) -> Plan:
    sim = simulate(n, actions)
    return Plan(name, n, tuple(actions), sim.advances, sim.peak_slots, sim.peak_states)


def _check_n(n: int) -> None:
    if n < 1:
        raise PlanError(f"a chain needs at least one stage, got n={n}")


# ---- store_all ------------------------------------------------------------------------------------
def store_all(n: int) -> Plan:
    """Keep every stage input: n-1 advances (the minimum), n slots."""
    _check_n(n)
    actions: list[Action] = []
    for i in range(n - 1):
        actions += [(Op.SNAPSHOT, i), (Op.ADVANCE, i)]
    actions.append((Op.BACKWARD, n - 1))
    for i in range(n - 2, -1, -1):
        actions += [(Op.RESTORE, i), (Op.FREE, i), (Op.BACKWARD, i)]
    return _plan("store_all", n, actions)


# ---- reversal of a segment with everything kept (building block) ----------------------------------
def _reverse_storing_all(a: int, b: int, emit: Callable[[Action], None]) -> None:
    """Current state x_a (kept by the caller or not); reverse stages [a, b) keeping every input."""
    for i in range(a, b - 1):
        if i > a:
            emit((Op.SNAPSHOT, i))
        emit((Op.ADVANCE, i))
    emit((Op.BACKWARD, b - 1))
    for i in range(b - 2, a, -1):
        emit((Op.RESTORE, i))
        emit((Op.FREE, i))
        emit((Op.BACKWARD, i))
    if b - 1 > a:
        emit((Op.RESTORE, a))
        emit((Op.BACKWARD, a))


# ---- sqrt(n) segments (Chen et al. 2016) ----------------------------------------------------------
def sqrt_segments(n: int, segments: int | None = None, *, recursive: bool = False) -> Plan:
    """Keep the input of each of ``segments`` (default ceil(sqrt n)) segments in the first sweep,
    then reverse segment by segment, keeping every input inside the segment. With
    ``recursive=True`` a segment is itself split the same way until it is at most 2 stages long
    (O(log n) memory, O(n log n) recomputation)."""
    _check_n(n)
    k = segments if segments is not None else max(1, math.ceil(math.sqrt(n)))
    if not 1 <= k <= n:
        raise PlanError(f"segments must be in [1, {n}], got {k}")
    actions: list[Action] = []
    emit = actions.append

    def reverse(a: int, b: int, parts: int) -> None:
        # current state x_a, kept by the caller
        length = b - a
        if length <= 2 or parts <= 1:
            _reverse_storing_all(a, b, emit)
            return
        bounds = [a + (length * j) // parts for j in range(parts)] + [b]
        for j in range(1, parts):
            for i in range(bounds[j - 1], bounds[j]):
                emit((Op.ADVANCE, i))
            emit((Op.SNAPSHOT, bounds[j]))
        for j in range(parts - 1, -1, -1):
            s, e = bounds[j], bounds[j + 1]
            if j < parts - 1:
                emit((Op.RESTORE, s))
            sub = max(1, math.ceil(math.sqrt(e - s))) if recursive else 1
            reverse(s, e, sub)
            if j > 0:
                emit((Op.FREE, s))

    emit((Op.SNAPSHOT, 0))
    reverse(0, n, k)
    emit((Op.FREE, 0))
    return _plan("sqrt_recursive" if recursive else "sqrt", n, actions)


# ---- divide and conquer: bisection (Siskind and Pearlmutter) --------------------------------------
def divide_and_conquer(n: int) -> Plan:
    """Bisection: keep the midpoint, reverse the right half, then the left. For n = 2^k it costs
    (n/2) log2 n advances with log2 n + 1 slots."""
    _check_n(n)
    actions: list[Action] = [(Op.SNAPSHOT, 0)]
    _bisect(0, n, actions.append)
    actions.append((Op.FREE, 0))
    return _plan("dnc", n, actions)


# ---- binomial checkpointing (Griewank and Walther, Revolve) ----------------------------------------
def beta(s: int, t: int) -> int:
    """The longest chain reversible with ``s`` slots and repetition number ``t``: C(s+t, s)."""
    if s < 0 or t < 0:
        return 0
    return math.comb(s + t, s)


def revolve_cost(n: int, slots: int) -> int:
    """The minimal number of advances p(n, slots) = t*n - C(slots+t, slots+1) (closed form)."""
    _check_n(n)
    if slots < 1:
        raise PlanError(f"revolve needs at least one slot (for x_0), got {slots}")
    if n == 1:
        return 0
    t = 0
    while beta(slots, t) < n:
        t += 1
    return t * n - math.comb(slots + t, slots + 1)


def _revolve_split(m: int, ds: int) -> int:
    """How far to advance before the next snapshot, for m stages left and ds free slots
    (Griewank and Walther's rule, p. 34 of the TOMS paper; see REFERENCES)."""
    if ds == 1:
        return m - 1
    t = 0
    while beta(ds, t) < m:
        t += 1
    b1, b2, b3 = beta(ds, t - 1), beta(ds - 1, t - 1), beta(ds - 2, t - 1)
    b4, b5 = beta(ds, t - 2), beta(ds - 3, t)
    if m <= b1 + b3:
        k = b4
    elif m >= beta(ds, t) - b5:
        k = b1
    else:
        k = m - b2 - b3
    return max(1, min(k, m - 1))


def revolve(n: int, slots: int) -> Plan:
    """Binomial checkpointing with ``slots`` kept states (x_0 included): p(n, slots) advances, the
    proven minimum."""
    _check_n(n)
    if slots < 1:
        raise PlanError(f"revolve needs at least one slot (for x_0), got {slots}")
    actions: list[Action] = [(Op.SNAPSHOT, 0)]
    _revolve_emit(0, n, slots, actions.append)
    actions.append((Op.FREE, 0))
    return _plan("revolve", n, actions)


def _revolve_emit(a: int, b: int, slots: int, emit: Callable[[Action], None]) -> None:
    """Reverse [a, b) from the kept current state x_a with ``slots`` slots in all (x_a's included),
    splitting as p(l, s) = k + p(l-k, s-1) + p(k, s) with k from :func:`_revolve_split`."""
    m = b - a
    if m == 1:
        emit((Op.BACKWARD, a))
        return
    if slots == 1:  # only x_a is kept: advance from it for every stage, last first
        for end in range(b, a, -1):
            emit((Op.RESTORE, a))
            for i in range(a, end - 1):
                emit((Op.ADVANCE, i))
            emit((Op.BACKWARD, end - 1))
        return
    k = _revolve_split(m, slots)
    for i in range(a, a + k):
        emit((Op.ADVANCE, i))
    emit((Op.SNAPSHOT, a + k))
    _revolve_emit(a + k, b, slots - 1, emit)
    emit((Op.FREE, a + k))
    emit((Op.RESTORE, a))
    _revolve_emit(a, a + k, slots, emit)


def revolve_cost_dp(n: int, slots: int) -> int:
    """p(n, slots) by the recurrence p(l, s) = min_k [k + p(l-k, s-1) + p(k, s)] (for tests)."""

    @lru_cache(maxsize=None)
    def p(length: int, s: int) -> int:
        if length == 1:
            return 0
        if s == 1:
            return length * (length - 1) // 2
        return min(k + p(length - k, s - 1) + p(k, s) for k in range(1, length))

    return p(n, slots)


class OnlineBisection:
    """Bisection checkpointing for a chain whose length is learned while it runs (Siskind and
    Pearlmutter): the forward keeps x_i at every power of two, so O(log i) inputs are live while
    running; once the chain ends at n, :meth:`finish` reverses the segments between kept inputs,
    last first, each by bisection. O(log n) memory, O(n log n) recomputation, and one more
    forward than an offline plan (x_n is computed before the chain is known to end)."""

    def __init__(self) -> None:
        self.position = 0
        self._kept = [0]
        self.actions: list[Action] = [(Op.SNAPSHOT, 0)]

    def advance(self) -> list[Action]:
        """The actions that take the current state from x_i to x_{i+1}."""
        i = self.position
        acts: list[Action] = [(Op.ADVANCE, i)]
        self.position = i + 1
        if self.position & (self.position - 1) == 0:  # a power of two
            acts.append((Op.SNAPSHOT, self.position))
            self._kept.append(self.position)
        self.actions += acts
        return acts

    def finish(self) -> list[Action]:
        """The backward actions, now that the chain has ``position`` stages. Also validates the
        whole plan with :func:`simulate`."""
        n = self.position
        if n < 1:
            raise PlanError("the chain ended before its first stage: run the loop at least once")
        acts: list[Action] = []
        kept = [k for k in self._kept if k < n]
        if self._kept[-1] == n:  # x_n itself was kept: it is the output, not a stage input
            acts.append((Op.FREE, n))
        bounds = [*kept, n]
        for j in range(len(kept) - 1, -1, -1):
            a, b = bounds[j], bounds[j + 1]
            acts.append((Op.RESTORE, a))
            _bisect(a, b, acts.append)
            acts.append((Op.FREE, a))
        self.actions += acts
        # validate without the keep/drop of x_n: it turned out to be the output, not an input
        simulate(n, [a for a in self.actions if a[1] != n or a[0] == Op.ADVANCE])
        return acts


def _bisect(a: int, b: int, emit: Callable[[Action], None]) -> None:
    """Reverse [a, b) by bisection from the kept current state x_a."""
    if b - a == 1:
        emit((Op.BACKWARD, a))
        return
    mid = (a + b) // 2
    for i in range(a, mid):
        emit((Op.ADVANCE, i))
    emit((Op.SNAPSHOT, mid))
    _bisect(mid, b, emit)
    emit((Op.FREE, mid))
    emit((Op.RESTORE, a))
    _bisect(a, mid, emit)


PLANNERS = {
    "store_all": lambda n, slots=None: store_all(n),
    "sqrt": lambda n, slots=None: sqrt_segments(n),
    "sqrt_recursive": lambda n, slots=None: sqrt_segments(n, recursive=True),
    "dnc": lambda n, slots=None: divide_and_conquer(n),
    "revolve": lambda n, slots=None: revolve(n, slots if slots is not None else max(1, math.ceil(math.log2(max(n, 2))))),
}
"""Planners by schedule name (``job.trainer(schedule=...)``)."""


# ---- heterogeneous chains under a byte budget --------------------------------------------------
@dataclass(frozen=True, slots=True)
class StageCosts:
    """Per-stage costs of a chain, as measured by a profiling pass (or given).

    ``forward_s[i]``: seconds of an untaped forward of stage i; ``state_bytes[i]``: size of its
    input x_i; ``tape_bytes[i]``: extra memory while stage i runs with autograd and backward;
    ``weight_bytes[i]``: bytes fetched for every run of stage i; ``bandwidth``: bytes/s of that
    fetch (0 = free, as on the zero-copy CPU path)."""

    forward_s: tuple[float, ...]
    state_bytes: tuple[int, ...]
    tape_bytes: tuple[int, ...]
    weight_bytes: tuple[int, ...] = ()
    bandwidth: float = 0.0
    host_bandwidth: float = 0.0
    """Bytes/s of copying a stage input to host memory and back (for ``offload``)."""

    def __post_init__(self) -> None:
        n = len(self.forward_s)
        if n < 1 or len(self.state_bytes) != n or len(self.tape_bytes) != n:
            raise PlanError("StageCosts needs forward_s, state_bytes and tape_bytes of one equal, non-zero length")
        if self.weight_bytes and len(self.weight_bytes) != n:
            raise PlanError("StageCosts.weight_bytes must have one entry per stage")

    @property
    def n(self) -> int:
        return len(self.forward_s)

    def for_micro_batches(self, k: int) -> StageCosts:
        """The costs of running every stage for ``k`` micro-batches at once (stage-major), from a
        profile of one: compute and stage inputs grow k-fold while the weights move once; in
        BACKWARD one micro-batch's tape is live at a time, next to every micro-batch's output
        gradient and input gradient (k - 1 more of each than with one micro-batch)."""
        if k == 1:
            return self
        n = self.n
        out_bytes = [self.state_bytes[i + 1] if i + 1 < n else 0 for i in range(n)]
        return dataclasses.replace(
            self,
            forward_s=tuple(f * k for f in self.forward_s),
            state_bytes=tuple(s * k for s in self.state_bytes),
            tape_bytes=tuple(t + (k - 1) * (s + o) for t, s, o in zip(self.tape_bytes, self.state_bytes, out_bytes)),
        )

    def advance_cost(self, i: int) -> float:
        """Seconds one recomputation of stage i costs: its forward and, streamed, its weights."""
        fetch = self.weight_bytes[i] / self.bandwidth if self.weight_bytes and self.bandwidth > 0 else 0.0
        return self.forward_s[i] + fetch


def min_budget(costs: StageCosts) -> int:
    """The least activation memory any plan needs: x_0 stays live throughout (it cannot be
    recomputed), each x_{j+1} is computed from x_j at least once, and each backward needs x_i
    and its tape. Keeping only x_0 and recomputing from it reaches this bound."""
    return _reverse_need(costs, 0, costs.n)


def optimal(costs: StageCosts, budget_bytes: int, *, resolution: int = 256) -> Plan:
    """The plan of least recomputation time whose activation memory stays within ``budget_bytes``.

    Dynamic program over (first stage a, end b, memory left): reverse [a, b) from the kept x_a
    either directly (b = a + 1) or by advancing to some k, keeping x_k, reversing [k, b) with the
    memory x_a leaves, then [a, k) (the structure of Beaumont et al.'s DP without the "keep the
    whole tape" option, which this executor does not have). Memory is counted in units of
    budget/``resolution``, rounding sizes up, so the plan always fits. O(n^3 * resolution)."""
    need = min_budget(costs)
    if budget_bytes < need:
        raise PlanError(
            f"a budget of {budget_bytes} bytes cannot hold this chain: the least any plan needs is "
            f"{need} bytes (x_0, one stage's input and output, and its tape)"
        )
    sizes = [*costs.state_bytes, *costs.tape_bytes]
    exact = math.gcd(*sizes) if any(sizes) else 1
    if exact and budget_bytes // exact <= 16 * resolution:
        return _optimal_in_units(costs, budget_bytes, exact, need)  # exact: every size is a multiple
    for res in (resolution, 4 * resolution, 16 * resolution):
        try:
            return _optimal_in_units(costs, budget_bytes, max(1, budget_bytes // res), need)
        except PlanError:
            continue
    raise PlanError(
        f"no plan fits {budget_bytes} bytes at a resolution of {16 * resolution} units; the least any plan "
        f"needs is {need} bytes: give a little more memory"
    )


class _ReverseDP:
    """The dynamic program behind :func:`optimal` (and the segments of :func:`offload`): the least
    recomputation time to reverse [a, b) from the kept x_a within ``mem`` units of memory (x_a's
    included), either directly (b = a + 1) or by advancing to some k, keeping x_k, reversing
    [k, b) with the memory x_a leaves, then [a, k). Sizes are rounded up to ``unit`` bytes."""

    def __init__(self, costs: StageCosts, unit: int) -> None:
        self.x = [-(-b // unit) for b in costs.state_bytes]
        self.tape = [-(-b // unit) for b in costs.tape_bytes]
        self.prefix = [0.0]
        for i in range(costs.n):
            self.prefix.append(self.prefix[-1] + costs.advance_cost(i))
        self.best = lru_cache(maxsize=None)(self._best)

    def _best(self, a: int, b: int, mem: int) -> tuple[float, int]:
        """(cost, split); split 0 means reverse directly."""
        x, tape = self.x, self.tape
        if b - a == 1:
            return (0.0, 0) if x[a] + tape[a] <= mem else (math.inf, -1)
        top: tuple[float, int] = (math.inf, -1)
        peak = x[a] + x[a + 1]  # advancing from x_a (kept and current) to x_{a+1}
        for k in range(a + 1, b):
            if k > a + 1:
                peak = max(peak, x[a] + x[k - 1] + x[k])
            if peak > mem:
                break
            right = self.best(k, b, mem - x[a])[0]
            if right == math.inf:
                continue
            left = self.best(a, k, mem)[0]
            total = self.prefix[k] - self.prefix[a] + right + left
            if total < top[0]:
                top = (total, k)
        return top

    def emit(self, a: int, b: int, mem: int, out: list[Action]) -> None:
        _, k = self.best(a, b, mem)
        if k == 0:
            out.append((Op.BACKWARD, a))
            return
        out.extend((Op.ADVANCE, i) for i in range(a, k))
        out.append((Op.SNAPSHOT, k))
        self.emit(k, b, mem - self.x[a], out)
        out += [(Op.FREE, k), (Op.RESTORE, a)]
        self.emit(a, k, mem, out)


@contextlib.contextmanager
def _deep_recursion(n: int) -> Iterator[None]:
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 10 * n + 1000))
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


def _optimal_in_units(costs: StageCosts, budget_bytes: int, unit: int, need: int) -> Plan:
    n = costs.n
    dp = _ReverseDP(costs, unit)
    budget = budget_bytes // unit
    with _deep_recursion(n):
        if dp.best(0, n, budget)[0] == math.inf:  # rounding up to units lost the last few bytes
            raise PlanError(f"no plan fits {budget_bytes} bytes in units of {unit} bytes (the least is {need})")
        actions: list[Action] = [(Op.SNAPSHOT, 0)]
        dp.emit(0, n, budget, actions)
        actions.append((Op.FREE, 0))
    return _plan("optimal", n, actions)


# ---- the checkpoint subset of least peak memory --------------------------------------------------
def segments_plan(n: int, bounds: Sequence[int], name: str = "segments") -> Plan:
    """Keep x at each of ``bounds`` (which starts with 0) in one forward sweep, then reverse the
    segments between them last to first, keeping every input inside the segment being reversed."""
    _check_n(n)
    if not bounds or bounds[0] != 0 or list(bounds) != sorted(set(bounds)) or bounds[-1] >= n:
        raise PlanError(f"bounds must start at 0 and increase below {n}, got {list(bounds)}")
    marks = [*bounds, n]
    actions: list[Action] = [(Op.SNAPSHOT, 0)]
    for a, b in zip(marks[:-2], marks[1:-1]):
        actions.extend((Op.ADVANCE, i) for i in range(a, b))
        actions.append((Op.SNAPSHOT, b))
    for j in range(len(marks) - 2, -1, -1):
        a, b = marks[j], marks[j + 1]
        if j < len(marks) - 2:
            actions.append((Op.RESTORE, a))
        _reverse_storing_all(a, b, actions.append)
        actions.append((Op.FREE, a))
    return _plan(name, n, actions)


def min_peak(costs: StageCosts) -> Plan:
    """The checkpoint subset whose plan (:func:`segments_plan`) has the least peak activation
    memory, by an O(n^2) dynamic program over the next kept input (after Hong et al., 2025).

    With K_j the bytes kept before segment j = [a, b), reversing it peaks at
    K_j + max_i (x_{a+1} + .. + x_i + tape_i) over i in [a, b), and the forward sweep through it at
    K_j + x_j + x_{j+1} (x_a not counted twice); G(p) = x_p + min_q max(peak of [p, q), G(q))."""
    n, x, tape = costs.n, costs.state_bytes, costs.tape_bytes
    inf = math.inf
    g: list[float] = [inf] * (n + 1)
    nxt: list[int] = [n] * (n + 1)
    for p in range(n - 1, -1, -1):
        best_val, best_q = inf, n
        inner = 0  # x_{p+1} + .. + x_{q-1}
        seg = 0  # max over i in [p, q) of (x_{p+1} + .. + x_i + tape_i)
        fwd = 0  # max over j in [p, q-1) of the forward sweep's x_j + x_{j+1} (x_p is kept)
        for q in range(p + 1, n + 1):
            i = q - 1
            seg = max(seg, inner + (x[i] if i > p else 0) + tape[i])
            inner += x[i] if i > p else 0
            if q == n:
                val = seg
            else:
                fwd = max(fwd, (x[i] if i > p else 0) + x[q])
                val = max(seg, fwd, g[q])
            if val < best_val:
                best_val, best_q = val, q
        g[p] = x[p] + best_val
        nxt[p] = best_q
    bounds = [0]
    while nxt[bounds[-1]] < n:
        bounds.append(nxt[bounds[-1]])
    return segments_plan(n, bounds, "min_peak")


def auto(costs: StageCosts, budget_bytes: int) -> Plan:
    """The fastest plan, by the cost model, among every planner's whose activation memory fits
    ``budget_bytes`` (checked exactly with :func:`simulate`), ``offload`` included when the costs
    give a host bandwidth. Named ``auto(<chosen>)``."""
    n = costs.n
    need = min_budget(costs)
    if budget_bytes < need:
        raise PlanError(f"a budget of {budget_bytes} bytes cannot hold this chain: the least any plan needs is {need} bytes")
    candidates = [store_all(n), sqrt_segments(n), sqrt_segments(n, recursive=True), divide_and_conquer(n), min_peak(costs)]
    candidates += [revolve(n, k) for k in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if k < n]
    try:
        candidates.append(optimal(costs, budget_bytes))
    except PlanError:
        pass  # rounding to memory units can lose a bound-hugging budget; the others still compete
    if costs.host_bandwidth > 0:  # host memory is there too: its copies run beside compute
        try:
            candidates.append(offload(costs, budget_bytes))
        except PlanError:
            pass
    fits = []
    for plan in candidates:
        peak = simulate(n, plan.actions, state_bytes=costs.state_bytes, tape_bytes=costs.tape_bytes).peak_bytes
        if peak <= budget_bytes:
            fits.append((plan_time(costs, plan), plan.advances, peak, plan.name, plan))
    if not fits:
        raise PlanError(f"no plan fits {budget_bytes} bytes (the least any plan needs is {need} bytes)")
    best = min(fits, key=lambda f: f[:4])[-1]
    return Plan(f"auto({best.name})", n, best.actions, best.advances, best.peak_slots, best.peak_states)


# ---- asynchronous multistage checkpointing: offload to host memory --------------------------------
def offload_spacing(costs: StageCosts, bandwidth: float) -> int:
    """The smallest k such that copying one stage input to the host (at ``bandwidth`` bytes/s)
    takes no longer than running k stages (each the longer of its forward and its weight fetch):
    offloading every k-th input keeps up with compute."""
    if bandwidth <= 0:
        raise PlanError(f"offload needs a host transfer bandwidth > 0 bytes/s, got {bandwidth}")
    per_stage = sum(max(costs.forward_s[i], costs.advance_cost(i) - costs.forward_s[i]) for i in range(costs.n))
    per_stage /= costs.n
    copy = max(costs.state_bytes) / bandwidth
    return max(1, math.ceil(copy / per_stage - 1e-9)) if per_stage > 0 else 1


def _reverse_need(costs: StageCosts, a: int, b: int) -> int:
    """The least memory that reverses the sub-chain [a, b) from a kept x_a (see :func:`min_budget`)."""
    x, tape = costs.state_bytes, costs.tape_bytes
    need = x[a] + tape[a] if b - a == 1 else max(x[a] + tape[a], x[a] + x[a + 1])
    for j in range(a + 1, b):
        need = max(need, x[a] + x[j] + tape[j])
        if j + 1 < b:
            need = max(need, x[a] + x[j] + x[j + 1])
    return need


def offload(
    costs: StageCosts,
    budget_bytes: int,
    bandwidth: float | None = None,
    *,
    spacing: int | None = None,
    resolution: int = 256,
) -> Plan:
    """Asynchronous multistage checkpointing (after Kukreja, Hueckelheim and Gorman, 2018).

    Forward: one sweep that offloads every ``spacing``-th input to host memory (by default as
    often as the transfer keeps up with compute: :func:`offload_spacing`). Backward: segment by
    segment from the last, the next segment's start is prefetched ahead while the current one is
    reversed in the device memory the budget leaves, by the dynamic program of :func:`optimal`
    (least recomputation time, weight fetches included; on equal stages it recomputes as Revolve
    does). Recomputation per stage depends on the spacing and the budget only, so it is the same
    for any n."""
    n = costs.n
    bw = bandwidth if bandwidth is not None else costs.host_bandwidth
    k = spacing if spacing is not None else offload_spacing(costs, bw)
    if k < 1:
        raise PlanError(f"spacing must be >= 1, got {k}")
    starts = list(range(0, n, k))
    ends = [*starts[1:], n]
    x = costs.state_bytes
    # device memory: during the forward sweep the current and next inputs and the source of an
    # offload still copying; in backward a segment's reversal plus the next start arriving
    need = max(x[i] + x[i + 1] + x[s] for s, e in zip(starts, ends) for i in range(s, min(e, n - 1))) if n > 1 else 0
    for j, (s0, e0) in enumerate(zip(starts, ends)):
        need = max(need, _reverse_need(costs, s0, e0) + (x[starts[j - 1]] if j > 0 else 0))
    if budget_bytes < need:
        raise PlanError(
            f"a budget of {budget_bytes} bytes cannot hold the offload plan: it needs at least {need} bytes "
            "(a segment's start, the current input and the next or a tape, and the next segment's start)"
        )
    sizes = [*costs.state_bytes, *costs.tape_bytes]
    exact = math.gcd(*sizes) if any(sizes) else 1
    unit = exact if exact and budget_bytes // exact <= 16 * resolution else max(1, budget_bytes // (16 * resolution))
    dp = _ReverseDP(costs, unit)
    budget = budget_bytes // unit
    actions: list[Action] = []
    for j, s0 in enumerate(starts):  # the forward sweep, offloading segment starts
        actions.append((Op.OFFLOAD, s0))
        if j + 1 < len(starts):
            actions.extend((Op.ADVANCE, i) for i in range(s0, ends[j]))
    last = len(starts) - 1
    actions.append((Op.SNAPSHOT, starts[last]))
    with _deep_recursion(k):
        for j in range(last, -1, -1):
            s0, e0 = starts[j], ends[j]
            mem = budget
            if j > 0:
                actions.append((Op.PREFETCH, starts[j - 1]))  # overlaps this segment's reversal
                mem -= dp.x[starts[j - 1]]
            if dp.best(s0, e0, mem)[0] == math.inf:
                raise PlanError(
                    f"no offload plan fits {budget_bytes} bytes in units of {unit} bytes (the least is {need})"
                )
            dp.emit(s0, e0, mem, actions)
            actions += [(Op.FREE, s0), (Op.FREE_HOST, s0)]
            if j > 0:
                actions.append((Op.RESTORE, starts[j - 1]))
    return _plan("offload", n, actions)


def plan_time(costs: StageCosts, plan: Plan) -> float:
    """Seconds of recomputation ``plan`` costs under ``costs``."""
    return sum(costs.advance_cost(i) for op, i in plan.actions if op == Op.ADVANCE)
