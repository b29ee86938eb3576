"""The dynamic program behind :func:`~.budget.optimal`: least recomputation time over *nested*
schedules, which may free a kept input before its own stage is reversed and recompute it later,
within a byte budget.

NOTE [Nested schedules]
=======================
Cost model (that of :mod:`.simulate`, which replays every plan): memory is the kept inputs, plus
the current input when it is not kept, plus x_{i+1} during ADVANCE i or tape_i during BACKWARD i;
a plan costs the sum over its ADVANCEs of ``StageCosts.advance_cost`` (forward seconds plus
weight bytes / bandwidth).

1. A kept input x_a is an *anchor*. An anchor *serves* a range of stages [c, e), c >= a: it
   reverses them (BACKWARD e-1 .. c) and is then freed. The root anchor x_0 serves [0, n).
2. An anchor cuts its range into segments, highest first. Each segment is reversed
   * *directly*: each stage i by a sweep ADVANCE a .. i-1, then BACKWARD i (i = a: BACKWARD a);
   * *densely*: one sweep from x_a keeping every input of the segment, then its BACKWARDs;
   * by a *child*: a sweep to some k (a < k <= the segment's start), SNAPSHOT k, and x_k serves
     the segment with the memory x_a leaves (x_a stays kept meanwhile);
   * the lowest segment (the one holding c) only, when c > a: by a *hand-over*: a sweep to some
     k <= c, SNAPSHOT k, FREE a, and x_k serves the segment with all of x_a's memory.
3. A *persistent* schedule (every kept input stays until its own stage is reversed: Revolve; the
   DP of Beaumont et al., "Optimal checkpointing for heterogeneous chains", arXiv 1911.13214) is
   the case c = a everywhere. A child serving [c', e) with c' > k is freed before BACKWARD k and
   x_k is recomputed later from its parent; a hand-over frees the parent early. Issue 18's chain
   (x = 1, 1, 2, 1; tapes 0, 0, 2, 2; budget 5): x_1 serves [2, 4) (BACKWARD 3, then a hand-over
   to x_2 that frees x_1 before BACKWARD 2) and x_0 serves [0, 2): 5 advances, where every
   persistent schedule needs 6.
4. States: S(a, c, e) (anchor a serves [c, e)) and SEG(a, c', e) (segment [c', e) while x_a stays
   kept), each a *curve*: the least cost for every amount of memory. O(W^3) states of O(W)
   choices for W units: O(W^4 * L) time for L memory levels. The states of one (a, e) do not
   depend on each other and are computed in one numpy pass. An exhaustive search over every
   executor schedule (:mod:`.search`; tests/test_optimal.py has its own) has found no schedule
   cheaper than the best nested one on any chain tried; it is not proven that none exists.
5. Long chains (more than ``FLAT_STAGES`` stages) are planned over *blocks* of consecutive stages:
   a block's curve is the DP over its stages (its reversal from its kept first input), and the
   DP runs again over blocks, a block being one unit with that curve, while direct and dense
   segments still sweep stage by stage (so x_0 alone can always reverse the chain, and the least
   budget is never refused). Blocks are grouped again until at most ``FLAT_STAGES`` units are
   left for the top DP, the levels as even as their count (log base ``GROUP`` of n / 36) allows,
   so that the top DP, which chooses the first sweep's kept inputs, stays wide; up to 400 stages
   blocks of ``GROUP`` stages are tried too and the cheaper plan wins. Stages that leave no room
   beside x_0 for any other kept input get blocks of their own. While a block is reversed the
   only other kept inputs are block starts: the class is nested schedules with that restriction.
   O(n * b^3 * L) time for blocks of b units, plus the top DP's 36^4 * L.
6. Memory: the chain is planned in units of the gcd of all sizes (exact), and every curve on a
   grid of at most L = ``resolution`` + 1 levels (:func:`default_resolution`: 256, more on short
   chains) from the state's exact least memory up, its step
   the least power of two (in gcd units) that reaches the budget: 1, exact, where the budget is
   at most L - 1 units above the least. A part reads its curve at the level below the memory it
   gets (plans always fit); emission re-evaluates each state at the exact memory it has. The
   least memory of every state is exact, so the root's is the least budget; a plan at budget B
   costs at most the best nested one at B - (3n + 2) * the coarsest step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .costs import StageCosts
from .plan import Action, Op

FLAT_STAGES = 36
"""Chains up to this many stages are planned by one DP over all of them (no blocks)."""
GROUP = 12
"""Blocks and groups of blocks hold about this many units in longer chains."""

_NO_MEM = 1 << 62  # the least memory of a state no memory makes feasible


def default_resolution(n: int) -> int:
    """Memory levels per curve when none is asked for: 256, and on short chains as many more (up
    to 4,096) as keep the flat DP's O(n^4 * levels) work at a quarter of a 36-stage chain's, since
    rounding loses most on a few coarse steps (BENCHMARKS.md)."""
    units = min(n, FLAT_STAGES)
    return max(256, min(4096, FLAT_STAGES**4 * 64 // max(units, 1) ** 4))


class _Sparse:
    """Range maxima in O(1) after O(n log n) preprocessing."""

    def __init__(self, values: Sequence[int]) -> None:
        self.levels = [np.asarray(values, dtype=np.int64)]
        width = 1
        while 2 * width <= len(values):
            prev = self.levels[-1]
            self.levels.append(np.maximum(prev[: len(prev) - width], prev[width:]))
            width *= 2

    def max(self, lo: int, hi: int) -> int:
        """max(values[lo:hi]) for lo < hi."""
        k = (hi - lo).bit_length() - 1
        level = self.levels[k]
        return int(max(level[lo], level[hi - (1 << k)]))


class _Chain:
    """The fine chain: prefix sums of recomputation cost and range maxima of the sizes, so that
    sweeps and direct segments between any two positions are priced in O(1)."""

    def __init__(self, costs: StageCosts) -> None:
        n = costs.n
        self.n = n
        self.x = [int(v) for v in costs.state_bytes]
        self.xt = [int(v) + int(t) for v, t in zip(costs.state_bytes, costs.tape_bytes)]
        pre = [0.0]
        for i in range(n):
            pre.append(pre[-1] + costs.advance_cost(i))
        self.pre = pre
        pre2 = [0.0]
        for i in range(n + 1):
            pre2.append(pre2[-1] + pre[i])
        self.pre2 = pre2  # pre2[i] = pre[0] + .. + pre[i-1]
        self.pairs = _Sparse([self.x[j] + self.x[j + 1] for j in range(n - 1)] or [0])
        self.xts = _Sparse(self.xt)
        px = [0]
        for v in self.x:
            px.append(px[-1] + v)
        self.px = px  # px[i] = x_0 + .. + x_{i-1}
        self.kept_tape = _Sparse([px[i + 1] + int(t) for i, t in enumerate(costs.tape_bytes)])

    def cost(self, a: int, k: int) -> float:
        """Seconds of the sweep ADVANCE a .. k-1."""
        return self.pre[k] - self.pre[a]

    def peak(self, a: int, k: int) -> int:
        """Memory of the sweep from the kept x_a to x_k (k > a): x_a with each step's input and output."""
        x = self.x
        p = x[a] + x[a + 1]
        if k > a + 1:
            p = max(p, x[a] + self.pairs.max(a + 1, k))
        return p

    def direct(self, a: int, c: int, e: int) -> tuple[float, int]:
        """(cost, memory) of the kept x_a reversing stages [c, e) (c >= a) each by its own sweep."""
        cost = (self.pre2[e] - self.pre2[c]) - (e - c) * self.pre[a]
        need = self.peak(a, e - 1) if e - 1 > a else 0
        lo = max(c, a + 1)
        if lo < e:
            need = max(need, self.x[a] + self.xts.max(lo, e))
        if c == a:
            need = max(need, self.xt[a])
        return cost, need

    def dense(self, a: int, c: int, e: int) -> tuple[float, int]:
        """(cost, memory) of the kept x_a sweeping to x_{e-1} keeping every input from x_c on,
        then reversing [c, e) from them (c >= a): each stage there advanced once."""
        px = self.px
        base = (self.x[a] if c > a else 0) - px[c]  # kept before x_c's range, less the range's start
        need = base + px[e]  # the last advance holds x_c .. x_{e-1} (x_{e-1} as its output)
        if e - 1 == c:
            need = 0
        if c > a:
            need = max(need, self.peak(a, c))
        need = max(need, base + self.kept_tape.max(c, e))  # BACKWARD i with x_c .. x_i kept
        return self.cost(a, e - 1), need


@dataclass(frozen=True, slots=True)
class _Grid:
    """The memory grids of the curves, in units of the sizes' gcd (the chain is planned divided
    by it): level j of a state is its least memory + j << its shift, where the shift is the
    least that lets ``levels`` levels reach the budget (0, exact, when the span allows)."""

    budget: int
    levels: int

    def shift(self, least: np.ndarray) -> np.ndarray:
        span = np.maximum(self.budget - least, 0)
        steps = -(-span // (self.levels - 1))  # the unit that reaches, rounded up to a power of 2
        return np.ceil(np.log2(np.maximum(steps, 1))).astype(np.int64)


@dataclass(slots=True)
class _Curve:
    """Least cost for each memory level, from ``least`` up by 1 << ``shift`` (inf where nothing fits)."""

    least: int
    shift: int
    values: np.ndarray


# kinds of choice (NOTE [Nested schedules]): a part is a row of the table, "no part" the zero row
_DIRECT, _DENSE, _UNIT, _CHILD, _HANDOVER, _WHOLE, _SPLIT = range(7)


@dataclass(slots=True)
class _Choices:
    """The choices of a batch of states, as arrays: which target state each is for, its kind and
    parameter (k or c'), a constant cost, and two parts: rows of the table, each read with
    ``delta`` bytes less than the state has. A bound without a sub-problem (a sweep's peak, a
    closed-form segment's memory) is the zero row read with ``delta`` = that many bytes: 0 where
    they fit, inf where not."""

    target: np.ndarray
    kind: np.ndarray
    param: np.ndarray
    const: np.ndarray
    row1: np.ndarray
    delta1: np.ndarray
    row2: np.ndarray
    delta2: np.ndarray

    def only(self, target: int) -> _Choices:
        keep = self.target == target
        return _Choices(*(getattr(self, f)[keep] for f in self.__slots__))  # type: ignore[attr-defined]


def _concat(parts: list[tuple[np.ndarray, ...]]) -> _Choices:
    cols = [np.concatenate([np.asarray(p[i]) for p in parts]) for i in range(8)]
    order = np.argsort(cols[0], kind="stable")
    return _Choices(*(col[order] for col in cols))


_PAIRS: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _pairs(m: int) -> tuple[np.ndarray, np.ndarray]:
    """(i, j) with 0 <= j <= i < m, by i: cached lower-triangle indices."""
    if m not in _PAIRS:
        _PAIRS[m] = np.tril_indices(m)
    return _PAIRS[m]


class _Group:
    """The nested DP over one run of units (single stages, or blocks with their curves).

    Units are [bounds[J], bounds[J+1]) in fine positions; ``units[J]`` is None for a single
    stage, else the :class:`_Group` that reverses that block. One table holds every state's
    curve: row 0 is all zeros (the absent part), then one row per unit, then S(a, c, e), then
    SEG(a, c, e). All states of one (a, e) are computed together (they do not depend on each
    other), a descending and e ascending, SEG before S."""

    def __init__(self, chain: _Chain, grid: _Grid, bounds: list[int], units: list[_Group | None]) -> None:
        self.chain, self.grid, self.bounds, self.units = chain, grid, bounds, units
        self.w = len(units)
        self._solve()
        self._curve = self.curve()

    def release(self) -> None:
        """Drop the tables (a block's curve is all its parent needs until the plan is emitted;
        :meth:`emit_s` solves again if it must)."""
        for name in ("table", "least", "shift", "s_row", "seg_row", "flat", "flat_need", "cost", "peak", "_buf"):
            if hasattr(self, name):
                delattr(self, name)

    def _solve(self) -> None:
        chain, grid, bounds, units, w = self.chain, self.grid, self.bounds, self.units, self.w
        size = (w + 1, w + 1, w + 1)
        self.s_row = np.zeros(size, dtype=np.int64)
        self.seg_row = np.zeros(size, dtype=np.int64)
        self.flat = np.zeros((2, *size))  # direct and dense segments: cost
        self.flat_need = np.full((2, *size), _NO_MEM, dtype=np.int64)
        rows = 1 + w
        for a in range(w):
            for e in range(a + 1, w + 1):
                for c in range(a, e):
                    self.s_row[a, c, e] = rows
                    rows += 1
                    for f, (cost, need) in enumerate((self._direct(a, c, e), self._dense(a, c, e))):
                        self.flat[f, a, c, e], self.flat_need[f, a, c, e] = cost, need
                for c in range(a + 1, e):
                    self.seg_row[a, c, e] = rows
                    rows += 1
        self.table = np.full((rows, grid.levels + 1), math.inf)  # the last column stays inf
        self.table[0, :-1] = 0.0
        self.least = np.full(rows, _NO_MEM, dtype=np.int64)
        self.least[0] = 0
        self.shift = np.zeros(rows, dtype=np.int64)  # the zero row's: unit 1 (its bounds are exact)
        pos = bounds
        self.cost = np.zeros((w + 1, w + 1))
        self.peak = np.full((w + 1, w + 1), _NO_MEM, dtype=np.int64)
        for a in range(w):
            for k in range(a + 1, w):
                self.cost[a, k] = chain.cost(pos[a], pos[k])
                self.peak[a, k] = chain.peak(pos[a], pos[k])
        self._lv = np.arange(grid.levels)
        self._buf = (np.empty((0, grid.levels), np.int64),) * 2 + (np.empty((0, grid.levels)),) * 2
        for j, unit in enumerate(units):
            if unit is not None:
                curve = unit._curve
                self.least[1 + j] = curve.least
                self.shift[1 + j] = curve.shift
                self.table[1 + j, :-1] = curve.values
        for a in range(w - 1, -1, -1):
            for e in range(a + 1, w + 1):
                if e > a + 1:
                    cs = np.arange(a + 1, e)
                    self._store(self.seg_row[a, cs, e], self._seg_choices(a, cs, e))
                cs = np.arange(a, e)
                self._store(self.s_row[a, cs, e], self._s_choices(a, cs, e))

    def _direct(self, a: int, c: int, e: int) -> tuple[float, int]:
        pos = self.bounds
        return self.chain.direct(pos[a], pos[c], pos[e])

    def _dense(self, a: int, c: int, e: int) -> tuple[float, int]:
        pos = self.bounds
        return self.chain.dense(pos[a], pos[c], pos[e])

    # ---- the choices of a batch of states (one anchor a, one end e, service starts cs) ----
    def _flat_choices(self, a: int, cs: np.ndarray, e: int, t: np.ndarray) -> list[tuple[np.ndarray, ...]]:
        zero = np.zeros(len(cs), dtype=np.int64)
        return [
            (t, zero + f, zero, self.flat[f, a, cs, e], zero, self.flat_need[f, a, cs, e], zero, zero)
            for f in (_DIRECT, _DENSE)
        ]

    def _seg_choices(self, a: int, cs: np.ndarray, e: int) -> _Choices:
        """SEG(a, c, e) for c in cs (all > a): x_a stays kept while [c, e) is reversed, directly,
        densely, or by a child x_k, a < k <= c, with the memory x_a leaves."""
        t = np.arange(len(cs))
        out = self._flat_choices(a, cs, e, t)
        i, j = _pairs(len(cs))  # target i (c = cs[i]), child k = a + 1 + j <= c
        k = a + 1 + j
        c = cs[i]
        xa = self.chain.x[self.bounds[a]]
        out.append((t[i], np.full(len(k), _CHILD), k, self.cost[a, k], self.s_row[k, c, e],
                    np.full(len(k), xa, dtype=np.int64), np.zeros(len(k), dtype=np.int64), self.peak[a, k]))
        return _concat(out)

    def _s_choices(self, a: int, cs: np.ndarray, e: int) -> _Choices:
        """S(a, c, e) for c in cs (>= a): x_a serves [c, e) and is freed."""
        t = np.arange(len(cs))
        zero = np.zeros(len(cs), dtype=np.int64)
        out = self._flat_choices(a, cs, e, t)
        if e == a + 1 and self.units[a] is not None:  # a block: its own curve
            out.append((t[:1], zero[:1] + _UNIT, zero[:1], np.zeros(1), zero[:1] + 1 + a, zero[:1], zero[:1], zero[:1]))
        if len(cs) > 1:  # c > a: hand over to x_k, a < k <= c, freeing x_a; or one segment for all
            i, j = _pairs(len(cs) - 1)
            k = a + 1 + j
            c = cs[1:][i]
            n2 = len(k)
            out.append((t[1:][i], np.full(n2, _HANDOVER), k, self.cost[a, k], self.s_row[k, c, e],
                        np.zeros(n2, dtype=np.int64), np.zeros(n2, dtype=np.int64), self.peak[a, k]))
            out.append((t[1:], zero[1:] + _WHOLE, zero[1:], np.zeros(len(cs) - 1), self.seg_row[a, cs[1:], e],
                        zero[1:], zero[1:], zero[1:]))
        if e - a >= 2:  # the highest segment [c', e) (c < c' < e), then the rest [c, c')
            j, i = _pairs(e - a)  # c = a + i < c' = a + j < e
            keep = i < j
            i, j = i[keep], j[keep]
            c, c2 = a + i, a + j
            n3 = len(c)
            z = np.zeros(n3, dtype=np.int64)
            out.append((i, z + _SPLIT, c2, np.zeros(n3), self.seg_row[a, c2, e], z, self.s_row[a, c, c2], z))
        return _concat(out)

    # ---- evaluation ----
    def _need(self, ch: _Choices) -> np.ndarray:
        least = self.least
        return np.maximum(least[ch.row1] + ch.delta1, least[ch.row2] + ch.delta2)

    def _scratch(self, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Work arrays for ``count`` choices, reused across batches: a fresh array of this size
        per operation would be mapped and faulted in anew each time (allocations past glibc's
        mmap threshold), which costs more than the arithmetic."""
        if count > len(self._buf[0]):
            shape = (max(count, 2 * len(self._buf[0])), self.grid.levels)
            self._buf = (np.empty(shape, np.int64), np.empty(shape, np.int64), np.empty(shape), np.empty(shape))
        return tuple(b[:count] for b in self._buf)  # type: ignore[return-value]

    def _store(self, rows: np.ndarray, ch: _Choices) -> None:
        need = self._need(ch)
        starts = np.searchsorted(ch.target, np.arange(len(rows)))
        least_t = np.minimum.reduceat(need, starts)
        self.least[rows] = least_t
        self.shift[rows] = shift_t = self.grid.shift(least_t)
        keep = need <= self.grid.budget  # no state ever has more
        if not keep.all():
            ch = _Choices(*(getattr(ch, f)[keep] for f in _Choices.__slots__))  # type: ignore[attr-defined]
            if len(ch.target) == 0:
                return
            starts = np.searchsorted(ch.target, np.arange(len(rows)))
        top = self.grid.levels - 1
        width = self.grid.levels + 1
        flat = self.table.reshape(-1)
        mem, idx, got, vals = self._scratch(len(ch.target))
        np.left_shift(self._lv[None, :], shift_t[ch.target][:, None], out=mem)
        mem += least_t[ch.target][:, None]  # the bytes of each level of each choice's state
        for part, (row, delta) in enumerate(((ch.row1, ch.delta1), (ch.row2, ch.delta2))):
            np.subtract(mem, (delta + self.least[row])[:, None], out=idx)
            np.right_shift(idx, self.shift[row][:, None], out=idx)  # the part's level: floor
            np.maximum(idx, -1, out=idx)  # -1: the inf column below the part's least
            np.minimum(idx, top, out=idx)
            idx += (row * width)[:, None]
            np.take(flat, idx, out=vals if part == 0 else got)
        vals += got
        vals += ch.const[:, None]
        present = np.zeros(len(rows), dtype=bool)
        present[ch.target] = True
        if present.all():
            self.table[rows, :-1] = np.minimum.reduceat(vals, starts, axis=0)
        else:
            best = np.minimum.reduceat(vals, np.minimum(starts, len(vals) - 1), axis=0)
            self.table[rows[present], :-1] = best[present]

    def curve(self) -> _Curve:
        """The curve of S(0, 0, w): this run reversed from its kept first input."""
        row = int(self.s_row[0, 0, self.w])
        return _Curve(int(self.least[row]), int(self.shift[row]), self.table[row, :-1].copy())

    # ---- emission ----
    def _pick(self, ch: _Choices, mem: int) -> tuple[int, int, float]:
        """The cheapest choice (kind, parameter, cost) of one state given exactly ``mem`` bytes:
        parts read at the grid level below the memory each gets. At least as cheap as the
        state's table at ``mem`` (whose level rounds ``mem`` down once more)."""
        top = self.grid.levels - 1
        vals = ch.const.copy()
        for r, delta in ((ch.row1, ch.delta1), (ch.row2, ch.delta2)):
            vals += self.table[r, np.minimum(np.maximum((mem - delta - self.least[r]) >> self.shift[r], -1), top)]
        best = int(np.argmin(vals))
        if not vals[best] < math.inf:
            raise AssertionError("a state got less memory than it needs: a bug in wstream's planner")
        return int(ch.kind[best]), int(ch.param[best]), float(vals[best])

    def root_cost(self, mem: int) -> float:
        """The cost :meth:`emit_s` of the whole run with ``mem`` bytes starts from."""
        if not hasattr(self, "table"):
            self._solve()
        return self._pick(self._s_choices(0, np.arange(0, 1), self.w).only(0), mem)[2]

    def emit_s(self, a: int, c: int, e: int, mem: int, out: list[Action]) -> None:
        """Actions of S(a, c, e) with ``mem`` bytes: x_{bounds[a]} is kept and current on entry
        and freed on exit."""
        if not hasattr(self, "table"):
            self._solve()
        pa = self.bounds[a]
        cs = np.arange(a, c + 1)  # the batch's builder wants every c from a; pick c's own rows
        kind, param, _ = self._pick(self._s_choices(a, cs, e).only(c - a), mem)
        if kind == _UNIT:
            unit = self.units[a]
            assert unit is not None
            unit.emit_s(0, 0, unit.w, mem, out)
            unit.release()
        elif kind in (_DIRECT, _DENSE):
            self._emit_flat(kind, a, c, e, out)
            out.append((Op.FREE, pa))
        elif kind == _WHOLE:
            self.emit_seg(a, c, e, mem, out)
            out.append((Op.FREE, pa))
        elif kind == _HANDOVER:
            self._sweep(a, param, out)
            out.append((Op.FREE, pa))
            self.emit_s(param, c, e, mem, out)
        else:
            self.emit_seg(a, param, e, mem, out)
            self.emit_s(a, c, param, mem, out)

    def emit_seg(self, a: int, c: int, e: int, mem: int, out: list[Action]) -> None:
        """Actions of SEG(a, c, e): x_{bounds[a]} is kept on entry and stays kept."""
        kind, param, _ = self._pick(self._seg_choices(a, np.arange(a + 1, c + 1), e).only(c - a - 1), mem)
        if kind in (_DIRECT, _DENSE):
            self._emit_flat(kind, a, c, e, out)
        else:
            self._sweep(a, param, out)
            self.emit_s(param, c, e, mem - self.chain.x[self.bounds[a]], out)

    def _sweep(self, a: int, k: int, out: list[Action]) -> None:
        """From the kept x_{bounds[a]}, compute and keep x_{bounds[k]}."""
        pa, pk = self.bounds[a], self.bounds[k]
        out.append((Op.RESTORE, pa))
        out.extend((Op.ADVANCE, i) for i in range(pa, pk))
        out.append((Op.SNAPSHOT, pk))

    def _emit_flat(self, kind: int, a: int, c: int, e: int, out: list[Action]) -> None:
        """A direct segment (a sweep from x_a before each BACKWARD) or a dense one (one sweep
        keeping every input of [c, e), then the BACKWARDs)."""
        pa, pc, pe = self.bounds[a], self.bounds[c], self.bounds[e]
        if kind == _DIRECT:
            for i in range(pe - 1, pc - 1, -1):
                out.append((Op.RESTORE, pa))
                out.extend((Op.ADVANCE, s) for s in range(pa, i))
                out.append((Op.BACKWARD, i))
            return
        out.append((Op.RESTORE, pa))
        out.extend((Op.ADVANCE, i) for i in range(pa, pc))
        for i in range(pc, pe - 1):
            if i != pa:
                out.append((Op.SNAPSHOT, i))
            out.append((Op.ADVANCE, i))
        out.append((Op.BACKWARD, pe - 1))
        for i in range(pe - 2, pc - 1, -1):
            out += [(Op.RESTORE, i), (Op.BACKWARD, i)]
            if i != pa:
                out.append((Op.FREE, i))


def _grid(chain: _Chain, budget: int, resolution: int) -> _Grid:
    """``resolution`` + 1 levels per curve at most (fewer when the widest span needs fewer)."""
    widest = max(budget - min(chain.xt), 0)  # no state needs less than one stage's input and tape
    return _Grid(budget, max(1, min(resolution, widest)) + 1)


def _blocks(x: Sequence[int], lo: int, hi: int, size: int, breaks: Sequence[int] = ()) -> list[int]:
    """Boundaries cutting [lo, hi) into runs of about ``size`` positions, each moved (within a
    quarter of ``size``) to the smallest input near it (block starts become kept inputs), and
    cut at every position of ``breaks`` too."""
    forced = sorted({b for b in breaks if lo < b < hi})
    bounds = [lo]
    for stop in [*forced, hi]:
        start = bounds[-1]
        count = max(1, round((stop - start) / size))
        for b in range(1, count):
            target = start + (stop - start) * b // count
            reach = size // 4
            window = range(max(bounds[-1] + 1, target - reach), min(stop - 1, target + reach) + 1)
            best = min(window, key=lambda p: (x[p], abs(p - target)), default=target)
            if best > bounds[-1]:
                bounds.append(best)
        bounds.append(stop)
    return bounds


def _tight(chain: _Chain, budget: int) -> list[int]:
    """Stages whose BACKWARD, or a sweep through which, leaves no room for a kept input besides
    x_0: only x_0 can serve them, so they get blocks of their own (a block's start stays kept
    while the block is reversed). Returns the positions to cut at (i and i + 1)."""
    x = chain.x
    cuts: list[int] = []
    smallest = math.inf
    for i in range(1, chain.n):
        room = budget - x[0] - smallest
        if smallest < math.inf and chain.xt[i] > room or (i + 1 < chain.n and x[i] + x[i + 1] > room):
            cuts += [i, i + 1]
        smallest = min(smallest, x[i])
    return cuts


def _layouts(chain: _Chain, budget: int) -> list[list[int]]:
    """Bottom blocks to try on a chain longer than ``FLAT_STAGES``: of about ``GROUP`` stages,
    and of the size that makes the levels above as even as possible; the stages only x_0 can
    serve get blocks of their own."""
    n = chain.n
    tight = _tight(chain, budget)
    per_top = n / FLAT_STAGES  # stages under each unit of the top DP
    levels = max(1, math.ceil(math.log(per_top) / math.log(GROUP) - 1e-9))
    even = max(2, math.ceil(per_top ** (1 / levels)))
    out = [_blocks(chain.x, 0, n, even, tight)]
    if even != GROUP and n <= 400:  # the second layout doubles the time; it pays on shorter chains
        out.append(_blocks(chain.x, 0, n, GROUP, tight))
    return out


def _hierarchy(chain: _Chain, grid: _Grid, bounds: list[int]) -> _Group:
    """The top group over blocks cut at ``bounds``, grouped again (as evenly as the level count
    allows) until at most ``FLAT_STAGES`` units are left for the top DP."""
    units: list[_Group | None] = []
    for s, e in zip(bounds, bounds[1:]):
        block = _Group(chain, grid, list(range(s, e + 1)), [None] * (e - s))
        block.release()
        units.append(block)
    while len(units) > FLAT_STAGES:
        count = len(units)
        levels = max(1, math.ceil(math.log(count / FLAT_STAGES) / math.log(GROUP) - 1e-9))
        size = max(2, math.ceil((count / FLAT_STAGES) ** (1 / levels)))
        cut = _blocks([0] * count, 0, count, size)
        groups = [_Group(chain, grid, [bounds[j] for j in range(s, e + 1)], units[s:e]) for s, e in zip(cut, cut[1:])]
        for group in groups:
            group.release()  # its curve is all the level above needs; emission solves it again
        units, bounds = list(groups), [bounds[j] for j in cut]
    return _Group(chain, grid, bounds, units)


def nested_plan(costs: StageCosts, budget: int, *, resolution: int | None = None) -> tuple[list[Action], float]:
    """The actions and cost of the cheapest nested schedule within ``budget`` bytes (see NOTE
    [Nested schedules]); ``budget`` must be at least :func:`~.budget.min_budget`."""
    g = max(math.gcd(*costs.state_bytes, *costs.tape_bytes), 1)
    if g > 1:  # plan in units of the gcd: exact, and finer grids for the same levels
        costs = dataclasses.replace(
            costs,
            state_bytes=tuple(v // g for v in costs.state_bytes),
            tape_bytes=tuple(v // g for v in costs.tape_bytes),
        )
        budget //= g
    chain = _Chain(costs)
    n = chain.n
    grid = _grid(chain, budget, resolution if resolution is not None else default_resolution(n))
    if n <= FLAT_STAGES:
        tops = [_Group(chain, grid, list(range(n + 1)), [None] * n)]
    else:
        tops = [_hierarchy(chain, grid, bounds) for bounds in _layouts(chain, budget)]
    top = min(tops, key=lambda t: t.root_cost(budget))  # raises if the least budget were refused
    actions: list[Action] = [(Op.SNAPSHOT, 0)]
    top.emit_s(0, 0, top.w, budget, actions)
    return actions, sum(costs.advance_cost(i) for op, i in actions if op == Op.ADVANCE)
