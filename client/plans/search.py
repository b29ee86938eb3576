"""Exhaustive search over every schedule the executor runs: the least-cost plan within a byte
budget among all sequences of SNAPSHOT / RESTORE / FREE / ADVANCE / BACKWARD, by A* over the
executor's states. Exponential in n (a state holds the set of kept inputs), so for short chains
only; :func:`~.budget.optimal` runs it there, and the dynamic program of :mod:`.nested` beyond.

NOTE [Exhaustive search]
========================
A state is (kept inputs, current input or none, next stage to reverse); memory counts exactly as
:func:`~.simulate.simulate` does (bytes, no rounding), and the moves are the executor's actions
(ADVANCE the current input if it is below the next stage to reverse, BACKWARD it if it is that
stage, SNAPSHOT it, RESTORE or FREE a kept one). Only ADVANCE costs. The heuristic is the cost of
producing, once, every input still needed (at or below the next stage to reverse) that is
neither kept nor current: each needs its ADVANCE at least once, and no move lowers the sum by
more than it costs, so it is consistent and the first goal popped is optimal. An upper bound
(the DP's plan) prunes every state that cannot beat it.
"""

from __future__ import annotations

import heapq
import math

from .costs import StageCosts
from .plan import Action, Op

SEARCH_STAGES = 8
"""Chains up to this many stages are searched exhaustively by :func:`~.budget.optimal`."""


def exhaustive_plan(
    costs: StageCosts, budget: int, *, bound: float = math.inf, max_states: int = 500_000
) -> tuple[list[Action], float] | None:
    """The actions (SNAPSHOT 0 first) and cost of a cheapest schedule whose memory stays within
    ``budget`` bytes, or None when no schedule costs at most ``bound`` or more than
    ``max_states`` states would be expanded."""
    n = costs.n
    x, tape = costs.state_bytes, costs.tape_bytes
    step = [costs.advance_cost(i) for i in range(n)]
    need_of = [step[j - 1] if j > 0 else 0.0 for j in range(n)]  # producing x_j once

    def kept_bytes(kept: int) -> int:
        return sum(x[i] for i in range(n) if kept >> i & 1)

    def h(kept: int, cur: int, nb: int) -> float:
        return sum(need_of[j] for j in range(1, nb + 1) if not kept >> j & 1 and j != cur)

    start = (1, 0, n - 1)  # x_0 kept (SNAPSHOT 0), current, stage n-1 next
    best: dict[tuple[int, int, int], float] = {start: 0.0}
    parent: dict[tuple[int, int, int], tuple[tuple[int, int, int], tuple[Action, ...]]] = {}
    heap = [(h(*start), 0.0, 0, start)]
    tie = 0
    expanded = 0
    slack = 1e-9 * max(1.0, bound if bound < math.inf else 1.0)
    while heap:
        f, g, _, state = heapq.heappop(heap)
        if g > best[state] or f > bound + slack:
            continue
        kept, cur, nb = state
        if nb < 0:
            steps: list[tuple[Action, ...]] = []
            while state != start:
                state, done = parent[state]
                steps.append(done)
            return [(Op.SNAPSHOT, 0), *(a for done in reversed(steps) for a in done)], g
        expanded += 1
        if expanded > max_states:
            return None
        live = kept_bytes(kept) + (x[cur] if cur >= 0 and not kept >> cur & 1 else 0)
        moves: list[tuple[float, tuple[int, int, int], tuple[Action, ...]]] = []
        if 0 <= cur < nb and live + x[cur + 1] <= budget:
            moves.append((step[cur], (kept, cur + 1, nb), ((Op.ADVANCE, cur),)))
        if cur == nb and live + tape[cur] <= budget:  # a kept x_nb is of no more use: free it too
            done = ((Op.BACKWARD, nb), (Op.FREE, nb)) if kept >> nb & 1 else ((Op.BACKWARD, nb),)
            moves.append((0.0, (kept & ~(1 << nb), -1, nb - 1), done))
        if cur >= 0 and not kept >> cur & 1:
            moves.append((0.0, (kept | 1 << cur, cur, nb), ((Op.SNAPSHOT, cur),)))
        for k in range(nb + 1):
            if kept >> k & 1:
                if k != cur:
                    moves.append((0.0, (kept, k, nb), ((Op.RESTORE, k),)))
                moves.append((0.0, (kept & ~(1 << k), cur, nb), ((Op.FREE, k),)))
        for dc, nxt, action in moves:
            ng = g + dc
            if ng < best.get(nxt, math.inf):
                best[nxt] = ng
                parent[nxt] = (state, action)
                tie += 1
                heapq.heappush(heap, (ng + h(*nxt), ng, tie, nxt))
    return None
