"""A stage with nothing to train pushes nothing, so its step can commit (and its update, a
publish of the same bytes, run) while a worker still reads the stage in that step's backward: a
fetch of it for the step must still be served (NOTE [Versions and who may read what] rule 7 in
server/versions.py). Seen as a flake of tests/test_shared_base.py (stages frozen whole on a
base): ``stale_step: stage 0: weights of step 2 were replaced (the stage is at step 2, updating)``.

The in-process server's updates are held at tests/test_drop.py's gate, so the fetch comes while
the untrained stage is updating, or after its version moved on, every time.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from test_drop import OPTIMIZER, Scene
from wstream.protocol import messages as m


@pytest.mark.parametrize("double_buffer", [False, True])
def test_an_untrained_stage_is_served_for_a_step_that_committed_without_it(held: Scene, double_buffer: bool) -> None:
    torch.manual_seed(1)
    stages = [nn.Linear(6, 6).requires_grad_(False), nn.Linear(6, 2)]  # stage 0 frozen whole: nothing to push
    job = held.client.create_job(
        "untrained", stages, token="u", optimizer=OPTIMIZER, unit_bytes=None, double_buffer=double_buffer
    )
    assert all(p.frozen for p in job.specs[0].params)
    worker, sign = held.worker(job)
    held.update.shut()
    pushed = held.wire.call(
        m.Push(session=worker.session, stage=1, step=0, slot=0, numel=job.specs[1].numel), signer=sign
    )
    assert isinstance(pushed, m.Pushed), pushed  # the only trained stage: step 0 commits
    committed = held.wire.call(m.Commit(session=worker.session, step=0), signer=sign)
    assert isinstance(committed, m.Committed), committed
    held.update.wait_entered()
    during = held.wire.call(m.Fetch(session=worker.session, stage=0, step=0), signer=sign)
    assert isinstance(during, m.Weights) and during.stage == 0 and during.step == 0, during
    held.update.release()
    assert job.wait_step(1) == 1
    after = held.wire.call(m.Fetch(session=worker.session, stage=0, step=0), signer=sign)  # a slow reader's
    assert isinstance(after, m.Weights) and after.stage == 0 and after.step == 0, after
    stale = held.wire.call(m.Fetch(session=worker.session, stage=1, step=0), signer=sign)  # a trained stage's
    assert isinstance(stale, m.Error) and stale.code == "stale_step", stale
