"""``create_job(..., exist_ok=True)``: create the job, or attach to the one of that name when its
layout and options are the ones asked for (what a restarted torchrun rank needs), and refuse any
other with the first difference named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import models
from wstream.client import SGD, AdamW, Client, JobExistsError, LayoutError


def test_exist_ok_attaches_to_the_same_job_and_refuses_another(client: Client) -> None:
    first = client.create_job("same", models.mixed(seed=1), token="t", optimizer=AdamW(lr=1e-2))
    with first.trainer() as trainer:
        x, y = models.batch("mixed", 0)
        trainer.step(x, y, models.loss_fn)
    weights = first.state_dict()

    with pytest.raises(JobExistsError, match="same"):
        client.create_job("same", models.mixed(seed=2), token="t", optimizer=AdamW(lr=1e-2))

    again = client.create_job("same", models.mixed(seed=2), token="t", optimizer=AdamW(lr=1e-2), exist_ok=True)
    assert again.name == "same" and again.options == first.options
    got = again.state_dict()  # the job's weights, not the new modules' (nothing was uploaded)
    assert got.keys() == weights.keys() and all(torch.equal(got[k], weights[k]) for k in weights)
    with again.trainer() as trainer:
        assert trainer.step_index == 1  # it goes on where the job stands

    other = [nn.Linear(8, 8) for _ in range(3)]
    with pytest.raises(LayoutError, match="the job has 5 stages, the given model has 3"):
        client.create_job("same", other, token="t", optimizer=AdamW(lr=1e-2), exist_ok=True)
    with pytest.raises(LayoutError, match=r"optimizer: the job has AdamW\(lr=0\.01.*, asked SGD\(lr=0\.1"):
        client.create_job("same", models.mixed(seed=2), token="t", optimizer=SGD(lr=0.1), exist_ok=True)
    with pytest.raises(LayoutError, match="dtype: the job has 'float32', asked 'bfloat16'"):
        client.create_job("same", models.mixed(seed=2), token="t", optimizer=AdamW(lr=1e-2), dtype="bfloat16", exist_ok=True)


def test_exist_ok_creates_a_job_that_is_not_there(client: Client) -> None:
    job = client.create_job("fresh", models.mixed(seed=3), token="t", exist_ok=True)
    assert [j.name for j in client.status().jobs] == ["fresh"] and job.num_stages == 5


def chain(width: int) -> list[nn.Module]:
    """Three stages whose middle one is ``width`` wide."""
    return [nn.Linear(4, 4), nn.Linear(4, width), nn.Linear(width, 2)]


def test_a_stage_of_another_shape_is_refused_naming_the_stage_and_parameter(client: Client) -> None:
    created = client.create_job("shaped", chain(4), token="t", optimizer=AdamW(lr=1e-2))
    with torch.device("meta"):
        handle = client.attach_job("shaped", token="t", stages=chain(4))
    with pytest.raises(LayoutError, match=r"stage 1: parameter 'weight' has shape \[6, 4\], the job has \[4, 4\]"):
        client.attach_job("shaped", token="t", stages=chain(6))

    # the job is made again under its name with stage 1 wider: the handle's trainer joins the new
    # job and is refused there, naming what differs (its pushes used to fail on a size instead)
    created.drop()
    client.create_job("shaped", chain(6), token="t", optimizer=AdamW(lr=1e-2))
    with pytest.raises(LayoutError) as refused:
        handle.trainer()
    assert "job 'shaped' on the server does not have the layout this trainer was made for" in str(refused.value)
    assert "stage 1: parameter 'weight' has shape [4, 4], the job has [6, 4]" in str(refused.value)
    assert [len(j.workers) for j in client.status().jobs] == [0]  # nothing left joined
    with torch.device("meta"):
        right = client.attach_job("shaped", token="t", stages=chain(6))
    with right.trainer() as trainer:
        trainer.step(torch.randn(3, 4), torch.randn(3, 2), nn.functional.mse_loss)
