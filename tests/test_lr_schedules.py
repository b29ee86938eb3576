"""Learning-rate schedules and gradient clipping as wire data (``wstream.protocol.lr_schedules``).

Each schedule's lr, step by step, is checked against what torch gives a real optimizer: a
``LambdaLR`` whose lambda is the closed form written out here, independently of the module (as
Hugging Face transformers writes it, with the departures the module documents), or torch's own
``MultiStepLR``. Then: round trips inside the optimizer records, and refusal of every bad value,
built in Python (``ValueError``) and arriving on the wire (``msgspec.ValidationError``), each
naming its field.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from wstream.client import (
    SGD,
    AdamW,
    Constant,
    InverseSqrt,
    MultiStep,
    Piecewise,
    Schedule,
    Warmup,
    WarmupCosine,
    WarmupLinear,
    lr_at,
)
from wstream.protocol import messages as m

BASE_LR = 0.3
STEPS = 80
"""Optimizer steps compared per schedule: every case below has its turning points within them."""

Factor = Callable[[int], float]


# ---- closed forms, written as Hugging Face's transformers.optimization writes them -------------
def hf_warmup(step: int, warmup: int) -> float:
    return float(step) / float(max(1, warmup))


def hf_cosine(warmup: int, total: int, min_lr_rate: float) -> Factor:
    """``_get_cosine_schedule_with_warmup_lr_lambda`` (num_cycles 0.5), progress clamped to 1."""

    def f(step: int) -> float:
        if step < warmup:
            return hf_warmup(step, warmup)
        progress = float(step - warmup) / float(max(1, total - warmup))
        progress = min(progress, 1.0)  # the module's one departure: no climb after total
        factor = 0.5 * (1.0 + math.cos(math.pi * float(0.5) * 2.0 * progress))
        factor = factor * (1 - min_lr_rate) + min_lr_rate
        return max(0, factor)

    return f


def hf_linear(warmup: int, total: int, floor: float) -> Factor:
    """``_get_linear_schedule_with_warmup_lr_lambda``, mapped onto [floor, 1] after warmup."""

    def f(step: int) -> float:
        if step < warmup:
            return hf_warmup(step, warmup)
        hf = max(0.0, float(total - step) / float(max(1, total - warmup)))
        return floor + (1 - floor) * hf

    return f


def hf_inverse_sqrt(warmup: int, timescale: int | None = None) -> Factor:
    """``get_inverse_sqrt_schedule`` (its default time scale: the warmup, else 10,000)."""
    if timescale is None:
        timescale = warmup or 10_000

    def f(step: int) -> float:
        if step < warmup:
            return hf_warmup(step, warmup)
        shift = timescale - warmup
        return 1.0 / math.sqrt((step + shift) / timescale)

    return f


def interp(steps: list[int], factors: list[float]) -> Factor:
    return lambda step: float(np.interp(step, steps, factors))


def warmup_then(steps: int, start: float, then: Factor) -> Factor:
    return lambda s: start + (1 - start) * s / steps if s < steps else then(s - steps)


def multistep(milestones: list[int], gamma: float) -> Factor:
    return lambda s: gamma ** sum(1 for x in milestones if x <= s)


# (schedule, its closed form for LambdaLR, or None: compare with torch's MultiStepLR)
CASES: list[tuple[Schedule, Factor | None]] = [
    (Constant(), lambda s: 1.0),
    (WarmupCosine(warmup_steps=10, total_steps=60), hf_cosine(10, 60, 0.0)),
    (WarmupCosine(warmup_steps=10, total_steps=60, min_lr_ratio=0.1), hf_cosine(10, 60, 0.1)),
    (WarmupCosine(warmup_steps=0, total_steps=50, min_lr_ratio=0.25), hf_cosine(0, 50, 0.25)),
    (WarmupCosine(warmup_steps=20, total_steps=20, min_lr_ratio=0.5), hf_cosine(20, 20, 0.5)),
    (WarmupLinear(warmup_steps=5, total_steps=70), hf_linear(5, 70, 0.0)),
    (WarmupLinear(warmup_steps=8, total_steps=40, min_lr_ratio=0.2), hf_linear(8, 40, 0.2)),
    (WarmupLinear(warmup_steps=0, total_steps=0, min_lr_ratio=1.0), hf_linear(0, 0, 1.0)),
    (InverseSqrt(warmup_steps=10), hf_inverse_sqrt(10)),
    (InverseSqrt(warmup_steps=0), hf_inverse_sqrt(0)),
    (InverseSqrt(warmup_steps=4, timescale=20), hf_inverse_sqrt(4, 20)),
    (MultiStep(milestones=[15, 40, 41], gamma=0.5), None),
    (MultiStep(milestones=[0, 30]), None),
    (MultiStep(milestones=[], gamma=3.0), None),
    (Piecewise(steps=[5, 20, 50], factors=[0.1, 1.0, 0.2]), interp([5, 20, 50], [0.1, 1.0, 0.2])),
    (Piecewise(steps=[7], factors=[0.3]), interp([7], [0.3])),
    (Piecewise(steps=[0, 79], factors=[2.0, 0.0]), interp([0, 79], [2.0, 0.0])),
    (Warmup(steps=12, then=WarmupCosine(warmup_steps=0, total_steps=40, min_lr_ratio=0.05), start_factor=0.1),
     warmup_then(12, 0.1, hf_cosine(0, 40, 0.05))),
    (Warmup(steps=5, then=MultiStep(milestones=[10, 20], gamma=0.5)), warmup_then(5, 0.0, multistep([10, 20], 0.5))),
    (Warmup(steps=0, then=Constant()), lambda s: 1.0),
    (Warmup(steps=9, then=Piecewise(steps=[10, 30], factors=[1.0, 0.5]), start_factor=1.0),
     warmup_then(9, 1.0, interp([10, 30], [1.0, 0.5]))),
]


def torch_lrs(schedule: Schedule, closed_form: Factor | None) -> list[float]:
    """The lr of each of ``STEPS`` updates of a real torch optimizer under its torch scheduler."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=BASE_LR)
    sched: torch.optim.lr_scheduler.LRScheduler
    if closed_form is None:
        assert isinstance(schedule, MultiStep)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=list(schedule.milestones), gamma=schedule.gamma)
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, closed_form)
    lrs = []
    for _ in range(STEPS):
        lrs.append(float(opt.param_groups[0]["lr"]))
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize(("schedule", "closed_form"), CASES, ids=[repr(c[0]) for c in CASES])
def test_lr_matches_torch_step_by_step(schedule: Schedule, closed_form: Factor | None) -> None:
    expected = torch_lrs(schedule, closed_form)
    got = [lr_at(schedule, BASE_LR, t) for t in range(STEPS)]
    for t, (want, have) in enumerate(zip(expected, got)):
        assert math.isclose(have, want, rel_tol=1e-12, abs_tol=0.0), (t, want, have)


def test_turning_points() -> None:
    """The ends the docstrings promise, exactly."""
    cos = WarmupCosine(warmup_steps=10, total_steps=60, min_lr_ratio=0.1)
    assert [cos.factor(s) for s in (0, 5, 10, 60, 10**6)] == [0.0, 0.5, 1.0, 0.1, 0.1]
    lin = WarmupLinear(warmup_steps=10, total_steps=60, min_lr_ratio=0.1)
    assert [lin.factor(s) for s in (0, 10, 60, 10**6)] == [0.0, 1.0, 0.1, 0.1]
    assert InverseSqrt(warmup_steps=10).factor(10) == 1.0
    assert InverseSqrt(warmup_steps=10).factor(10 + 30) == 0.5
    assert Warmup(steps=4, then=Constant(), start_factor=0.2).factor(0) == 0.2
    with pytest.raises(ValueError, match="step"):
        Constant().factor(-1)


# ---- the wire -------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", [c[0] for c in CASES], ids=[repr(c[0]) for c in CASES])
def test_round_trip_inside_optimizers(schedule: Schedule) -> None:
    for opt in (AdamW(lr=1e-3, schedule=schedule, clip_grad_norm=1.0), SGD(momentum=0.9, schedule=schedule)):
        back = msgspec.msgpack.decode(msgspec.msgpack.encode(opt), type=type(opt))
        assert back == opt and type(back.schedule) is type(schedule)
        options = m.JobOptions(optimizer=opt)
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(options), type=m.JobOptions) == options
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(schedule), type=Schedule) == schedule


def test_optimizer_defaults_and_old_records() -> None:
    """An optimizer record without the new fields (an older client, a manifest) keeps lr, unclipped."""
    for opt, wire in ((AdamW(), {"kind": "adamw", "lr": 0.5}), (SGD(), {"kind": "sgd", "lr": 0.5})):
        assert opt.schedule == Constant() and opt.clip_grad_norm is None
        back = msgspec.msgpack.decode(msgspec.msgpack.encode(wire), type=m.OptimizerSpec)
        assert back.schedule == Constant() and back.clip_grad_norm is None and back.lr == 0.5
    assert list(msgspec.structs.asdict(AdamW()))[-2:] == ["schedule", "clip_grad_norm"]
    assert list(msgspec.structs.asdict(SGD()))[-2:] == ["schedule", "clip_grad_norm"]


NAN, INF = float("nan"), float("inf")
BAD: list[tuple[type[Any], dict[str, Any], str]] = [
    # (record, its fields, the field the error must name)
    (WarmupCosine, {"warmup_steps": -1, "total_steps": 5}, "warmup_steps"),
    (WarmupCosine, {"warmup_steps": 2.5, "total_steps": 5}, "warmup_steps"),
    (WarmupCosine, {"warmup_steps": 1, "total_steps": -5}, "total_steps"),
    (WarmupCosine, {"warmup_steps": 10, "total_steps": 5}, "total_steps"),
    (WarmupCosine, {"warmup_steps": 1, "total_steps": 5, "min_lr_ratio": NAN}, "min_lr_ratio"),
    (WarmupCosine, {"warmup_steps": 1, "total_steps": 5, "min_lr_ratio": INF}, "min_lr_ratio"),
    (WarmupCosine, {"warmup_steps": 1, "total_steps": 5, "min_lr_ratio": -0.1}, "min_lr_ratio"),
    (WarmupCosine, {"warmup_steps": 1, "total_steps": 5, "min_lr_ratio": 1.5}, "min_lr_ratio"),
    (WarmupLinear, {"warmup_steps": 3, "total_steps": 2}, "total_steps"),
    (WarmupLinear, {"warmup_steps": -3, "total_steps": 2}, "warmup_steps"),
    (WarmupLinear, {"warmup_steps": 0, "total_steps": 2, "min_lr_ratio": 2.0}, "min_lr_ratio"),
    (WarmupLinear, {"warmup_steps": 0, "total_steps": 2, "min_lr_ratio": NAN}, "min_lr_ratio"),
    (InverseSqrt, {"warmup_steps": -1}, "warmup_steps"),
    (InverseSqrt, {"warmup_steps": 0.5}, "warmup_steps"),
    (InverseSqrt, {"warmup_steps": True}, "warmup_steps"),
    (InverseSqrt, {"warmup_steps": 1, "timescale": 0}, "timescale"),
    (InverseSqrt, {"warmup_steps": 1, "timescale": -2}, "timescale"),
    (MultiStep, {"milestones": [5, 3]}, "milestones"),
    (MultiStep, {"milestones": [2, 2]}, "milestones"),
    (MultiStep, {"milestones": [-1, 2]}, "milestones"),
    (MultiStep, {"milestones": [1.5]}, "milestones"),
    (MultiStep, {"milestones": [1], "gamma": 0.0}, "gamma"),
    (MultiStep, {"milestones": [1], "gamma": -0.5}, "gamma"),
    (MultiStep, {"milestones": [1], "gamma": NAN}, "gamma"),
    (MultiStep, {"milestones": [1], "gamma": INF}, "gamma"),
    (MultiStep, {"milestones": list(range(700)), "gamma": 3.0}, "gamma"),
    (Piecewise, {"steps": [], "factors": []}, "steps"),
    (Piecewise, {"steps": [3, 1], "factors": [1.0, 1.0]}, "steps"),
    (Piecewise, {"steps": [-3], "factors": [1.0]}, "steps"),
    (Piecewise, {"steps": [1, 2], "factors": [1.0]}, "factors"),
    (Piecewise, {"steps": [1], "factors": [1.0, 2.0]}, "factors"),
    (Piecewise, {"steps": [1, 2], "factors": [1.0, -1.0]}, "factors"),
    (Piecewise, {"steps": [1, 2], "factors": [NAN, 1.0]}, "factors"),
    (Piecewise, {"steps": [1, 2], "factors": [1.0, INF]}, "factors"),
    (Warmup, {"steps": -1, "then": Constant()}, "steps"),
    (Warmup, {"steps": 1.5, "then": Constant()}, "steps"),
    (Warmup, {"steps": 2, "then": Constant(), "start_factor": -0.5}, "start_factor"),
    (Warmup, {"steps": 2, "then": Constant(), "start_factor": 1.5}, "start_factor"),
    (Warmup, {"steps": 2, "then": Constant(), "start_factor": NAN}, "start_factor"),
    (Warmup, {"steps": 2, "then": Warmup(steps=1, then=Constant())}, "then"),
]


def wire(cls: type[Any], fields: dict[str, Any]) -> dict[str, Any]:
    """The record as a peer would send it: a map tagged with its kind, nested records as maps."""
    return {"kind": cls.__struct_config__.tag, **msgspec.to_builtins(fields)}


@pytest.mark.parametrize(("cls", "fields", "name"), BAD, ids=[f"{c.__name__}-{n}-{i}" for i, (c, _, n) in enumerate(BAD)])
def test_bad_schedule_refused_naming_the_field(cls: type[Any], fields: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        cls(**fields)
    data = msgspec.msgpack.encode(wire(cls, fields))
    with pytest.raises(msgspec.ValidationError, match=name):
        msgspec.msgpack.decode(data, type=Schedule)
    inside = msgspec.msgpack.encode({"kind": "adamw", "lr": 0.1, "schedule": wire(cls, fields)})
    with pytest.raises(msgspec.ValidationError, match=name):
        msgspec.msgpack.decode(inside, type=m.AdamW)


@pytest.mark.parametrize("schedule", [
    {"kind": "warmup_cosine", "warmup_steps": 1, "total_steps": 5, "min_lr": 0.1},
    {"kind": "constant", "factor": 2.0},
    {"kind": "warmup", "steps": 2, "then": {"kind": "constant", "extra": 1}},
])
def test_unknown_schedule_field_refused(schedule: dict[str, Any]) -> None:
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(schedule), type=Schedule)
    inside = msgspec.msgpack.encode({"kind": "sgd", "schedule": schedule})
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.msgpack.decode(inside, type=m.SGD)


def test_unknown_schedule_kind_refused() -> None:
    with pytest.raises(msgspec.ValidationError, match="kind"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"kind": "cosine"}), type=Schedule)


@pytest.mark.parametrize("value", [0.0, -1.0, NAN, INF, -INF])
@pytest.mark.parametrize("cls", [AdamW, SGD])
def test_bad_clip_grad_norm_refused(cls: type[AdamW] | type[SGD], value: float) -> None:
    with pytest.raises(ValueError, match="clip_grad_norm"):
        cls(clip_grad_norm=value)
    data = msgspec.msgpack.encode({"kind": cls.__struct_config__.tag, "clip_grad_norm": value})
    with pytest.raises(msgspec.ValidationError, match="clip_grad_norm"):
        msgspec.msgpack.decode(data, type=m.OptimizerSpec)
    assert cls(clip_grad_norm=0.5).clip_grad_norm == 0.5
