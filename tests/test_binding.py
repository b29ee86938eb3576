"""Binding (client/binding.py, NOTE [Binding]): a skeleton run on given tensors gives what
``torch.func.functional_call`` gives, and leaves the skeleton as it was."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from wstream.client import SGD, Client
from wstream.client.binding import Binding
from wstream.client.stages import skeleton_of


class TiedPair(nn.Module):
    """One weight under two names (``a.weight`` and ``b.weight``), as a tied LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6, bias=False)
        self.b = nn.Linear(6, 6, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class Replacer(nn.Module):
    """Replaces its buffer instead of updating it in place."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count + 1
        return x * self.count


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.LayerNorm(6)),
        TiedPair,
        lambda: nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6)),
    ],
)
def test_a_binding_computes_what_functional_call_computes_with_gradients(make) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    module = make()
    skeleton = skeleton_of(copy.deepcopy(module))  # as the worker makes it (ties kept)
    x = torch.randn(5, 6)
    mine, theirs = _tensors(module), _tensors(module)
    for tensors in (mine, theirs):
        for k, v in tensors.items():
            if v.is_floating_point() and "running" not in k:
                v.requires_grad_(True)
    if isinstance(module, TiedPair):  # functional_call takes one name of a tied tensor
        mine.pop("b.weight"), theirs.pop("b.weight")
    got = Binding(skeleton)(mine, (x,))
    want = torch.func.functional_call(skeleton, theirs, (x,))
    assert torch.equal(got, want)
    leaves = [k for k, v in mine.items() if v.requires_grad]
    g_got = torch.autograd.grad(got.sum(), [mine[k] for k in leaves])
    g_want = torch.autograd.grad(want.sum(), [theirs[k] for k in leaves])
    for a, b in zip(g_got, g_want):
        assert torch.equal(a, b)
    for k in mine:  # BatchNorm's running statistics were updated in the given tensors, as there
        assert torch.equal(mine[k].detach(), theirs[k].detach()), k
    assert all(p.is_meta for p in skeleton.parameters()) and all(b.is_meta for b in skeleton.buffers())


def test_a_replaced_tensor_comes_back_to_the_caller_and_the_skeleton_is_restored_after_an_error() -> None:
    skeleton = Replacer().to("meta")
    binding = Binding(skeleton)
    tensors = {"count": torch.zeros(())}
    assert torch.equal(binding(tensors, (torch.ones(2),)), torch.ones(2))
    assert tensors["count"].item() == 1.0  # as functional_call writes back a replaced buffer
    assert skeleton.count.is_meta
    seq = nn.Sequential(nn.Linear(6, 6)).to("meta")
    with pytest.raises(RuntimeError):
        Binding(seq)({"0.weight": torch.zeros(6, 6), "0.bias": torch.zeros(6)}, (torch.zeros(2, 5),))  # wrong width
    assert seq[0].weight.is_meta and seq[0].bias.is_meta


def test_a_name_the_skeleton_does_not_hold_goes_to_functional_call() -> None:
    skeleton = nn.Linear(3, 3).to("meta")
    tensors = {"weight": torch.eye(3), "bias": torch.zeros(3), "extra": torch.ones(1)}
    out = Binding(skeleton)(tensors, (torch.ones(1, 3),))
    assert torch.equal(out, torch.ones(1, 3))
    assert not hasattr(skeleton, "extra") and skeleton.weight.is_meta


def test_a_stage_with_a_tensor_tied_inside_it_trains_as_plain_pytorch(client: Client) -> None:
    torch.manual_seed(0)
    stages = [nn.Linear(6, 6), TiedPair(), nn.Linear(6, 3)]
    ref = nn.Sequential(*copy.deepcopy(stages))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    job = client.create_job("tied-inside", stages, optimizer=SGD(lr=0.1), token="t")
    data = [(torch.randn(4, 6), torch.randn(4, 3)) for _ in range(3)]
    with job.trainer() as trainer:
        for x, y in data:
            trainer.step(x, y, nn.functional.mse_loss)
    for x, y in data:
        opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
    want = dict(ref.named_parameters())  # the tied weight once, as the job stores it
    got = job.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k].detach(), rtol=0, atol=1e-6)


def test_a_skeleton_keeps_a_buffer_shared_by_two_submodules() -> None:
    module = nn.Module()
    module.a, module.b = nn.Module(), nn.Module()
    shared = torch.ones(2)
    module.a.register_buffer("m", shared)
    module.b.register_buffer("m", shared)
    skeleton = skeleton_of(module)
    assert skeleton.a.m.is_meta and skeleton.a.m is skeleton.b.m


def test_positions_keep_their_leaves_from_step_to_step_until_another_prefetcher_serves_them(client: Client) -> None:
    """NOTE [Kept leaves] in client/stages.py: a position's parameter leaves are cut once and
    served step after step (the same tensors, reading the weights each update wrote in place), and
    dropped when a reconnect brings a new prefetcher (new ring, new mapping), so no old mapping is
    kept alive; the weights stay plain PyTorch's throughout."""
    import gc
    import weakref

    from wstream.protocol.errors import ServerUnavailable

    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(6, 6), nn.GELU()) for _ in range(5)]
    ref = nn.Sequential(*copy.deepcopy(stages))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    job = client.create_job("kept-leaves", stages, optimizer=SGD(lr=0.1), token="t", unit_bytes=2 * 42 * 4)
    data = [(torch.randn(4, 6), torch.randn(4, 6)) for _ in range(4)]

    def leaves_of(trainer) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
        return [leaf for r in trainer.executor.runners for leaf in r._kept_leaves.values()]

    with job.trainer(schedule="revolve", slots=2) as trainer:
        assert trainer.zero_copy  # the published weights at one address, step after step
        trainer.step(*data[0], nn.functional.mse_loss)
        first = leaves_of(trainer)
        assert len(first) == 2 * len(stages)
        trainer.step(*data[1], nn.functional.mse_loss)
        assert all(a is b for a, b in zip(leaves_of(trainer), first, strict=True))  # not cut again
        old = [weakref.ref(leaf) for leaf in first]
        del first
        trainer.connection.recover(ServerUnavailable("a test reconnects"))
        for x, y in data[2:]:
            trainer.step(x, y, nn.functional.mse_loss)
        gc.collect()
        assert all(w() is None for w in old), "a leaf of the old prefetcher's memory outlived the reconnect"
        assert len(leaves_of(trainer)) == 2 * len(stages)
    for x, y in data:
        opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
    got = job.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-6)


def test_run_own_binds_a_dict_as_it_is_and_always_restores_the_skeleton() -> None:
    """``Binding.run_own`` (NOTE [Kept leaves] in client/stages.py): the same values as a bound
    call, a tied tensor's every alias bound, nothing written into the caller's dict (a replaced
    buffer is not handed back: the next run binds the kept tensors again), and the skeleton's own
    meta tensors back after a run and after a run that raises."""
    torch.manual_seed(0)
    module = TiedPair()
    skeleton = skeleton_of(copy.deepcopy(module))
    tensors = {k: v for k, v in _tensors(module).items() if k != "b.weight"}
    x = torch.randn(3, 6)
    binding = Binding(skeleton)
    assert torch.equal(binding.run_own(tensors, (x,)), module(x))
    assert all(p.is_meta for p in skeleton.parameters())
    replacer = Binding(Replacer().to("meta"))
    kept = {"count": torch.zeros(())}
    for _ in range(2):  # the replaced buffer is dropped: every run starts from the kept zero
        assert torch.equal(replacer.run_own(kept, (torch.ones(2),)), torch.ones(2))
    assert kept["count"].item() == 0.0 and replacer.module.count.is_meta
    seq = nn.Sequential(nn.Linear(6, 6)).to("meta")
    with pytest.raises(RuntimeError):
        Binding(seq).run_own({"0.weight": torch.zeros(6, 6), "0.bias": torch.zeros(6)}, (torch.zeros(2, 5),))
    assert seq[0].weight.is_meta and seq[0].bias.is_meta
