"""float16 jobs with per-stage dynamic loss scaling (NOTE [Per-stage loss scaling]): equal to a
plain-PyTorch fp16 loop with an fp32 master when nothing overflows, no step lost when something
does, and the underflow that scaling exists to prevent shown happening without it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import models
import wstream.client.connection as connection_module
from test_equivalence import assert_weights_equal
from wstream.client import AdamW, Client, LossScale, StateError
from wstream.client.loss_scale import LossScaler, all_finite, unscaled

STEPS = 6
LR = 3e-3


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return models.loss_fn(out.float(), target)


def fp16_reference(stages: list[nn.Module], steps: int, scale: float, *, micro_batches: int = 1) -> dict[str, torch.Tensor]:
    """Plain PyTorch mixed precision: an fp32 master model and optimizer, an fp16 copy for the
    forward and backward, the backward seeded with ``scale``, fp16 gradients cast to fp32 and
    divided by it (per micro-batch, summed in fp32), a fixed scale that never overflows here."""
    master = nn.Sequential(*copy.deepcopy(stages))
    half = copy.deepcopy(master).half()
    opt = torch.optim.AdamW(master.parameters(), lr=LR)
    for t in range(steps):
        with torch.no_grad():
            for h, p in zip(half.parameters(), master.parameters()):
                h.copy_(p)
        x, y = models.batch("mixed", t)
        total = [torch.zeros_like(p) for p in master.parameters()]
        for xj, yj in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            loss = _loss(half(xj.half()), yj)
            root = loss if micro_batches == 1 else loss / micro_batches
            grads = torch.autograd.grad(root, list(half.parameters()), torch.tensor(scale))
            assert all_finite(grads), "the reference's scale must not overflow"
            for acc, g in zip(total, unscaled(grads, scale)):
                acc.add_(g)
        for p, g in zip(master.parameters(), total):
            p.grad = g
        opt.step()
    return master.state_dict()


def _train(client: Client, name: str, loss_scale: LossScale | bool, *, micro_batches: int = 1, steps: int = STEPS, **kw: object):
    job = client.create_job(name, models.mixed(seed=3), optimizer=AdamW(lr=LR), token="t", dtype="float16")
    with job.trainer(loss_scale=loss_scale, **kw) as trainer:  # type: ignore[arg-type]
        assert trainer.compute_dtype == torch.float16
        after_first: dict[str, torch.Tensor] | None = None
        for t in range(steps):
            trainer.step(*models.batch("mixed", t), _loss, micro_batches=micro_batches)
            if t == 0:
                after_first = job.state_dict()
        stats = trainer.stats()
    return job.state_dict(), after_first, stats


def test_scale_rule_is_gradscalers() -> None:
    s = LossScaler(LossScale(init_scale=8.0, growth_interval=3))
    for _ in range(2):
        s.end_step([8.0, 8.0])
    assert s.scale == 8.0 and s.clean_steps == 2
    s.end_step([8.0])
    assert s.scale == 16.0 and s.clean_steps == 0  # grows after growth_interval clean steps
    assert s.back_off(16.0, "here") == 8.0 and s.backoffs == 1
    s.end_step([16.0, 4.0])
    assert s.scale == 4.0 and s.clean_steps == 0  # the lowest scale any micro-batch ended at
    with pytest.raises(FloatingPointError, match="here: the gradient is not finite even at loss scale"):
        LossScaler(LossScale(init_scale=1.0, min_scale=1.0)).back_off(1.0, "here")
    for bad in ({"init_scale": 0.0}, {"growth_factor": 1.0}, {"backoff_factor": 1.0}, {"growth_interval": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            LossScale(**bad)  # type: ignore[arg-type]
    assert not all_finite([torch.ones(3), torch.tensor([1.0, float("nan")])])
    assert not all_finite([torch.tensor([float("inf")], dtype=torch.float16)])
    assert all_finite([torch.full((4,), 65504.0, dtype=torch.float16), None, torch.empty(0)])


@pytest.mark.parametrize("mode", ["zero-copy", "frames-staged"])
def test_float16_job_equals_pytorch_mixed_precision_when_nothing_overflows(
    client: Client, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if mode == "frames-staged":  # the GPU's path: gradients staged in fp32 buffers, then copied
        monkeypatch.setattr(connection_module, "host_staging", lambda device: True)
    kw = {"zero_copy": True} if mode == "zero-copy" else {"shm": False}
    got, _, stats = _train(client, "fp16", LossScale(init_scale=2.0**8, growth_interval=10**6), **kw)
    want = fp16_reference(models.mixed(seed=3), STEPS, 2.0**8)
    assert stats.loss_scale == 2.0**8 and stats.loss_scale_backoffs == 0
    assert_weights_equal(got, want, atol=1e-6)
    start = nn.Sequential(*models.mixed(seed=3)).state_dict()
    assert max((want[k] - start[k]).abs().max().item() for k in want) > 1e-3  # the weights moved


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_an_overflow_reruns_the_stage_at_a_lower_scale_and_loses_no_step(client: Client, micro_batches: int) -> None:
    """From 2^30 the first backward overflows at the loss (fp16 tops out at 65504): GradScaler
    would skip steps until its scale came down; here every step trains, and the weights are those
    of a scale that never overflowed (powers of two scale exactly)."""
    got, after_first, stats = _train(client, "big", LossScale(init_scale=2.0**30), micro_batches=micro_batches)
    assert stats.loss_scale_backoffs >= 14  # 2^30 -> 2^16 at least
    assert stats.loss_scale is not None and stats.loss_scale <= 2.0**17  # k = 2 halves the loss's gradient
    start = nn.Sequential(*models.mixed(seed=3)).state_dict()
    assert after_first is not None
    assert min((after_first[k] - start[k]).abs().max().item() for k in start) > 1e-4  # step 0 trained everywhere
    want = fp16_reference(models.mixed(seed=3), STEPS, 2.0**8, micro_batches=micro_batches)
    assert_weights_equal(got, want, atol=2e-5)


def test_float16_without_scaling_loses_small_gradients_that_scaling_keeps(client: Client) -> None:
    """A loss times 2^-24 has gradients below float16's smallest subnormal: unscaled they are 0 and
    AdamW (no weight decay) leaves every weight where it was; scaled they survive and the update
    is close to the fp32 job's (measured: 4.2% apart, as fp16 rounding of the forward makes)."""

    def tiny(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return _loss(out, target) * 2.0**-24

    def one_step(name: str, dtype: str, loss_scale: LossScale | bool) -> dict[str, torch.Tensor]:
        opt = AdamW(lr=LR, weight_decay=0.0, eps=1e-30)  # eps below the gradients: Adam sees their sign
        job = client.create_job(name, models.mixed(seed=3), optimizer=opt, token="t", dtype=dtype)  # type: ignore[arg-type]
        with job.trainer(loss_scale=loss_scale) as trainer:
            trainer.step(*models.batch("mixed", 0), tiny)
        return job.state_dict()

    start = nn.Sequential(*models.mixed(seed=3)).state_dict()
    unscaled_fp16 = one_step("off", "float16", False)
    scaled_fp16 = one_step("on", "float16", LossScale(init_scale=2.0**24))
    fp32 = one_step("fp32", "float32", False)
    assert_weights_equal(unscaled_fp16, start, atol=0.0)  # every gradient underflowed to 0
    d32 = torch.cat([(fp32[k] - start[k]).flatten() for k in start])
    d16 = torch.cat([(scaled_fp16[k] - start[k]).flatten() for k in start])
    stray = ((d16 - d32).norm() / d32.norm()).item()
    assert stray < 0.1, f"the scaled fp16 update differs from fp32's by {stray:.1%}"


def test_a_loss_that_is_not_finite_sends_nothing_and_the_next_step_trains(client: Client) -> None:
    job = client.create_job("nan", models.mixed(seed=3), optimizer=AdamW(lr=LR), token="t", dtype="float16")
    with job.trainer(loss_scale=LossScale(init_scale=2.0**8, growth_interval=10**6)) as trainer:
        with pytest.raises(FloatingPointError, match="the loss of micro-batch 0 is nan: nothing of this step was sent"):
            trainer.step(*models.batch("mixed", 0), lambda out, y: _loss(out, y) * float("nan"))
        assert trainer.step_index == 0
        for t in range(2):
            trainer.step(*models.batch("mixed", t), _loss)
    assert_weights_equal(job.state_dict(), fp16_reference(models.mixed(seed=3), 2, 2.0**8), atol=1e-6)


class InfiniteSlope(nn.Module):
    """Finite forward (h + 0), infinite backward (the slope of sqrt at 0) at any scale."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h + torch.sqrt(h - h.detach())


def test_a_gradient_that_no_scale_makes_finite_is_refused_by_name(client: Client) -> None:
    stages = [nn.Linear(12, 8), InfiniteSlope(), nn.Linear(8, 5)]
    # unit_bytes=None: stage 2's gradient is pushed before stage 1's fails (test_units: one unit sends nothing)
    job = client.create_job("sqrt", stages, optimizer=AdamW(lr=LR), token="t", dtype="float16", unit_bytes=None)
    trainer = job.trainer()  # float16: scaled by default
    try:
        with pytest.raises(FloatingPointError, match="position 1, micro-batch 0: the gradient is not finite even at"):
            trainer.step(*models.batch("mixed", 0), _loss)
        with pytest.raises(StateError, match="this trainer is closed"):  # the last stage's gradient was sent
            trainer.step(*models.batch("mixed", 0), _loss)
    finally:
        trainer.close()


def test_unscaled_leaves_the_gradients_it_was_given_as_they_were() -> None:
    """A parameter's gradient may be the tensor passed down as its stage input's gradient (``x + w``),
    which must stay scaled: the unscaled copy is a new tensor, also for an fp32 gradient (defect
    seen: it was divided in place)."""
    g32 = torch.full((3,), 8.0)
    g16 = torch.full((3,), 8.0, dtype=torch.float16)
    out = unscaled([g32, None, g16], 4.0)
    assert out[1] is None
    assert out[0] is not g32 and out[0].dtype == torch.float32 and torch.equal(out[0], torch.full((3,), 2.0))
    assert torch.equal(out[2], torch.full((3,), 2.0))
    assert torch.equal(g32, torch.full((3,), 8.0)) and torch.equal(g16, torch.full((3,), 8.0, dtype=torch.float16))
