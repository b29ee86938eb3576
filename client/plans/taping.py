"""Which forwards of a plan may keep their autograd graph for their stage's backward (early stop).

# NOTE [Taped forwards and early stop]
# A BACKWARD re-runs its stage from the stage's input with autograd, then backpropagates. The
# recomputation runs the whole stage, its last operation too, although no backward formula needs
# that operation's output: only the stage's output *shape* and graph are needed as the root.
# ``torch.utils.checkpoint`` (non-reentrant) avoids it: the forward records the graph with
# placeholders for every saved tensor, and the backward's recomputation stops as soon as the last
# saved tensor is back ("early stop"). For a stage ending in a large matmul (a transformer
# block's MLP down-projection: a third of the block's matmul work) that is a sizeable part of the
# recomputation; plain PyTorch with a checkpoint per block gets it for free (BENCHMARKS.md).
#
# The executor does the same for a *taped* ADVANCE: it runs the stage under that checkpoint, keeps
# its output (the graph's root) and leaves, and the stage's BACKWARD backpropagates through that
# graph instead of running the stage again. A taped graph holds the stage's input (saved for the
# recomputation) and its output (the root). Neither may cost memory the plan did not count, so an
# ADVANCE of position i at action f is taped only when (``taped_advances``):
#   1. a BACKWARD of i follows at action b with no other ADVANCE of i in between (the graph is that
#      of the last forward before the backward: the same weights, the same input values);
#   2. f's input stays alive (kept, or the current state) from f through b: the plan holds it anyway;
#   3. f's output stays alive from f until the BACKWARD of i + 1 at b1 < b, which consumes it: the
#      plan holds it anyway;
#   4. no compute or prefetch runs between b1 and b (actions that allocate): holding the output
#      over that gap, instead of freeing it at b1, costs nothing, and the recomputation at b then
#      no longer materializes a new output of the same size.
# ``store_all`` tapes every ADVANCE; ``sqrt`` the ADVANCEs of its last segment and those of each
# segment's recomputing sweep; Revolve and bisection, whose inputs are mostly recomputed, few.
"""

from __future__ import annotations

from collections.abc import Sequence

from .plan import Action, Op


def taped_advances(actions: Sequence[Action]) -> frozenset[int]:
    """The indices (in ``actions``) of the ADVANCEs whose graph can be kept until their stage's
    BACKWARD at no memory the plan does not hold already (NOTE above)."""
    death, produced = _lifetimes(actions)
    backward_at: dict[int, int] = {}  # position -> index of its (first) BACKWARD
    for a, (op, i) in enumerate(actions):
        if op == Op.BACKWARD:
            backward_at.setdefault(i, a)
    allocates = [a for a, (op, _) in enumerate(actions) if op in (Op.ADVANCE, Op.BACKWARD, Op.PREFETCH)]
    last_advance: dict[int, int] = {}  # position -> its latest ADVANCE so far (rule 1)
    taped: set[int] = set()
    for a, (op, i) in enumerate(actions):
        if op == Op.ADVANCE:
            last_advance[i] = a
        elif op == Op.BACKWARD and last_advance.get(i) is not None:
            f = last_advance.pop(i)
            b1 = backward_at.get(i + 1)
            if b1 is None or not f < b1 < a:
                continue
            token_in, token_out = produced[f]
            if death[token_in] < a or death[token_out] < b1:  # rules 2 and 3
                continue
            if any(b1 < c < a for c in allocates):  # rule 4
                continue
            taped.add(f)
    return frozenset(taped)


def _lifetimes(actions: Sequence[Action]) -> tuple[dict[int, int], dict[int, tuple[int, int]]]:
    """Each device state's death (the action after which nothing holds it: neither the current
    state nor a kept one) and, per ADVANCE, its input and output states. A state is a token: each
    ADVANCE and PREFETCH makes a new one."""
    refs: dict[int, int] = {}
    death: dict[int, int] = {}
    produced: dict[int, tuple[int, int]] = {}
    kept: dict[int, int] = {}
    tokens = iter(range(1, 1 << 62))
    current: int | None = 0
    refs[0] = 1

    def hold(t: int) -> None:
        refs[t] = refs.get(t, 0) + 1

    def drop(t: int | None, a: int) -> None:
        if t is None:
            return
        refs[t] -= 1
        if refs[t] == 0:
            death[t] = a

    for a, (op, i) in enumerate(actions):
        if op == Op.ADVANCE:
            out = next(tokens)
            assert current is not None
            produced[a] = (current, out)
            drop(current, a)
            current = out
            hold(out)
        elif op == Op.SNAPSHOT:
            assert current is not None
            drop(kept.get(i), a)
            kept[i] = current
            hold(current)
        elif op == Op.RESTORE:
            drop(current, a)
            current = kept[i]
            hold(current)
        elif op == Op.FREE:
            drop(kept.pop(i, None), a)
        elif op == Op.PREFETCH:
            t = next(tokens)
            drop(kept.get(i), a)
            kept[i] = t
            hold(t)
        elif op == Op.BACKWARD:
            drop(current, a)
            current = None
        # OFFLOAD and FREE_HOST: a host copy; the device states are unchanged
    end = len(actions)
    for t, n in refs.items():
        if n > 0:
            death.setdefault(t, end)
    return death, produced
