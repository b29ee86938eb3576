"""A frozen base held once, and several jobs training their own parameters on top of it."""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import start_server
from test_equivalence import assert_weights_equal
from test_ties import VOCAB, Block, Embed, TiedHead
from test_ties import batch as lm_batch
from test_ties import loss_fn as lm_loss
from wstream.client import AdamW, AuthError, Client, LayoutError, StateError, Tied

WIDTH, STAGES, STEPS = 16, 4, 5


class Dense(nn.Module):
    """A base stage: tanh(x W^T + b)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)
        self.bias = nn.Parameter(torch.randn(WIDTH) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight.T + self.bias)


class LoraDense(Dense):
    """The same stage with a rank-2 adapter: W + B A; W and b come from the base (frozen)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight.requires_grad_(False)
        self.bias.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(2, WIDTH) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(WIDTH, 2) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ (self.weight + self.lora_b @ self.lora_a).T + self.bias)


def base_stages() -> list[Dense]:
    torch.manual_seed(0)
    return [Dense() for _ in range(STAGES)]


def adapted(base: list[Dense], seed: int) -> list[LoraDense]:
    torch.manual_seed(seed)
    out = [LoraDense() for _ in range(STAGES)]
    for a, b in zip(out, base):
        a.weight.data.copy_(b.weight.data)
        a.bias.data.copy_(b.bias.data)
    return out


def batch(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * seed + step)
    return torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)


def trained_alone(stages: list[LoraDense], seed: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch: the adapters trained with AdamW, the base weights fixed."""
    model = nn.Sequential(*stages)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for t in range(STEPS):
        opt.zero_grad()
        x, y = batch(seed, t)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v for k, v in model.state_dict().items() if "lora" in k}


def test_two_jobs_fine_tune_one_base_at_once_each_as_if_alone(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--memory-limit", "1GiB")
    base = base_stages()
    base_copy = copy.deepcopy(base)
    seeds = {"ft-zero-copy": 1, "ft-copy": 2, "ft-frames": 3}
    starts = {name: copy.deepcopy(adapted(base_copy, seed)) for name, seed in seeds.items()}
    options = {"ft-zero-copy": {}, "ft-copy": {"zero_copy": False}, "ft-frames": {"shm": False}}
    try:
        with Client(srv.address, timeout=30) as client:
            client.create_job("base", base, token="base-token", frozen=True)
            jobs = {
                name: client.create_job(
                    name, adapted(base_copy, seed), optimizer=AdamW(lr=1e-2), token=f"t-{name}", base="base",
                    base_token="base-token",
                )
                for name, seed in seeds.items()
            }
            errors: list[BaseException] = []

            def train(name: str) -> None:
                try:
                    with jobs[name].trainer(**options[name]) as trainer:
                        for t in range(STEPS):
                            trainer.step(*batch(seeds[name], t), nn.functional.mse_loss)
                except BaseException as exc:  # reported below
                    errors.append(exc)

            threads = [threading.Thread(target=train, args=(name,)) for name in seeds]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            assert not errors, errors
            for name, seed in seeds.items():
                got = jobs[name].state_dict()
                assert set(got) == {f"{i}.lora_{ab}" for i in range(STAGES) for ab in "ab"}  # the adapters only
                assert_weights_equal(got, trained_alone(starts[name], seed), atol=1e-6)
            status = {j.name: j for j in client.status().jobs}
            base_bytes = STAGES * (WIDTH * WIDTH + WIDTH) * 4
            assert status["base"].frozen and status["base"].bytes >= base_bytes
            assert status["base"].bytes < 2 * base_bytes  # weights only: no optimizer state
            for name in seeds:
                assert status[name].base == "base"
                assert status[name].bytes < status["base"].bytes  # the base is not counted again
            assert client.status().memory_used == sum(j.bytes for j in status.values())
            # the base stays while jobs use it; they go first
            with pytest.raises(StateError, match=r"base of \['ft-copy', 'ft-frames', 'ft-zero-copy'\]"):
                client.attach_job("base", token="base-token").drop()
    finally:
        assert srv.stop() == 0, srv.log()


def test_what_a_base_refuses(client: Client) -> None:
    client.create_job("base", base_stages(), token="base-token", frozen=True)
    with pytest.raises(AuthError, match="wrong token for the base 'base'"):
        client.create_job("x", adapted(base_stages(), 1), token="t", base="base", base_token="guess")

    class Wider(LoraDense):
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(WIDTH + 1), requires_grad=False)

    with pytest.raises(LayoutError, match=r"frozen parameter 'bias' has shape \(17,\), the base's \(16,\)"):
        client.create_job("y", [Wider() for _ in range(STAGES)], token="t", base="base", base_token="base-token")
    with pytest.raises(LayoutError, match="has 2 stages; its base 'base' has 4"):
        client.create_job("z", adapted(base_stages(), 1)[:2], token="t", base="base", base_token="base-token")
    with pytest.raises(StateError, match="frozen base: nothing trains it"):
        client.attach_job("base", token="base-token", stages=base_stages()).trainer()
    assert {j.name for j in client.status().jobs} == {"base"}  # nothing half-made was left


def test_a_base_and_its_jobs_resume_after_a_restart(tmp_path: Path) -> None:
    store = tmp_path / "store"
    srv = start_server(tmp_path, "--store", str(store), name="a")
    base = base_stages()
    start = adapted(copy.deepcopy(base), 1)
    with Client(srv.address, timeout=30) as client:
        client.create_job("base", base, token="base-token", frozen=True)
        job = client.create_job("ft", copy.deepcopy(start), optimizer=AdamW(lr=1e-2), token="t", base="base", base_token="base-token")
        with job.trainer() as trainer:
            for t in range(3):
                trainer.step(*batch(1, t), nn.functional.mse_loss)
        assert job.save()[0] == 3
    srv.stop()
    srv = start_server(tmp_path, "--store", str(store), name="b", address=srv.address)
    try:
        with Client(srv.address, timeout=30) as client:
            with torch.device("meta"):
                skeleton = adapted(base_stages(), 1)
            job = client.attach_job("ft", token="t", stages=skeleton)
            with job.trainer() as trainer:
                assert trainer.step_index == 3
                for t in range(3, STEPS):
                    trainer.step(*batch(1, t), nn.functional.mse_loss)
            got = job.state_dict()
        assert_weights_equal(got, trained_alone(start, 1), atol=1e-6)
    finally:
        assert srv.stop() == 0, srv.log()


def test_forward_of_a_job_on_a_base_reads_the_base(client: Client) -> None:
    base = base_stages()
    start = adapted(copy.deepcopy(base), 4)
    client.create_job("base", base, token="base-token", frozen=True)
    job = client.create_job("fwd", copy.deepcopy(start), token="t", base="base", base_token="base-token")
    x, _ = batch(4, 0)
    with job.trainer() as trainer, torch.no_grad():
        assert torch.allclose(trainer.forward(x), nn.Sequential(*start)(x), atol=1e-6)


# ---- ties and stages frozen whole on a base (issue 19) -------------------------------------------------


class Head(nn.Module):
    """An untied LM head (its own matrix)."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(8, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x)


def lm_base(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [Embed(), Block(), Block(), Block()]


def fine_tune(base: list[nn.Module], frozen: dict[int, str]) -> list[nn.Module]:
    """A copy of ``base`` whose stage i has ``frozen[i]``: "all" (every parameter frozen: read
    from the base), "tok" (only the token embedding frozen) or nothing frozen."""
    out = copy.deepcopy(base)
    for i, how in frozen.items():
        if how == "all":
            out[i].requires_grad_(False)
        elif how == "tok":
            out[i].tok.weight.requires_grad_(False)
    return out


def lm_reference(stages: list[nn.Module], head: nn.Module | None, steps: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch: the same chain, AdamW on the parameters with ``requires_grad``; without
    ``head`` the logits use the embedding's token matrix (tied)."""
    embed = stages[0]
    params = [p for s in [*stages, *([head] if head is not None else [])] for p in s.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    for t in range(steps):
        opt.zero_grad()
        x, y = lm_batch(t)
        h = x
        for s in stages:
            h = s(h)
        logits = head(h) if head is not None else nn.functional.linear(h, embed.tok.weight)
        lm_loss(logits, y).backward()
        opt.step()
    out = {}
    for i, s in enumerate([*stages, *([head] if head is not None else [])]):
        out.update({f"{i}.{k}": v for k, v in s.named_parameters() if v.requires_grad})
    return out


def test_a_head_tied_to_the_frozen_embedding_of_the_base_trains(client: Client) -> None:
    base = lm_base()
    client.create_job("lm-base", copy.deepcopy(base), token="base-token", frozen=True)
    stages = fine_tune(base, {0: "tok"})  # the position table trains, the token matrix is the base's
    want = lm_reference(copy.deepcopy(stages), None, STEPS)
    head = TiedHead().to("meta").requires_grad_(False)  # reads the base's matrix, like the embedding
    job = client.create_job(
        "tied-ft", [*stages, Tied(0, head)], optimizer=AdamW(lr=1e-2), token="t", base="lm-base", base_token="base-token"
    )
    assert job.positions == [0, 1, 2, 3, 0]
    assert "tok.weight" not in {p.name for p in job.specs[0].params}  # held once, by the base
    with job.trainer() as trainer:
        for t in range(STEPS):
            trainer.step(*lm_batch(t), lm_loss)
    assert_weights_equal(job.state_dict(), want, atol=1e-5)


def test_a_tied_position_on_a_base_must_name_parameters_of_the_stage_or_its_base(client: Client) -> None:
    client.create_job("lm-base", lm_base(), token="base-token", frozen=True)

    class Wrong(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(VOCAB + 1, 8)

    head = Wrong().to("meta").requires_grad_(False)
    with pytest.raises(LayoutError, match=r"parameter 'tok.weight' \(18, 8\) is not one of stage 0's or its base's"):
        client.create_job("bad", [*fine_tune(lm_base(), {0: "tok"}), Tied(0, head)], token="t", base="lm-base",
                          base_token="base-token")
    assert {j.name for j in client.status().jobs} == {"lm-base"}


@pytest.mark.parametrize("frozen", [{0: "all", 2: "all"}, {0: "all", 1: "all", 2: "all"}, {2: "all", 3: "all"}],
                         ids=["first-and-middle", "all-but-the-last-block", "the-last-blocks"])
def test_stages_frozen_whole_on_a_base_run_and_push_nothing(client: Client, frozen: dict[int, str]) -> None:
    """A stage frozen whole holds nothing of its own (every weight is the base's): it is fetched,
    runs forward and backward (the input gradient, for the stages below), pushes nothing."""
    base = [*lm_base(), Head()]
    client.create_job("lm-base", copy.deepcopy(base), token="base-token", frozen=True)
    stages = fine_tune(base, frozen)
    want = lm_reference(copy.deepcopy(stages[:-1]), copy.deepcopy(stages[-1]), STEPS)
    job = client.create_job(
        "frozen-ft", stages, optimizer=AdamW(lr=1e-2), token="t", base="lm-base", base_token="base-token"
    )
    for i in frozen:
        assert job.specs[i].params == []  # nothing of its own: every weight is the base's
    with job.trainer() as trainer:
        for t in range(STEPS):
            trainer.step(*lm_batch(t), lm_loss)
        stats = trainer.stats()
    assert stats.pushes == (5 - len(frozen)) * STEPS  # the frozen stages push nothing
    assert_weights_equal(job.state_dict(), want, atol=1e-5)
