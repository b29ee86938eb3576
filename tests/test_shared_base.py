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
from wstream.client import AdamW, AuthError, Client, LayoutError, StateError

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
