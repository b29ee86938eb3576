"""Taped forwards: a stage's graph kept from its forward, so that its backward's recomputation stops
before its last operation (NOTE [Taped forwards and early stop] in client/plans/taping.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import models
from test_equivalence import assert_weights_equal, reference_train
from wstream.client import AdamW, Client
from wstream.client.plans import Op, divide_and_conquer, revolve, sqrt_segments, store_all
from wstream.client.plans.taping import taped_advances

A, S, R, F, B, O, P = Op.ADVANCE, Op.SNAPSHOT, Op.RESTORE, Op.FREE, Op.BACKWARD, Op.OFFLOAD, Op.PREFETCH


def positions(plan_actions, taped) -> list[int]:
    return sorted(plan_actions[a][1] for a in taped)


def test_store_all_tapes_every_advance() -> None:
    plan = store_all(6)
    assert positions(plan.actions, taped_advances(plan.actions)) == [0, 1, 2, 3, 4]


def test_sqrt_tapes_the_last_forward_of_each_kept_input() -> None:
    plan = sqrt_segments(9)
    # segments [0-2], [3-5], [6-8]: 2 and 5 are never kept, so their forwards hold nothing the plan holds
    assert positions(plan.actions, taped_advances(plan.actions)) == [0, 1, 3, 4, 6, 7]
    taped = taped_advances(plan.actions)
    for a in taped:  # the last ADVANCE of its position before that position's BACKWARD
        op, i = plan.actions[a]
        b = plan.actions.index((B, i))
        assert op == A and a < b and (A, i) not in plan.actions[a + 1 : b]


@pytest.mark.parametrize("actions, want", [
    # x_1 is not kept: holding it from the ADVANCE of 1 to its BACKWARD would cost memory (rule 2)
    ([(S, 0), (A, 0), (A, 1), (B, 2), (R, 0), (A, 0), (B, 1), (R, 0), (B, 0)], [0]),
    # x_2 (the output of 1) is consumed by an ADVANCE, not kept for the BACKWARD of 2 (rule 3)
    ([(S, 0), (A, 0), (S, 1), (A, 1), (A, 2), (B, 3), (R, 0), (A, 0), (A, 1), (B, 2), (R, 1), (B, 1), (R, 0), (B, 0)], []),
    # a compute between the BACKWARD of i + 1 and that of i (rule 4): the recomputation of 0 to reach 1
    ([(S, 0), (A, 0), (S, 1), (A, 1), (B, 2), (R, 0), (A, 0), (B, 1), (R, 0), (B, 0)], [0]),
    # x_1 offloaded, dropped on the device by the ADVANCE of 1 and prefetched back for its BACKWARD:
    # neither forward holds only what the plan holds (rules 2 and 3)
    ([(S, 0), (A, 0), (O, 1), (A, 1), (B, 2), (P, 1), (R, 1), (B, 1), (R, 0), (B, 0)], []),
    # the same with x_1 also kept on the device: both forwards are taped
    ([(S, 0), (A, 0), (S, 1), (O, 1), (A, 1), (B, 2), (R, 1), (B, 1), (R, 0), (B, 0)], [0, 1]),
])
def test_a_forward_is_taped_only_where_its_graph_costs_no_memory(actions, want) -> None:
    assert positions(actions, taped_advances(actions)) == want


def test_revolve_and_bisection_tape_only_what_their_plans_keep() -> None:
    for plan in (revolve(20, 4), divide_and_conquer(20)):
        for a in taped_advances(plan.actions):
            op, i = plan.actions[a]
            assert op == A and i < plan.n - 1


class Counted(nn.Module):
    """Counts its completed forwards: an early-stopped recomputation never completes its last op."""

    def __init__(self, module: nn.Module, counter: list[int]) -> None:
        super().__init__()
        self.module = module
        self.counter = counter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.module(x)
        self.counter[0] += 1
        return out


def counted_chain(n: int, counter: list[int], seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), Counted(nn.Linear(32, 16), counter)) for _ in range(n)]


@pytest.mark.parametrize(("schedule", "k"), [("store_all", 1), ("sqrt", 1), ("revolve", 1), ("dnc", 1), ("store_all", 2), ("revolve", 3)])
def test_early_stop_trains_as_plain_pytorch_and_skips_the_last_op(client: Client, schedule: str, k: int) -> None:
    """``k`` micro-batches: each keeps its own graph, and plain PyTorch accumulates them."""
    n, steps = 9, 3
    runs: dict[bool, tuple[dict, list[float], int]] = {}
    tapings: dict[bool, int] = {}
    for early in (False, True):
        counter = [0]
        stages = counted_chain(n, counter)
        job = client.create_job(f"es-{schedule}-{k}-{early}", stages, optimizer=AdamW(lr=1e-2), token="t", unit_bytes=None)
        g = torch.Generator().manual_seed(5)
        data = [(torch.randn(12, 16, generator=g), torch.randn(12, 16, generator=g)) for _ in range(steps)]
        with job.trainer(schedule=schedule, early_stop=early) as trainer:
            losses = [trainer.step(x, y, torch.nn.functional.mse_loss, micro_batches=k) for x, y in data]
            summary = trainer.plan_summary()
            forwards, taped = summary["forward_evaluations"], summary["early_stopped_recomputations"]
            assert taped == (len(trainer.planning.taped) if early else 0)
        runs[early] = (job.state_dict(), losses, counter[0])
        tapings[early] = taped
    plain_counter = [0]
    want = reference_train_on(counted_chain(n, plain_counter), data, k)
    for early, (got, losses, count) in runs.items():
        assert_weights_equal(got, want, atol=5e-6)  # 3 steps of AdamW at lr 1e-2 move them by ~3e-2
    assert runs[True][1] == runs[False][1]
    # without early stop every forward evaluation completes the last op (once per micro-batch);
    # with it, the taped ones' recomputations do not
    assert runs[False][2] == steps * k * forwards
    assert runs[True][2] == steps * k * (forwards - tapings[True])
    assert tapings[True] > 0 and tapings[False] == 0


def reference_train_on(stages: list[nn.Module], data, k: int = 1) -> dict[str, torch.Tensor]:
    """Plain PyTorch, accumulating ``k`` micro-batches per step."""
    ref = nn.Sequential(*stages)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, y in data:
        opt.zero_grad()
        for xj, yj in zip(torch.tensor_split(x, k), torch.tensor_split(y, k)):
            (torch.nn.functional.mse_loss(ref(xj), yj) / k).backward()
        opt.step()
    return ref.state_dict()


def test_early_stop_replays_dropout_and_freezes_as_plain_pytorch(client: Client) -> None:
    """Dropout masks of the stopped recomputation are the forward's (RNG replayed), and a frozen
    first stage (no input gradient wanted below it) trains as plain PyTorch does."""
    stages = models.dropout_chain(seed=4)
    for p in stages[0].parameters():
        p.requires_grad_(False)
    start = copy.deepcopy(stages)
    job = client.create_job("es-drop", stages, optimizer=AdamW(lr=3e-3), token="t", unit_bytes=None)
    torch.manual_seed(11)
    with job.trainer(early_stop=True) as trainer:
        for s in range(4):
            trainer.step(*models.batch("dropout_chain", s), models.loss_fn)
        assert len(trainer.planning.taped) == 4
    torch.manual_seed(11)
    want = reference_train(start, lambda p: torch.optim.AdamW([q for q in p if q.requires_grad], lr=3e-3), "dropout_chain", 4)
    assert_weights_equal(job.state_dict(), want, atol=1e-6)


def test_early_stop_defaults_to_large_stages(client: Client) -> None:
    small = client.create_job("es-small", models.mixed(), optimizer=AdamW(lr=1e-3), token="t")
    with small.trainer() as trainer:
        assert not any(trainer.executor.tapes)
    with small.trainer(early_stop=True) as trainer:
        assert all(trainer.executor.tapes)


class InnerCheckpoint(nn.Module):
    """A stage whose forward checkpoints part of itself (what wstream's schedule does already)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 16)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return self.b(checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=self.reentrant))


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # the reentrant one, in a no-grad forward
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("early_stop", [False, True])
def test_a_checkpoint_inside_a_stage_is_named_and_nothing_is_applied(client: Client, reentrant: bool, early_stop: bool) -> None:
    torch.manual_seed(0)
    job = client.create_job(f"inner-{reentrant}-{early_stop}", [InnerCheckpoint(reentrant) for _ in range(3)],
                            optimizer=AdamW(lr=1e-2), token="t", unit_bytes=None)
    before = job.state_dict()
    with job.trainer(early_stop=early_stop) as trainer:
        with pytest.raises(RuntimeError, match=r"position \d \(in weight stage \d\).*torch.utils.checkpoint.*remove the inner checkpoint"):
            trainer.step(torch.randn(4, 16), torch.randn(4, 16), torch.nn.functional.mse_loss)
    after = job.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_hugging_faces_gradient_checkpointing_is_refused_at_creation(client: Client) -> None:
    stage = nn.Sequential(nn.Linear(16, 16))
    stage[0].gradient_checkpointing = True  # what gradient_checkpointing_enable() sets on a layer
    from wstream.client import LayoutError

    with pytest.raises(LayoutError, match=r"stage 1: module '0' has gradient checkpointing on .*gradient_checkpointing_disable\(\)"):
        client.create_job("hf-gc", [nn.Linear(16, 16), stage], optimizer=AdamW(), token="t")


def test_a_failed_step_with_taped_forwards_frees_what_it_held(client: Client) -> None:
    """A step that fails between a taped forward and its backward (here its loss raises) leaves
    nothing of its run alive once it is gone (defect seen: the RNG context of each taped forward
    held the run, inside the graph the run held: a cycle through autograd's nodes that Python's
    collector cannot see, so every failed step kept its activations for good)."""
    import gc

    from wstream.client.plan_run import PlanRun

    def runs_alive() -> int:
        gc.collect()
        return sum(type(o) is PlanRun for o in gc.get_objects())

    def failing_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected: the loss failed")

    job = client.create_job("es-failed", models.mixed(), optimizer=AdamW(lr=1e-3), token="t")
    with job.trainer(early_stop=True, schedule="store_all") as trainer:
        assert all(trainer.executor.tapes)
        before = runs_alive()
        for _ in range(3):
            with pytest.raises(RuntimeError, match="injected"):
                trainer.step(*models.batch("mixed", 0), failing_loss)
        assert runs_alive() == before, "the failed steps' runs are still alive"
        trainer.step(*models.batch("mixed", 0), models.loss_fn)  # and the next step trains


def test_early_stop_by_default_reads_each_positions_own_size_not_its_units(client: Client) -> None:
    """By default only stages of at least ``EARLY_STOP_MIN_NUMEL`` elements are taped; small stages
    grouped into one large transfer unit stay untaped (defect seen: the unit's size was read, so
    every small stage of a large unit was taped)."""
    from wstream.client.taped import EARLY_STOP_MIN_NUMEL

    width = 128
    n = EARLY_STOP_MIN_NUMEL // (width * width + width) + 2  # a unit of them is above the threshold
    torch.manual_seed(0)
    stages = [nn.Linear(width, width) for _ in range(n)]
    job = client.create_job("es-units", stages, optimizer=AdamW(lr=1e-3), token="t", unit_bytes=64 << 20)
    with job.trainer() as trainer:
        assert len(trainer.connection.sc.numels) < n  # grouped into units
        assert not any(trainer.executor.tapes)
