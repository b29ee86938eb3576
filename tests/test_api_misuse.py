"""The client API under misuse (found by review): each mistake is refused by name, before the
server's state changes, and the caller loses nothing (its model keeps its weights)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from wstream.client import AdamW, Client, LayoutError, SGD, StateError, Tied


def on_device(stages: list[nn.Module]) -> list[str]:
    return [next(s.parameters()).device.type for s in stages]


def test_a_refused_create_job_leaves_the_callers_model_as_it_was(client: Client) -> None:
    stages = [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4).double()]
    want = [s.weight.detach().clone() for s in stages]
    with pytest.raises(LayoutError, match="float"):
        client.create_job("refused", stages, optimizer=SGD(), token="t")
    assert on_device(stages) == ["cpu", "cpu", "cpu"] and all(torch.equal(s.weight, w.to(s.weight.dtype)) for s, w in zip(stages, want))
    assert client.status().jobs == []
    stages[2].float()  # what the error says to do
    job = client.create_job("refused", stages, optimizer=SGD(), token="t")
    assert torch.equal(job.state_dict()["0.weight"], want[0])


def test_a_refused_attach_or_exist_ok_leaves_the_callers_model_as_it_was(client: Client) -> None:
    client.create_job("there", [nn.Linear(4, 4), nn.Linear(4, 4)], optimizer=AdamW(), token="t")
    mine = [nn.Linear(4, 4), nn.Linear(4, 4)]
    with pytest.raises(LayoutError, match="other options"):
        client.create_job("there", mine, optimizer=SGD(), token="t", exist_ok=True)
    assert on_device(mine) == ["cpu", "cpu"]
    three = [nn.Linear(4, 4) for _ in range(3)]
    with pytest.raises(LayoutError, match="do not match"):
        client.attach_job("there", token="t", stages=three)
    assert on_device(three) == ["cpu", "cpu", "cpu"]
    job = client.attach_job("there", token="t", stages=mine)  # matching: now they are the job's skeletons
    assert on_device(mine) == ["meta", "meta"] and job.num_stages == 2


def test_a_module_given_twice_or_built_on_meta_is_refused_by_name(client: Client) -> None:
    layer = nn.Linear(4, 4)
    with pytest.raises(LayoutError, match=r"Tied\(0"):
        client.create_job("twice", [layer, layer], optimizer=SGD(), token="t")
    with pytest.raises(LayoutError, match="Tied"):  # a generator cannot be checked first: caught at upload
        client.create_job("twice-gen", (s for s in [layer, layer]), optimizer=SGD(), token="t")
    with torch.device("meta"):
        built = [nn.Linear(4, 4)]
    with pytest.raises(LayoutError, match="meta device.*materialize"):
        client.create_job("meta", built, optimizer=SGD(), token="t")
    assert client.status().jobs == []


@pytest.mark.parametrize(
    ("items", "words"),
    [
        ([nn.Linear(2, 2), None], "stage 1 is a NoneType"),
        ([nn.Linear], "stage 0 is the class Linear.*instance"),
        ([1, 2], "stage 0 is a int"),
    ],
)
def test_items_that_are_not_modules_are_refused_by_position(client: Client, items: list, words: str) -> None:
    with pytest.raises(LayoutError, match=words):
        client.create_job("items", items, optimizer=SGD(), token="t")
    with pytest.raises(LayoutError, match=words):
        client.create_job("items", iter(items), optimizer=SGD(), token="t")
    assert client.status().jobs == []


def test_an_empty_chain_is_refused_before_anything_is_sent(client: Client) -> None:
    with pytest.raises(ValueError, match="stages is empty"):
        client.create_job("empty", [], optimizer=SGD(), token="t")
    assert client.status().jobs == []


def test_a_trainer_that_fails_after_joining_leaves_the_job(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer whose construction failed after it joined stayed a live, heart-beating worker,
    and every later step of the job waited for its gradients (up to wait_timeout)."""
    import wstream.client.trainer as trainer_module

    job = client.create_job("left", [nn.Linear(4, 4), nn.Linear(4, 4)], optimizer=SGD(), token="t")

    def broken(*args: object, **kw: object) -> None:
        raise RuntimeError("injected: the executor could not be made")

    with monkeypatch.context() as patch:
        patch.setattr(trainer_module, "PlanExecutor", broken)
        with pytest.raises(RuntimeError, match="injected"):
            job.trainer()
    assert [j.workers for j in client.status().jobs] == [[]]
    with job.trainer() as trainer:  # trains alone: nobody else is waited for
        trainer.step(torch.randn(2, 4), torch.randn(2, 4), torch.nn.functional.mse_loss)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"shm": "no"}, "shm must be bool or None"),
        ({"prefetch": 1.5}, "prefetch must be int or None"),
        ({"grad_slots": 0}, "grad_slots must be 1..64"),
        ({"reconnect_s": -5}, "reconnect_s must be a finite number >= 0"),
        ({"world_size": 0}, "world_size must be >= 1"),
        ({"loss_scale": "yes"}, "loss_scale must be LossScale or bool or None"),
        ({"preserve_rng": "yes"}, "preserve_rng must be bool"),
    ],
)
def test_trainer_options_of_the_wrong_type_or_range_are_refused_before_joining(
    client: Client, options: dict, words: str
) -> None:
    job = client.create_job("opts", [nn.Linear(4, 4)], optimizer=SGD(), token="t")
    with pytest.raises((TypeError, ValueError), match=words):
        job.trainer(**options)
    assert [j.workers for j in client.status().jobs] == [[]]


def test_micro_batches_of_inputs_and_targets_of_different_batch_sizes_are_refused(client: Client) -> None:
    """Inputs of 8 rows and targets of 2 trained silently with micro_batches=2 (each micro-batch's
    4 outputs broadcast against 1 target row); a float count failed inside tensor_split."""
    job = client.create_job("mb", [nn.Linear(4, 4)], optimizer=SGD(), token="t")
    before = job.state_dict()
    with job.trainer() as trainer:
        with pytest.raises(ValueError, match="batch of 8 and targets of 2"):
            trainer.step(torch.randn(8, 4), torch.randn(2, 4), torch.nn.functional.mse_loss, micro_batches=2)
        with pytest.raises(TypeError, match="micro_batches must be an int"):
            trainer.step(torch.randn(8, 4), torch.randn(8, 4), torch.nn.functional.mse_loss, micro_batches=2.0)  # type: ignore[arg-type]
        assert all(torch.equal(v, job.state_dict()[k]) for k, v in before.items())
        trainer.step(torch.randn(8, 4), torch.randn(8, 4), torch.nn.functional.mse_loss, micro_batches=2)  # still trains
