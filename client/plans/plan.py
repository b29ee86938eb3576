"""The data every planner shares: the actions of a plan (:class:`Op`), a :class:`Plan`, and
:class:`PlanError`.

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

Separate from the planners so that the executor (``wstream.client.trainer``) and every planner
module import the data alone.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


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
