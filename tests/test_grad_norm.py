"""NOTE [Gradient norms] (wstream/protocol/grad_norm.py): the squared norm a push carries and the
server's clipping adds up, against a float64 reference; the gather's one-pass sum and norm against
the sum then the norm."""

from __future__ import annotations

import math

import pytest
import torch

from wstream.protocol.grad_norm import NORM_CHUNK, accumulate_with_norm, squared_norm, squared_norm_tensor


def exact(t: torch.Tensor) -> float:
    return float(torch.sum(torch.square(t.double())))


def gradient(numel: int, seed: int = 0) -> torch.Tensor:
    g = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 1e-3
    g[::7] *= 50  # a few large entries, as gradients have
    return g


@pytest.mark.parametrize("numel", [0, 1, 1000, NORM_CHUNK, NORM_CHUNK + 1, 3 * NORM_CHUNK + 17])
def test_squared_norm_is_within_2e_5_of_float64(numel: int) -> None:
    g = gradient(numel)
    assert squared_norm(g) == pytest.approx(exact(g), rel=2e-5, abs=0.0)
    assert float(squared_norm_tensor(g)) == squared_norm(g)  # the CPU tensor form is the same float


def test_squared_norm_is_more_accurate_than_a_float32_vector_norm_on_a_large_gradient() -> None:
    """The reason for the module: fp32 ``vector_norm`` drifts with the length of the gradient."""
    g = gradient(8 * NORM_CHUNK, seed=1)
    want = exact(g)
    ours = abs(squared_norm(g) - want) / want
    theirs = abs(float(torch.linalg.vector_norm(g)) ** 2 - want) / want
    assert ours < 2e-5 and ours < theirs / 10


def test_overflow_of_float32_squares_is_not_read_as_non_finite() -> None:
    g = torch.zeros(2 * NORM_CHUNK + 5)
    g[3] = 3e19  # its square, 9e38, is past float32's range; the gradient is finite
    g[NORM_CHUNK + 9] = 1.0
    assert squared_norm(g) == pytest.approx(exact(g), rel=1e-12) and exact(g) > 8e38
    small = torch.tensor([3e19, 4e19])
    assert squared_norm(small) == pytest.approx(exact(small), rel=1e-12) and exact(small) > 2e39


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_gradient_holding_inf_or_nan_reads_as_non_finite(bad: float) -> None:
    g = gradient(2 * NORM_CHUNK)
    g[NORM_CHUNK + 3] = bad
    assert not math.isfinite(squared_norm(g))
    dst = torch.empty_like(g)
    assert not math.isfinite(accumulate_with_norm(dst, [g], first=True, norm_numel=g.numel()))


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("first", [True, False])
def test_accumulate_with_norm_is_the_sum_and_its_squared_norm(workers: int, first: bool) -> None:
    numel, norm_numel = 2 * NORM_CHUNK + 100, 2 * NORM_CHUNK - 7  # buffers' values after the gradient
    sources = [gradient(numel, seed=s) for s in range(workers)]
    start = gradient(numel, seed=9)
    dst = start.clone()
    got = accumulate_with_norm(dst, sources, first=first, norm_numel=norm_numel)
    want = sum(sources, torch.zeros(numel)) if first else start + sum(sources, torch.zeros(numel))
    torch.testing.assert_close(dst, want, rtol=0, atol=1e-6)
    assert got == squared_norm(dst[:norm_numel])  # the same float as the norm of the result
    with pytest.raises(ValueError, match="at least one source"):
        accumulate_with_norm(dst, [], first=True, norm_numel=1)
