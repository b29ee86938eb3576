"""The standard training recipe through wstream equals plain PyTorch: a learning-rate schedule
(``LambdaLR`` with the same closed form), exact global-norm gradient clipping
(``torch.nn.utils.clip_grad_norm_`` over every parameter of the job) and the step's norm and lr
reported; a step whose gradient norm is not finite changes nothing."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import models
from conftest import ServerProcess, run_workers
from test_equivalence import assert_weights_equal
from wstream.client import SGD, AdamW, Client, WarmupCosine, WarmupLinear
from wstream.protocol import messages as m

STEPS = 12
CLIP = 0.5


def cosine_factor(warmup: int, total: int, floor: float) -> Callable[[int], float]:
    """Hugging Face's get_cosine_with_min_lr_schedule_with_warmup (min_lr_rate=floor), by hand."""

    def f(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def reference(
    stages: list[nn.Module], make_opt: Callable[[object], torch.optim.Optimizer], factor: Callable[[int], float],
    clip: float | None, steps: int, ranks: int = 1,
) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """Plain PyTorch: the mean gradient over ``ranks`` batches, clipped, then the scheduled step.
    Returns the weights, the pre-clip norms and the lr of every step."""
    model = nn.Sequential(*stages)
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    norms, lrs = [], []
    for step in range(steps):
        opt.zero_grad()
        loss = sum(models.loss_fn(model(x), y) for x, y in (models.batch("mixed", step, r) for r in range(ranks))) / ranks
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return model.state_dict(), norms, lrs


ADAMW = AdamW(lr=3e-2, weight_decay=0.05, clip_grad_norm=CLIP, schedule=WarmupCosine(warmup_steps=3, total_steps=10, min_lr_ratio=0.1))


PLANS = {  # the checkpoint plans of bench/plans.py, each with what it needs
    "store_all": {},
    "sqrt": {},
    "dnc": {},
    "revolve": {"slots": 2},
    "optimal": {"memory_budget": "64KiB"},
    "min_peak": {},
    "auto": {"memory_budget": "64KiB"},
}


@pytest.mark.parametrize("schedule_name", list(PLANS))
def test_clipping_and_warmup_cosine_equal_pytorch(client: Client, schedule_name: str) -> None:
    stages = models.mixed()
    start = copy.deepcopy(stages)
    job = client.create_job("recipe", stages, optimizer=ADAMW, token="t")
    kw = PLANS[schedule_name]
    norms, lrs = [], []
    with job.trainer(schedule=schedule_name, **kw) as trainer:
        for s in range(STEPS):
            trainer.step(*models.batch("mixed", s), models.loss_fn)
            stats = trainer.stats()
            norms.append(stats.grad_norm)
            lrs.append(stats.lr)
    want, want_norms, want_lrs = reference(
        start, lambda p: torch.optim.AdamW(p, lr=3e-2, weight_decay=0.05), cosine_factor(3, 10, 0.1), CLIP, STEPS
    )
    assert_weights_equal(job.state_dict(), want, atol=1e-6)
    assert norms == pytest.approx(want_norms, rel=1e-5)
    assert lrs == pytest.approx(want_lrs, rel=1e-12)
    assert sum(n > CLIP for n in want_norms) >= 3  # clipping really happened on several steps
    assert lrs[0] == 0.0 and max(lrs) == pytest.approx(3e-2)  # the warmup and the peak
    info = {j.name: j for j in client.status().jobs}["recipe"]
    assert info.grad_norm == pytest.approx(want_norms[-1], rel=1e-5) and info.lr == pytest.approx(want_lrs[-1])


def test_clipping_with_micro_batches_and_sgd_equals_pytorch(client: Client) -> None:
    stages = models.mixed()
    start = copy.deepcopy(stages)
    opt = SGD(lr=0.2, momentum=0.9, clip_grad_norm=CLIP, schedule=WarmupLinear(warmup_steps=2, total_steps=STEPS))
    job = client.create_job("recipe-mb", stages, optimizer=opt, token="t")
    with job.trainer() as trainer:
        for s in range(STEPS):
            trainer.step(*models.batch("mixed", s), models.loss_fn, micro_batches=2)

    def linear(step: int) -> float:  # Hugging Face's get_linear_schedule_with_warmup
        return step / 2 if step < 2 else max(0.0, (STEPS - step) / (STEPS - 2))

    want, want_norms, _ = reference(start, lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9), linear, CLIP, STEPS)
    assert_weights_equal(job.state_dict(), want, atol=1e-6)
    assert sum(n > CLIP for n in want_norms) >= 3


@pytest.mark.server_process
def test_clipping_over_two_workers_clips_the_mean_gradient(server: ServerProcess, tmp_path: Path) -> None:
    """The norm is that of the gradient the optimizer sees: the mean over the workers."""
    stages = models.mixed()
    start = copy.deepcopy(stages)
    with Client(server.address, timeout=30) as c:
        job = c.create_job("recipe-dp", stages, optimizer=ADAMW, token="t")
        run_workers(server.address, "recipe-dp", "t", "mixed", STEPS, 2, tmp_path)
        got = job.state_dict()
    want, _, _ = reference(
        start, lambda p: torch.optim.AdamW(p, lr=3e-2, weight_decay=0.05), cosine_factor(3, 10, 0.1), CLIP, STEPS, ranks=2
    )
    assert_weights_equal(got, want, atol=1e-6)


class NanGrad(nn.Module):
    """Adds 0 in forward, but the gradient of ``w`` is nan (sqrt at 0 times 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sqrt(self.w * 0).sum()


def test_a_step_with_a_non_finite_gradient_norm_changes_nothing(client: Client) -> None:
    torch.manual_seed(0)
    stages = [nn.Linear(12, 5), NanGrad()]
    job = client.create_job("nan", stages, optimizer=AdamW(lr=1e-2), token="t")
    before = job.state_dict()
    with job.trainer() as trainer:
        trainer.step(*models.batch("mixed", 0), models.loss_fn)
        stats = trainer.stats()
    assert stats.skipped_steps == 1 and math.isnan(stats.grad_norm)
    after = job.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # no stage moved, not even the finite one
    info = {j.name: j for j in client.status().jobs}["nan"]
    assert info.step == 1 and info.skipped_steps == 1


def test_a_step_whose_learning_rate_overflows_changes_nothing(client: Client) -> None:
    """lr and each schedule factor are finite, but their product (and a group's lr_scale) may not
    be: such a step used to write inf/nan into every weight, and count as applied. It is skipped
    like a non-finite gradient norm, and the server's log names the learning rate."""
    from wstream.client import SGD, Piecewise

    torch.manual_seed(0)
    job = client.create_job("lr-inf", [nn.Linear(12, 5)], optimizer=SGD(lr=10.0, schedule=Piecewise(steps=[0, 1], factors=[1.0, 1e308])), token="t")
    x, y = torch.randn(4, 12), torch.randn(4, 5)
    with job.trainer() as trainer:
        trainer.step(x, y, torch.nn.functional.mse_loss)  # lr 10: applied
        applied = job.state_dict()
        trainer.step(x, y, torch.nn.functional.mse_loss)  # lr 10 * 1e308 = inf
        stats = trainer.stats()
    after = job.state_dict()
    assert all(torch.equal(applied[k], after[k]) for k in applied)
    assert stats.skipped_steps == 1
    info = {j.name: j for j in client.status().jobs}["lr-inf"]
    assert info.step == 2 and info.skipped_steps == 1


def test_bad_recipe_values_are_refused_with_the_field_named() -> None:
    with pytest.raises(ValueError, match="clip_grad_norm"):
        AdamW(clip_grad_norm=0.0)
    with pytest.raises(ValueError, match="clip_grad_norm"):
        SGD(clip_grad_norm=-1.0)
    with pytest.raises(ValueError, match="total_steps"):
        WarmupCosine(warmup_steps=10, total_steps=5)
    with pytest.raises(ValueError, match="warmup_steps"):
        WarmupCosine(warmup_steps=-1, total_steps=5)
    import msgspec

    with pytest.raises(msgspec.ValidationError, match="nope"):
        msgspec.msgpack.decode(
            msgspec.msgpack.encode({"kind": "adamw", "schedule": {"kind": "warmup_cosine", "warmup_steps": 1,
                                                                  "total_steps": 2, "nope": 1}}),
            type=m.AdamW,
        )


def test_the_schedule_of_a_live_job_changes_from_its_next_step_and_is_kept(
    client: Client, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``set_schedule`` (and ``wstream schedule``) change lr and schedule from the next step; the
    run equals PyTorch changing its LambdaLR at the same step; exist_ok still attaches."""
    from wstream.client import Constant, MultiStep
    from wstream.client.admin import main as wstream_main

    stages = models.mixed()
    start = copy.deepcopy(stages)
    job = client.create_job("live", stages, optimizer=AdamW(lr=1e-2), token="t")
    with job.trainer() as trainer:
        for s in range(3):
            trainer.step(*models.batch("mixed", s), models.loss_fn)
        job.set_schedule(MultiStep(milestones=[4], gamma=0.5), lr=2e-2)
        for s in range(3, 6):
            trainer.step(*models.batch("mixed", s), models.loss_fn)
        assert trainer.stats().lr == pytest.approx(1e-2)  # step 5: 2e-2 * 0.5
        token = tmp_path / "token"
        token.write_text("t")
        assert wstream_main(["schedule", "live", "--server", client.address, "--token-file", str(token),
                             "--schedule", '{"kind": "constant"}', "--lr", "5e-3"]) == 0
        for s in range(6, 8):
            trainer.step(*models.batch("mixed", s), models.loss_fn)
        assert trainer.stats().lr == pytest.approx(5e-3)
    ref = nn.Sequential(*start)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for s in range(8):
        opt.param_groups[0]["lr"] = 1e-2 if s < 3 else (2e-2 * (0.5 if s >= 4 else 1.0) if s < 6 else 5e-3)
        opt.zero_grad()
        models.loss_fn(ref(models.batch("mixed", s)[0]), models.batch("mixed", s)[1]).backward()
        opt.step()
    assert_weights_equal(job.state_dict(), ref.state_dict(), atol=1e-6)
    again = client.create_job("live", models.mixed(), optimizer=AdamW(lr=1e-2), token="t", exist_ok=True)
    assert again.options.optimizer.schedule == Constant() and again.options.optimizer.lr == 5e-3
    bad = '{"kind": "warmup_cosine", "warmup_steps": 5, "total_steps": 2}'
    assert wstream_main(["schedule", "live", "--server", client.address, "--token-file", str(token), "--schedule", bad]) == 2
    assert "total_steps" in capsys.readouterr().err


@pytest.mark.server_process
def test_schedule_clipping_and_a_live_change_resume_exactly_after_a_server_restart(tmp_path: Path) -> None:
    """The schedule is evaluated at the job's step and stored with the job (a live change too):
    4 steps, a schedule change, 2 steps, a restart from the store, 4 more steps equal one
    uninterrupted PyTorch run with the same lr at every step."""
    from conftest import start_server
    from wstream.client import MultiStep

    store = str(tmp_path / "store")
    srv = start_server(tmp_path, "--store", store, name="a")
    stages = models.mixed()
    start = copy.deepcopy(stages)
    warm = WarmupCosine(warmup_steps=2, total_steps=20)
    with Client(srv.address, timeout=30) as c:
        job = c.create_job("resume", stages, optimizer=AdamW(lr=2e-2, clip_grad_norm=CLIP, schedule=warm), token="t")
        with job.trainer() as trainer:
            for s in range(4):
                trainer.step(*models.batch("mixed", s), models.loss_fn)
            job.set_schedule(MultiStep(milestones=[5, 8], gamma=0.5))
            for s in range(4, 6):
                trainer.step(*models.batch("mixed", s), models.loss_fn)
    assert srv.stop() == 0  # SIGTERM: a final snapshot of step 6
    srv = start_server(tmp_path, "--store", store, name="b", address=srv.address)
    try:
        with Client(srv.address, timeout=30) as c:
            with torch.device("meta"):
                skeleton = models.mixed()
            job = c.attach_job("resume", token="t", stages=skeleton)
            assert job.options.optimizer.schedule == MultiStep(milestones=[5, 8], gamma=0.5)
            with job.trainer() as trainer:
                assert trainer.step_index == 6
                for s in range(6, 10):
                    trainer.step(*models.batch("mixed", s), models.loss_fn)
                assert trainer.stats().lr == pytest.approx(2e-2 * 0.25)
            got = job.state_dict()
    finally:
        assert srv.stop() == 0

    def factor(step: int) -> float:
        if step < 4:
            return cosine_factor(2, 20, 0.0)(step)
        return 0.5 ** sum(step >= ms for ms in (5, 8))

    want, norms, _ = reference(start, lambda p: torch.optim.AdamW(p, lr=2e-2), factor, CLIP, 10)
    assert_weights_equal(got, want, atol=1e-6)
    assert sum(n > CLIP for n in norms) >= 2


@pytest.mark.server_process
def test_the_whole_recipe_with_parameter_groups_over_two_workers_equals_pytorch(server: ServerProcess, tmp_path: Path) -> None:
    """Clipping, the schedule and parameter groups (no decay on biases and norms, a group at half
    the lr) together, two workers on different data: PyTorch's AdamW with the same groups."""
    from wstream.client import ParamGroup, no_decay

    stages = models.mixed()
    start = copy.deepcopy(stages)
    groups = [no_decay(), ParamGroup("up", where=r"up\.weight", lr_scale=0.5)]
    with Client(server.address, timeout=30) as c:
        job = c.create_job("recipe-groups", stages, optimizer=ADAMW, param_groups=groups, token="t")
        run_workers(server.address, "recipe-groups", "t", "mixed", STEPS, 2, tmp_path)
        got = job.state_dict()

    def make_opt(_params: object) -> torch.optim.Optimizer:
        named = [(f"{i}.{n}", p) for i, mod in enumerate(start) for n, p in mod.named_parameters()]
        decay0 = [p for n, p in named if p.ndim < 2]
        half = [p for n, p in named if p.ndim >= 2 and n.endswith("up.weight")]
        rest = [p for n, p in named if p.ndim >= 2 and not n.endswith("up.weight")]
        return torch.optim.AdamW(
            [{"params": decay0, "weight_decay": 0.0}, {"params": half, "lr_scale": 0.5}, {"params": rest}],
            lr=3e-2, weight_decay=0.05,
        )

    class ScaledLambda(torch.optim.lr_scheduler.LambdaLR):
        """LambdaLR with the group's lr_scale applied (PyTorch has no lr multiplier per group)."""

        def get_lr(self) -> list[float]:  # type: ignore[override]
            return [lr * g.get("lr_scale", 1.0) for lr, g in zip(super().get_lr(), self.optimizer.param_groups)]

    model = nn.Sequential(*start)
    opt = make_opt(model.parameters())
    sched = ScaledLambda(opt, cosine_factor(3, 10, 0.1))
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(models.loss_fn(model(x), y) for x, y in (models.batch("mixed", step, r) for r in range(2))) / 2
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
    assert_weights_equal(got, model.state_dict(), atol=1e-6)
