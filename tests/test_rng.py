"""StageRng (client/rng.py): a stage's re-run draws the random numbers of its first run; a run
that draws none keeps no RNG state."""

from __future__ import annotations

from typing import Any

import torch

from wstream.client.rng import StageRng


def test_a_rerun_replays_the_first_runs_draws_and_a_run_without_draws_keeps_no_state() -> None:
    rng = StageRng(torch.device("cpu"), preserve=True)
    states: dict[tuple[int, int], Any] = {}
    with rng.around(states, 0):
        first = torch.rand(4)
    with rng.around(states, 1):
        torch.ones(4).sum()  # no draw
    assert states[(1, 0)] is None and states[(0, 0)] is not None
    live = torch.get_rng_state()
    with rng.around(states, 0):
        again = torch.rand(4)
    with rng.around(states, 1):
        pass
    assert torch.equal(first, again)
    assert torch.equal(torch.get_rng_state(), live)  # replays leave the live RNG where it was
