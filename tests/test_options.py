"""Trainer options (wstream.client.options): each flat keyword of ``Job.trainer`` is one field of
one group, groups validate on construction, and a group given twice is refused."""

from __future__ import annotations

import dataclasses

import pytest

from wstream.client.options import (
    FLAT,
    GROUPS,
    Checkpointing,
    Parallelism,
    Precision,
    Transport,
    trainer_options,
)


def test_every_flat_keyword_is_one_field_with_a_docstring() -> None:
    fields = [f.name for cls in GROUPS.values() for f in dataclasses.fields(cls)]
    assert len(fields) == len(set(fields)) == len(FLAT)
    assert set(FLAT) == {
        "schedule", "slots", "memory_budget", "preserve_rng", "early_stop", "prefetch", "weight_budget", "shm", "zero_copy",
        "grad_slots", "step_ring", "reconnect_s", "cpu_threads", "loss_scale", "world_size", "reduce",
    }


def test_flat_keywords_fill_their_groups() -> None:
    opts = trainer_options({}, {"schedule": "optimal", "memory_budget": "1KiB", "prefetch": 1, "world_size": 2})
    assert opts.checkpointing == Checkpointing(schedule="optimal", memory_budget=1024)
    assert opts.transport.prefetch == 1 and opts.transport.depth == 1
    assert opts.parallelism == Parallelism(world_size=2) and opts.precision == Precision()
    assert trainer_options({}, {}).transport.depth == 2


def test_a_group_and_its_flat_keyword_together_are_refused() -> None:
    with pytest.raises(ValueError, match="give transport= or the keyword prefetch=, not both"):
        trainer_options({"transport": Transport(shm=False)}, {"prefetch": 1})
    with pytest.raises(TypeError, match="unexpected keyword argument 'prefetch_depth'"):
        trainer_options({}, {"prefetch_depth": 1})
    with pytest.raises(TypeError, match="checkpointing= takes a Checkpointing"):
        trainer_options({"checkpointing": Transport()}, {})


def test_groups_validate_on_construction() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'fast'"):
        Checkpointing(schedule="fast")
    with pytest.raises(ValueError, match="memory_budget= goes with schedule"):
        Checkpointing(schedule="dnc", memory_budget=10)
    with pytest.raises(ValueError, match="not both"):
        Transport(prefetch=1, weight_budget="1GiB")
    with pytest.raises(ValueError, match="prefetch must be >= 0"):
        Transport(prefetch=-1)
    with pytest.raises(ValueError, match="leave world_size at 1"):
        Parallelism(reduce="allreduce", world_size=2)
    assert Transport(weight_budget="1KiB").weight_budget == 1024


def test_planner_gives_a_plan_or_a_planner_from_the_profile() -> None:
    plan, later = Checkpointing(schedule="dnc").planner(8)
    assert plan is not None and plan.n == 8 and later is None
    plan, later = Checkpointing(schedule="auto", memory_budget=1 << 20).planner(8)
    assert plan is None and later is not None
