"""Every checkpoint plan gives bit-identical training to store_all, at the recomputation it promises."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from wstream.client import AdamW, Client
from wstream.client.plans import revolve_cost

STEPS = 2
WIDTH = 8


def chain(n: int, *, dropout: bool, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(n):
        block = [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
        if dropout:
            block.append(nn.Dropout(0.2))
        layers.append(nn.Sequential(*block))
    return layers


def train(client: Client, name: str, n: int, dropout: bool, **trainer_kwargs) -> tuple[dict, dict, list[float]]:
    # unit_bytes=None: fetches and weight bytes are counted per chain stage (test_units: plans over units)
    job = client.create_job(name, chain(n, dropout=dropout), optimizer=AdamW(lr=1e-2), token="t", unit_bytes=None)
    torch.manual_seed(123)  # the same dropout masks for every plan
    g = torch.Generator().manual_seed(7)
    data = [(torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)) for _ in range(STEPS)]
    with job.trainer(**trainer_kwargs) as trainer:
        losses = [trainer.step(x, y, torch.nn.functional.mse_loss) for x, y in data]
        summary = trainer.plan_summary()
        stats = trainer.stats()
    profiling = n if trainer_kwargs.get("schedule") in ("optimal", "min_peak", "auto", "offload") else 0
    assert stats.fetches == STEPS * len(trainer.plan.fetch_order()) + profiling
    return job.state_dict(), summary, losses


CASES = [
    {"schedule": "sqrt"},
    {"schedule": "sqrt_recursive"},
    {"schedule": "dnc"},
    {"schedule": "revolve", "slots": 1},
    {"schedule": "revolve", "slots": 2},
    {"schedule": "revolve", "slots": 5},
]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64])
def test_every_plan_trains_bit_identically_to_store_all(client: Client, n: int) -> None:
    dropout = n in (3, 7)  # recomputed stages must replay their dropout masks exactly
    want, base, want_losses = train(client, f"base{n}", n, dropout)
    assert base["recomputed_forwards"] == n - 1
    for k, case in enumerate(CASES):
        got, summary, losses = train(client, f"p{n}-{k}", n, dropout, **case)
        assert losses == want_losses, case
        for key in want:
            assert torch.equal(got[key], want[key]), (case, key)
        if case["schedule"] == "revolve":
            assert summary["recomputed_forwards"] == revolve_cost(n, case["slots"])
            assert summary["peak_kept_states"] <= case["slots"]
        assert summary["weight_bytes_fetched"] == (n + summary["recomputed_forwards"]) * base["weight_bytes_fetched"] // (2 * n - 1)


def test_memory_follows_the_plan(client: Client) -> None:
    """Measured boundary memory: store_all grows with n, revolve stays at its slots."""
    n = 64
    _, store, _ = train(client, "mem-all", n, False)
    _, rev, _ = train(client, "mem-rev", n, False, schedule="revolve", slots=4)
    _, dnc, _ = train(client, "mem-dnc", n, False, schedule="dnc")
    state = 4 * WIDTH * 4  # one boundary: 4 x 8 fp32
    assert store["peak_activation_bytes_measured"] == n * state  # x_0 .. x_{n-1}
    assert rev["peak_activation_bytes_measured"] <= (4 + 1) * state
    assert dnc["peak_activation_bytes_measured"] <= (6 + 1) * state  # log2(64) + 1 live states


def test_zero_copy_without_shared_memory_is_refused_before_joining(client: Client) -> None:
    from wstream.client import StateError

    job = client.create_job("zc", chain(2, dropout=False), token="t")
    with pytest.raises(StateError, match="zero_copy=True needs"):
        job.trainer(shm=False, zero_copy=True)
    assert client.status().jobs[-1].workers == []  # no phantom worker for others to wait on


def test_unknown_schedule_and_misplaced_slots_are_refused(client: Client) -> None:
    job = client.create_job("bad-plan", chain(3, dropout=False), token="t")
    with pytest.raises(ValueError, match="unknown schedule 'fast'"):
        job.trainer(schedule="fast")
    with pytest.raises(ValueError, match="slots= applies to schedule='revolve'"):
        job.trainer(schedule="dnc", slots=3)


def test_optimal_schedule_profiles_then_trains_bit_identically_within_its_budget(client: Client) -> None:
    n = 16
    want, _, want_losses = train(client, "opt-base", n, True)
    state = 4 * WIDTH * 4
    budget = 12 * state  # store_all keeps 16 inputs; the least any plan needs is about 6 here
    got, summary, losses = train(client, "opt", n, True, schedule="optimal", memory_budget=budget)
    assert losses == want_losses
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert summary["schedule"] == "optimal"
    assert n - 1 < summary["recomputed_forwards"]  # it had to recompute to fit
    assert summary["peak_activation_bytes_measured"] <= budget


def test_min_peak_schedule_trains_bit_identically_with_less_memory(client: Client) -> None:
    n = 16
    want, base, want_losses = train(client, "mp-base", n, True)
    got, summary, losses = train(client, "mp", n, True, schedule="min_peak")
    assert losses == want_losses
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert summary["schedule"] == "min_peak"
    assert summary["peak_activation_bytes_measured"] < base["peak_activation_bytes_measured"] / 2


def test_auto_says_what_it_chose(client: Client) -> None:
    n = 16
    want, _, _ = train(client, "auto-base", n, False)
    got, summary, _ = train(client, "auto", n, False, schedule="auto", memory_budget=12 * 4 * WIDTH * 4)
    assert summary["schedule"].startswith("auto(") and summary["schedule"] != "auto(store_all)"
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_offload_schedule_trains_bit_identically(client: Client) -> None:
    n = 16
    want, _, want_losses = train(client, "off-base", n, True)
    got, summary, losses = train(client, "off", n, True, schedule="offload", memory_budget=8 * 4 * WIDTH * 4)
    assert summary["schedule"] == "offload"
    assert losses == want_losses
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_cpu_workers_profile_says_its_host_is_its_device_and_the_summary_counts_host_copies(client: Client) -> None:
    """``auto`` leaves ``offload`` out on a CPU worker (tests/test_plans.py), because its profile
    says host memory is the device's; an ``offload`` plan asked for by name still runs there, and
    its summary names the host copies it keeps beside the budget."""
    n = 16
    job = client.create_job("cpu-host", chain(n, dropout=False), optimizer=AdamW(lr=1e-2), token="t", unit_bytes=None)
    x, y = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    with job.trainer(schedule="offload", memory_budget=8 * 4 * WIDTH * 4) as trainer:
        trainer.step(x, y, torch.nn.functional.mse_loss)
        assert trainer.planning.profile is not None and trainer.planning.profile.host_is_device
        summary = trainer.plan_summary()
    offloaded = sum(1 for op, _ in trainer.plan.actions if op.name == "OFFLOAD")
    assert offloaded > 0 and summary["peak_host_bytes_planned"] > 0
    assert summary["peak_host_bytes_planned"] <= offloaded * 4 * WIDTH * 4


def test_the_profile_keeps_no_stage_output_or_tape_alive(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """The profile measures each stage's tape by running it with autograd and never runs its
    backward: the graph must die with the run. A pack hook that handed autograd the saved tensor
    itself made a cycle through C++ (Tanh saves its output) that no collection frees, so every
    stage's output and tape outlived the profile: a GPU's whole activation memory."""
    import gc
    import weakref

    import wstream.client.stages as stages_module

    outputs: list[weakref.ref[torch.Tensor]] = []
    original = stages_module.StageRunner.call_with

    def call_with(self: stages_module.StageRunner, params: dict, inputs: tuple) -> object:
        out = original(self, params, inputs)
        outputs.append(weakref.ref(out))
        return out

    monkeypatch.setattr(stages_module.StageRunner, "call_with", call_with)
    job = client.create_job("profile-tapes", chain(6, dropout=False), optimizer=AdamW(lr=1e-2), token="t")
    with job.trainer(schedule="optimal", memory_budget=10**6) as trainer:
        trainer.step(torch.randn(4, WIDTH), torch.randn(4, WIDTH), torch.nn.functional.mse_loss)
        gc.collect()
        assert len(outputs) >= 6 and not any(ref() is not None for ref in outputs)


def test_the_profile_does_not_count_its_tape_runs_as_weight_fetch_time(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fetch bandwidth a profile reports (which prices every recomputation's weight fetch)
    is the step's time less what it measured apart: the forwards, the host copies, and the runs
    with autograd that size each stage's tape. A clock that jumps 1000 s in each tape run shows
    whether those are left out."""
    import time as real_time

    import wstream.client.profile as profile_module

    class Clock:
        offset = 0.0

        def perf_counter(self) -> float:
            return real_time.perf_counter() + self.offset

        def __getattr__(self, name: str) -> object:
            return getattr(real_time, name)

    clock = Clock()
    original = profile_module._tape_bytes

    def slow_tape_bytes(*args: object) -> int:
        clock.offset += 1000.0  # a tape run that takes 1000 s
        return original(*args)

    monkeypatch.setattr(profile_module, "time", clock)
    monkeypatch.setattr(profile_module, "_tape_bytes", slow_tape_bytes)
    job = client.create_job("profile-clock", chain(4, dropout=False), optimizer=AdamW(lr=1e-2), token="t", unit_bytes=None)
    with job.trainer(zero_copy=False, schedule="optimal", memory_budget=10**6) as trainer:
        trainer.step(torch.randn(4, WIDTH), torch.randn(4, WIDTH), torch.nn.functional.mse_loss)
        costs = trainer.planning.profile
    assert costs is not None
    weights = sum(costs.weight_bytes)
    assert costs.bandwidth > weights / 1000.0  # the fetches took well under the 4000 s of tape runs


def test_the_offloaded_first_input_is_not_kept_on_the_device_by_the_trainer(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """OFFLOAD 0 frees x_0 from the device until PREFETCH 0 (the plan's budget counts it so); the
    input the trainer placed on the device (here: cast from float64, as a GPU worker copies a CPU
    batch) must not outlive it in the trainer's own references."""
    import gc
    import weakref

    import wstream.client.offload as offload_module
    import wstream.client.trainer as trainer_module

    placed: list[weakref.ref[torch.Tensor]] = []
    original_place = trainer_module.place

    def place(value: object, device: torch.device, dtype: torch.dtype | None = None) -> object:
        out = original_place(value, device, dtype)
        if isinstance(value, torch.Tensor) and value.dtype == torch.float64:
            placed.append(weakref.ref(out))
        return out

    alive: list[bool] = []
    original_to_device = offload_module.HostMover.to_device

    def to_device(self: offload_module.HostMover, pending: offload_module.PendingMove) -> offload_module.PendingMove:
        gc.collect()
        alive.append(placed[-1]() is not None)
        return original_to_device(self, pending)

    monkeypatch.setattr(trainer_module, "place", place)
    monkeypatch.setattr(offload_module.HostMover, "to_device", to_device)
    job = client.create_job("x0-freed", chain(8, dropout=False), optimizer=AdamW(lr=1e-2), token="t", unit_bytes=None)
    with job.trainer(schedule="offload", memory_budget=6 * 4 * WIDTH * 4) as trainer:
        for _ in range(2):
            trainer.step(torch.randn(4, WIDTH, dtype=torch.float64), torch.randn(4, WIDTH), torch.nn.functional.mse_loss)
    assert placed and alive and not any(alive)


def test_a_budget_no_plan_fits_is_refused_before_training_with_the_least_that_works(client: Client) -> None:
    job = client.create_job("tiny-budget", chain(8, dropout=False), optimizer=AdamW(lr=1e-2), token="t")
    from wstream.client.plans import PlanError

    with job.trainer(schedule="optimal", memory_budget=64) as trainer:
        with pytest.raises(PlanError, match=r"least any plan needs is \d+ bytes"):
            trainer.step(torch.randn(4, WIDTH), torch.randn(4, WIDTH), torch.nn.functional.mse_loss)
    assert client.status().jobs[-1].step == 0  # nothing was applied
