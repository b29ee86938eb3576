"""StageRng (client/rng.py): a stage's re-run draws the random numbers of its first run; a run
that draws none keeps no RNG state."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from wstream.client import SGD, Client
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


class SometimesDrawing(nn.Module):
    """A stage that draws random numbers (dropout) only in some steps: stage i draws in step s
    when ``(i + s) % 3 == 0`` (``STEP`` says the step), so the stages that drew nothing last
    step (quiet) are not the ones that draw now."""

    STEP = [0]

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.linear(x))
        if (self.index + self.STEP[0]) % 3 == 0:
            x = torch.nn.functional.dropout(x, 0.3, training=True)
        return x


WIDTH = 8
STEPS = 4


def drawing_chain(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [SometimesDrawing(i) for i in range(n)]


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)) for _ in range(STEPS)]


@pytest.mark.parametrize("case", [{"schedule": "store_all"}, {"schedule": "revolve", "slots": 2}, {"schedule": "dnc"}])
def test_stages_whose_drawing_changes_between_steps_train_as_plain_pytorch(client: Client, case: dict[str, Any]) -> None:
    """Quiet stretches (NOTE [Quiet stretches] in rng.py): a stage that drew nothing last step
    runs without its own record; when one of them draws after all, the stretch runs again with
    the RNG set back. The dropout masks, the live RNG afterwards and so the weights are plain
    PyTorch's, step after step (a stage's drawing changes every step)."""
    n = 9
    stages = drawing_chain(n)
    reference = nn.Sequential(*copy.deepcopy(stages))
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.manual_seed(123)
    want_losses = []
    for s, (x, y) in enumerate(data()):
        SometimesDrawing.STEP[0] = s
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(reference(x), y)
        loss.backward()
        opt.step()
        want_losses.append(loss.item())
    want_rng = torch.get_rng_state()

    # units of three chain stages: stretches run within one fetch
    job = client.create_job("drawing", stages, optimizer=SGD(lr=0.1), token="t", unit_bytes=3 * (WIDTH + 1) * WIDTH * 4)
    torch.manual_seed(123)
    with job.trainer(**case) as trainer:
        losses = []
        for s, (x, y) in enumerate(data()):
            SometimesDrawing.STEP[0] = s
            losses.append(trainer.step(x, y, torch.nn.functional.mse_loss))
        redone = trainer.executor.rng.quiet
        runners = trainer.executor.runners
        assert all(r._kept_leaves for r in runners), "leaves were cut again for the next step"  # NOTE [Kept leaves]
    assert all(not r._kept_leaves for r in runners), "leaves outlived the trainer"
    assert losses == pytest.approx(want_losses, rel=1e-6)
    assert torch.equal(torch.get_rng_state(), want_rng)  # the live RNG ends where plain training leaves it
    got = job.state_dict()
    want = reference.state_dict()
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= 1e-6
    # the stages that drew in the last step are not quiet; the others are (both kinds were run)
    assert {i for i in range(n) if (i + STEPS - 1) % 3 != 0} <= redone | {n - 1}
    assert not {i for i in range(n) if (i + STEPS - 1) % 3 == 0} & redone
