"""Stage-major micro-batches: the gradient of ordinary accumulation, weights moved once per step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import models
from test_equivalence import assert_weights_equal
from wstream.client import SGD, AdamW, Client
from wstream.client.plans import PlanError, StageCosts, min_budget, simulate, store_all
from wstream.client.boundary import split_micro_batches

STEPS = 4


def accumulated_reference(stages: list[nn.Module], k: int, steps: int, size: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain PyTorch gradient accumulation, micro-batch after micro-batch through the whole model."""
    ref = nn.Sequential(*stages)
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.05)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        x, y = models.batch("mixed", step, size=size)
        total = 0.0
        for xj, yj in zip(torch.tensor_split(x, k), torch.tensor_split(y, k)):
            loss = models.loss_fn(ref(xj), yj)
            share = 1 / k if size % k == 0 else len(xj) / size  # a micro-batch's mean loss weighs its share
            (loss / k if size % k == 0 else loss * share).backward()
            total += loss.item() * share
        opt.step()
        losses.append(total)
    return ref.state_dict(), losses


@pytest.mark.parametrize(
    ("k", "size", "schedule", "extra"),
    [
        (4, 16, "store_all", {}),
        (3, 10, "revolve", {"slots": 2}),  # uneven micro-batches (4, 3, 3)
        (4, 16, "dnc", {}),
        (2, 16, "offload", {"memory_budget": "64KiB"}),
        (4, 16, "optimal", {"memory_budget": "24KiB"}),
        (2, 16, "sqrt", {}),
        (2, 16, "auto", {"memory_budget": "32KiB"}),
        (2, 16, "min_peak", {}),
        # every stage's graph kept from its forward, one per micro-batch (early stop)
        (4, 16, "store_all", {"early_stop": True}),
        (3, 10, "revolve", {"slots": 2, "early_stop": True}),
        (2, 16, "offload", {"memory_budget": "64KiB", "early_stop": True}),
    ],
)
def test_gradients_equal_ordinary_accumulation(client: Client, k: int, size: int, schedule: str, extra: dict) -> None:
    stages = models.mixed()
    start = copy.deepcopy(stages)
    job = client.create_job(f"mb-{schedule}-{len(extra)}", stages, optimizer=AdamW(lr=3e-3, weight_decay=0.05), token="t")
    with job.trainer(zero_copy=False, schedule=schedule, **extra) as trainer:
        losses = [
            trainer.step(*models.batch("mixed", s, size=size), models.loss_fn, micro_batches=k) for s in range(STEPS)
        ]
        summary = trainer.plan_summary()
        if schedule in ("optimal", "offload", "auto", "min_peak"):
            assert trainer.profile is not None and trainer.planning.profile_one is not None
            one = trainer.planning.profile_one
            assert trainer.profile.state_bytes == tuple(b * k for b in one.state_bytes)
    want, ref_losses = accumulated_reference(start, k, STEPS, size)
    assert_weights_equal(job.state_dict(), want, atol=2e-6)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert summary["stages"] == len(stages)


def test_weight_traffic_per_step_does_not_grow_with_micro_batches(client: Client) -> None:
    """Bytes fetched per step are the plan's weight traffic, the same for k = 1 and k = 8."""
    fetched = {}
    for k in (1, 8):
        # unit_bytes=None: revolve's refetches and the pushes below are per chain stage
        job = client.create_job(f"traffic-{k}", models.mixed(), optimizer=AdamW(lr=1e-3), token="t", unit_bytes=None)
        with job.trainer(zero_copy=False, schedule="revolve", slots=2) as trainer:
            for s in range(3):
                trainer.step(*models.batch("mixed", s), models.loss_fn, micro_batches=k)
            stats = trainer.stats()
            fetched[k] = stats.bytes_fetched / stats.steps
            assert fetched[k] == trainer.plan_summary()["weight_bytes_fetched"]
            assert stats.pushes == 3 * len(job.specs)  # one gradient per stage per step
    assert fetched[1] == fetched[8] > 0


def test_the_plan_is_remade_when_the_number_of_micro_batches_changes(client: Client) -> None:
    """A budgeted plan counts k: the plan made for k = 1 would not fit k = 4 micro-batches of the
    same size, so the trainer profiles and plans again."""
    job = client.create_job("replan", models.mixed(), optimizer=AdamW(lr=1e-3), token="t")
    with job.trainer(zero_copy=False, schedule="min_peak") as probe:  # a profile, to pick a budget
        probe.step(*models.batch("mixed", 0), models.loss_fn)
        assert probe.profile is not None
        one = probe.profile
    four = one.for_micro_batches(4)
    everything = simulate(one.n, store_all(one.n).actions, state_bytes=one.state_bytes, tape_bytes=one.tape_bytes)
    budget = max(min_budget(four), everything.peak_bytes)  # k = 1 keeps everything; k = 4 cannot
    with job.trainer(zero_copy=False, schedule="optimal", memory_budget=budget) as trainer:
        trainer.step(*models.batch("mixed", 1), models.loss_fn)
        plan_one = trainer.plan
        assert plan_one is not None and plan_one.advances == one.n - 1  # no recomputation
        trainer.step(*models.batch("mixed", 2, size=64), models.loss_fn, micro_batches=4)
        assert trainer.profile is not None and trainer.planning.profile_one is not None
        assert trainer.profile.state_bytes == tuple(4 * b for b in trainer.planning.profile_one.state_bytes)
        plan_four = trainer.plan
        assert plan_four is not None and plan_four is not plan_one
        fits = simulate(one.n, plan_four.actions, state_bytes=four.state_bytes, tape_bytes=four.tape_bytes)
        old = simulate(one.n, plan_one.actions, state_bytes=four.state_bytes, tape_bytes=four.tape_bytes)
        assert fits.peak_bytes <= budget < old.peak_bytes
        assert trainer.plan_summary()["peak_activation_bytes_measured"] <= budget


def test_the_plan_is_remade_when_a_later_batch_is_larger(client: Client) -> None:
    """Found by review: the plan was made from the first batch's profile and kept for every later
    one, so a batch 4x as large ran it at 2.7x the budget (no new plan, no refusal, no warning).
    A batch larger than the profiled one in any dimension is profiled and planned again (refused,
    before any update, if no plan fits); a smaller one keeps the plan, which fits it too."""
    job = client.create_job("grow", models.mixed(), optimizer=AdamW(lr=1e-3), token="t")
    with job.trainer(zero_copy=False, schedule="min_peak") as probe:  # a profile, to pick a budget
        probe.step(*models.batch("mixed", 0), models.loss_fn)
        assert probe.profile is not None
        one = probe.profile
    four = StageCosts(one.forward_s, tuple(4 * b for b in one.state_bytes), tuple(4 * b for b in one.tape_bytes))
    everything = simulate(one.n, store_all(one.n).actions, state_bytes=one.state_bytes, tape_bytes=one.tape_bytes)
    budget = max(min_budget(four), everything.peak_bytes)  # the first batch keeps everything; 4x cannot
    size = models.batch("mixed", 1)[0].shape[0]
    with job.trainer(zero_copy=False, schedule="optimal", memory_budget=budget) as trainer:
        trainer.step(*models.batch("mixed", 1), models.loss_fn)
        plan_one = trainer.plan
        assert plan_one is not None and plan_one.advances == one.n - 1  # no recomputation
        trainer.step(*models.batch("mixed", 2, size=size // 2), models.loss_fn)  # smaller: the same plan
        assert trainer.plan is plan_one
        trainer.step(*models.batch("mixed", 3, size=4 * size), models.loss_fn)
        plan_big = trainer.plan
        assert plan_big is not None and plan_big is not plan_one
        assert trainer.plan_summary()["peak_activation_bytes_measured"] <= budget
        at = trainer.step_index
        with pytest.raises(PlanError, match="budget"):  # no plan fits 16x: refused before any update
            trainer.step(*models.batch("mixed", 4, size=16 * size), models.loss_fn)
        assert trainer.step_index == at and trainer.plan is plan_big
        trainer.step(*models.batch("mixed", 4, size=size), models.loss_fn)  # and the trainer goes on
        assert trainer.step_index == at + 1


def test_batches_whose_shapes_alternate_reuse_their_plans() -> None:
    """Found by review of the re-planning above: batches of the same tokens in alternating shapes,
    (8, 32) then (4, 64), were each larger than the other in one dimension, so every step was
    profiled again. A plan is kept by the shapes it was made for, and a batch those shapes hold
    runs it without a new profile."""
    from wstream.client.profile import Planning

    made: list[StageCosts] = []

    def plan_from(costs: StageCosts):  # type: ignore[no-untyped-def]
        made.append(costs)
        return store_all(costs.n)

    planning = Planning(None, plan_from, lambda stages: stages)
    wide, long = ((8, 32),), ((4, 64),)
    one = StageCosts((1.0,) * 3, (4, 4, 4), (0, 0, 0))
    assert planning.needs_profile(1, wide)
    first = planning.plan_for(one, 1, wide)
    assert planning.needs_profile(1, long)
    second = planning.plan_for(one, 1, long)
    for shapes, plans in ((wide, [first]), (long, [second]), (wide, [first]), (((2, 32),), [first, second]), (((8, 30),), [first])):
        assert not planning.needs_profile(1, shapes)
        assert any(planning.plan is p for p in plans) and planning.shapes in (wide, long)
    assert len(made) == 2
    assert planning.needs_profile(2, wide)  # another number of micro-batches: made again


def test_micro_batch_split_errors_name_what_was_wrong() -> None:
    x = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="a batch of 4 cannot make 5 micro-batches"):
        split_micro_batches(x, 5, what="inputs")
    with pytest.raises(ValueError, match=r"targets: .* one batch size; got \[4, 6\]"):
        split_micro_batches((x, torch.zeros(6)), 2, what="targets")
    with pytest.raises(ValueError, match="micro_batches must be >= 1"):
        split_micro_batches(x, 0, what="inputs")
    # non-batched items travel with every micro-batch
    parts = split_micro_batches((x, None, torch.tensor(2.0)), 2, what="inputs")
    assert [p[0].shape[0] for p in parts] == [2, 2] and parts[1][1] is None and float(parts[1][2]) == 2.0


class _AddBias(nn.Module):
    """``x + w`` with ``w`` of one sample's shape: autograd hands back one tensor as both the
    gradient of ``w`` and of ``x`` when a micro-batch holds one sample."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(1, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w


@pytest.mark.parametrize("schedule", ["store_all", "revolve"])
def test_a_gradient_that_is_also_the_input_gradient_is_not_summed_into(client: Client, schedule: str) -> None:
    """The sum of a parameter's micro-batch gradients must not be built in the first micro-batch's
    gradient tensor: it may be the very tensor passed down as the stage input's gradient (defect
    seen: stage 0's update off by up to 0.18 against ordinary accumulation)."""
    torch.manual_seed(0)
    width, k = 4, 2
    stages = [nn.Linear(width, width), _AddBias(width), nn.Linear(width, width), _AddBias(width), nn.Linear(width, width)]
    start = copy.deepcopy(stages)
    job = client.create_job(f"alias-{schedule}", stages, optimizer=AdamW(lr=3e-2), token="t", unit_bytes=None)
    batches = [(torch.randn(k, width), torch.randn(k, width)) for _ in range(3)]
    loss_fn = nn.functional.mse_loss
    with job.trainer(zero_copy=False, schedule=schedule, **({"slots": 2} if schedule == "revolve" else {})) as trainer:
        for x, y in batches:
            trainer.step(x, y, loss_fn, micro_batches=k)
    ref = nn.Sequential(*start)
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-2)
    for x, y in batches:
        opt.zero_grad()
        for xj, yj in zip(x.chunk(k), y.chunk(k)):
            (loss_fn(ref(xj), yj) / k).backward()
        opt.step()
    assert_weights_equal(job.state_dict(), ref.state_dict(), atol=2e-6)


def test_uneven_micro_batches_train_on_the_whole_batch_mean(client: Client) -> None:
    """A batch of 10 in 3 micro-batches (4, 3, 3): each micro-batch's mean loss weighs its share of
    the batch, so the step is that of the whole batch at once, as plain PyTorch trains it (defect
    seen: each weighed 1/3, so the samples of the smaller ones counted more; 5e-3 off after 3 SGD
    steps)."""
    stages = models.mixed()
    ref = nn.Sequential(*copy.deepcopy(stages))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    job = client.create_job("mb-uneven", stages, optimizer=SGD(lr=0.1), token="t")
    with job.trainer(zero_copy=False) as trainer:
        for step in range(3):
            x, y = models.batch("mixed", step, size=10)
            got = trainer.step(x, y, models.loss_fn, micro_batches=3)
            opt.zero_grad()
            loss = models.loss_fn(ref(x), y)
            loss.backward()
            opt.step()
            assert got == pytest.approx(loss.item(), rel=1e-5)
    assert_weights_equal(job.state_dict(), {f"{i}.{k}": v for i, m in enumerate(ref) for k, v in m.state_dict().items()}, atol=2e-6)
