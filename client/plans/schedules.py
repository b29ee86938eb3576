"""Count-based schedules: plans that depend on the number of stages ``n`` (and a slot count) only,
not on what the stages cost.

``store_all`` (n-1 advances, the least possible), ``sqrt_segments`` (Chen et al. 2016),
``divide_and_conquer`` (bisection, Siskind and Pearlmutter), ``revolve`` (binomial checkpointing,
Griewank and Walther: the proven least recomputation for a slot count, with :func:`beta`,
:func:`revolve_cost` and :func:`revolve_cost_dp` for its counts), ``OnlineBisection`` (a chain
whose length is learned while it runs) and ``segments_plan`` (keep a given subset of inputs; the
byte-budget planner ``min_peak`` chooses that subset). The planners that read a profile are in
:mod:`.budget`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import lru_cache

from .plan import Action, Op, Plan, PlanError
from .simulate import Simulation, checked_plan, simulate


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
    return checked_plan("store_all", n, actions)


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
    ``recursive=True`` a segment is itself split the same way (into ceil(sqrt len) parts) until it
    is at most 2 stages long: about sqrt n + n^(1/4) + n^(1/8) + ... kept inputs, so Theta(sqrt n)
    memory but about half the flat variant's (113 against 198 at n = 10^4), for about
    n * log2(log2 n) recomputed forwards (3.2 n at 10^4, against n). Not O(log n): a constant
    number of parts per level is what gives that (Chen et al.'s recursion), which is ``"dnc"``
    (bisection)."""
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
    return checked_plan("sqrt_recursive" if recursive else "sqrt", n, actions)


# ---- divide and conquer: bisection (Siskind and Pearlmutter) --------------------------------------
def divide_and_conquer(n: int) -> Plan:
    """Bisection: keep the midpoint, reverse the right half, then the left. For n = 2^k it costs
    (n/2) log2 n advances with log2 n + 1 slots."""
    _check_n(n)
    actions: list[Action] = [(Op.SNAPSHOT, 0)]
    _bisect(0, n, actions.append)
    actions.append((Op.FREE, 0))
    return checked_plan("dnc", n, actions)


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
    return checked_plan("revolve", n, actions)


def _revolve_emit(a: int, b: int, slots: int, emit: Callable[[Action], None]) -> None:
    """Reverse [a, b) from the kept current state x_a with ``slots`` slots in all (x_a's included),
    splitting as p(l, s) = k + p(l-k, s-1) + p(k, s) with k from :func:`_revolve_split`.

    The recursion runs on an explicit stack: its right branch nests once per slot, and a long
    chain may be given thousands of slots."""
    Call = tuple[int, int, int]
    todo: list[Call | Action] = [(a, b, slots)]
    while todo:
        item = todo.pop()
        if len(item) == 2:
            emit(item)  # type: ignore[arg-type]
            continue
        a, b, slots = item  # type: ignore[misc]
        m = b - a
        if m == 1:
            emit((Op.BACKWARD, a))
            continue
        if slots == 1:  # only x_a is kept: advance from it for every stage, last first
            for end in range(b, a, -1):
                emit((Op.RESTORE, a))
                for i in range(a, end - 1):
                    emit((Op.ADVANCE, i))
                emit((Op.BACKWARD, end - 1))
            continue
        k = _revolve_split(m, slots)
        for i in range(a, a + k):
            emit((Op.ADVANCE, i))
        emit((Op.SNAPSHOT, a + k))
        # then, in this order: reverse [a+k, b) with a slot less, free x_{a+k}, restore x_a, reverse [a, a+k)
        todo += [(a, a + k, slots), (Op.RESTORE, a), (Op.FREE, a + k), (a + k, b, slots - 1)]


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
        self.simulation: Simulation | None = None
        """The counts of the whole plan, once :meth:`finish` has made it."""

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
        self.simulation = simulate(n, [a for a in self.actions if a[1] != n or a[0] == Op.ADVANCE])
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


# ---- a given subset of kept inputs (min_peak in .budget chooses one) ---------------------------------
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
    return checked_plan(name, n, actions)
