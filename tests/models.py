"""Small deterministic models used by the tests (and by worker subprocesses, by name)."""

from __future__ import annotations

import torch
from torch import nn


class Residual(nn.Module):
    """LayerNorm + MLP with a residual connection inside one stage."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class DropoutBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.tanh(self.lin(x)))


def mixed(seed: int = 0) -> list[nn.Module]:
    """Non-uniform stages: different widths, LayerNorm, a residual stage, a bias-free head."""
    torch.manual_seed(seed)
    return [
        nn.Sequential(nn.Linear(12, 32), nn.Tanh()),
        Residual(32, 64),
        nn.Sequential(nn.Linear(32, 48), nn.LayerNorm(48), nn.GELU()),
        Residual(48, 24),
        nn.Linear(48, 5, bias=False),
    ]


def dropout_chain(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [DropoutBlock(16) for _ in range(4)] + [nn.Linear(16, 5)]


def deep(n: int = 64, width: int = 256, seed: int = 0) -> list[nn.Module]:
    """``n`` equal stages of ``width x width`` weights (about width^2 * 4 bytes each)."""
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n)]


def deep_wide(n: int) -> list[nn.Module]:
    """``n`` stages of 1024 x 1024 (about 4 MiB each): for the residency test."""
    return [nn.Sequential(nn.Linear(1024, 1024), nn.Tanh()) for _ in range(n)]


def batchnorm(seed: int = 0) -> list[nn.Module]:
    """Stages with BatchNorm (buffers: running statistics and a count), no bias before a norm."""
    torch.manual_seed(seed)
    return [
        nn.Sequential(nn.Linear(12, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU()),
        nn.Sequential(nn.Linear(16, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU()),
        nn.Linear(16, 5),
    ]


BUILDERS = {
    "batchnorm": batchnorm,
    "mixed": mixed,
    "dropout_chain": dropout_chain,
    "deep": deep,
    "deep_wide16": lambda: deep_wide(16),
    "deep_wide64": lambda: deep_wide(64),
}

IN_FEATURES = {"batchnorm": 12, "mixed": 12, "dropout_chain": 16, "deep": 256, "deep_wide16": 1024, "deep_wide64": 1024}
OUT_FEATURES = {"batchnorm": 5, "mixed": 5, "dropout_chain": 5, "deep": 256, "deep_wide16": 1024, "deep_wide64": 1024}


def batch(model: str, step: int, rank: int = 0, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic data for (step, rank)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, IN_FEATURES[model], generator=g)
    y = torch.randn(size, OUT_FEATURES[model], generator=g)
    return x, y


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)
