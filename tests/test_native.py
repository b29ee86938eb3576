"""The server's native kernels (NOTE [Native kernels] in wstream/server/native.py): AdamW is torch's
fused AdamW to the bit (but in a parameter's last few elements, which torch's own loop computes
otherwise: within a float's rounding there), the published copy is the master's, the sum of several
gradients is torch's sum and its norm the float64 one. (Without a compiler the torch paths run:
tests/test_native_off.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from wstream.protocol import AdamW
from wstream.protocol import messages as m
from wstream.protocol.grad_norm import NORM_CHUNK, accumulate
from wstream.protocol.layout import build_stage_spec
from wstream.server import native
from wstream.server.optimizer import StageOptimizer

pytestmark = pytest.mark.skipif(
    (shutil.which("cc") is None and not os.environ.get("CC")) or os.environ.get("WSTREAM_NATIVE") == "0",
    reason="no C compiler here, or the kernels are turned off (WSTREAM_NATIVE=0); tests/test_native_off.py runs",
)


@pytest.fixture(autouse=True)
def loaded() -> None:
    assert native.available(), "a C compiler is here, yet the native kernels did not build (see the log)"


TAIL = 16
"""torch's fused CPU AdamW runs a parameter's last ``numel % 16`` (AVX-512; 8 on AVX2) elements
through another loop, whose rounding the kernel does not copy."""


def assert_same_but_tails(got: torch.Tensor, want: torch.Tensor, params: list[tuple[int, int]]) -> None:
    """``got`` is ``want`` to the bit, except within the last ``TAIL`` elements of each
    (start, numel) parameter, where they agree to float rounding."""
    tail = torch.zeros(got.numel(), dtype=torch.bool)
    for start, numel in params:
        tail[start + numel - numel % TAIL : start + numel] = True
    assert torch.equal(got[~tail], want[~tail])
    torch.testing.assert_close(got[tail], want[tail], rtol=1e-5, atol=1e-7)


def torch_adamw(param: torch.Tensor, grads: list[torch.Tensor], scale: float, **kw: object) -> tuple[torch.Tensor, dict]:
    p = param.clone()
    opt = torch.optim.AdamW([p], fused=True, **kw)  # type: ignore[arg-type]
    for g in grads:
        p.grad = g.clone()  # the fused kernel writes the unscaled gradient back
        opt.grad_scale = None if scale == 1.0 else torch.tensor(scale)  # type: ignore[attr-defined]
        opt.step()
    return p, opt.state[p]


@pytest.mark.parametrize("numel", [1, 1000, 3 * native.SPLIT_MIN + 17])
@pytest.mark.parametrize("betas,scale", [((0.9, 0.999), 1.0), ((0.3, 0.95), 2.5)])
def test_adamw_is_torchs_fused_adamw_to_the_bit(numel: int, betas: tuple[float, float], scale: float) -> None:
    """Both branches of torch's lerp (1 - beta1 below and above 0.5), AMP's grad_scale, weight
    decay, a stage split across threads; five steps, so the moments and the bias corrections move."""
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(numel)
    start = torch.randn(numel, generator=gen)
    grads = [torch.randn(numel, generator=gen) * (k + 1) for k in range(5)]
    want, state = torch_adamw(start, grads, scale, lr=3e-3, betas=betas, eps=1e-8, weight_decay=0.1)
    p, exp_avg, exp_avg_sq = start.clone(), torch.zeros(numel), torch.zeros(numel)
    bf16 = torch.empty(numel, dtype=torch.bfloat16)
    fp32 = torch.empty(numel)
    for step, g in enumerate(grads, 1):
        out = bf16 if step % 2 else fp32
        assert native.adamw(p, exp_avg, exp_avg_sq, g, lr=3e-3, betas=betas, eps=1e-8, weight_decay=0.1,
                            step=float(step), grad_scale=scale, out=out)
    for got, expected in ((p, want), (exp_avg, state["exp_avg"]), (exp_avg_sq, state["exp_avg_sq"])):
        assert_same_but_tails(got, expected, [(0, numel)])
    assert torch.equal(bf16, p.to(torch.bfloat16))  # written by the last (5th) step
    assert not torch.equal(fp32, p)  # the 4th step's copy: each step writes only the copy it is given


def test_bf16_copy_rounds_as_torch_does() -> None:
    """Ties to even, infinities and NaN: the copy is ``Tensor.to(torch.bfloat16)``."""
    special = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.4e38, float("inf"), float("-inf"), 1e-40, 0.0, -0.0])
    p = torch.cat([special, torch.randn(10_000)])
    zeros = torch.zeros_like(p)
    out = torch.empty(p.numel(), dtype=torch.bfloat16)
    # lr 0: the parameters stay as they are (a zero gradient, no decay), only copied
    assert native.adamw(p, zeros.clone(), zeros.clone(), zeros, lr=0.0, betas=(0.9, 0.999), eps=1e-8,
                        weight_decay=0.0, step=1.0, grad_scale=1.0, out=out)
    assert torch.equal(out.view(torch.int16), p.to(torch.bfloat16).view(torch.int16))
    nan = torch.tensor([float("nan")] * 16)
    out = torch.empty(16, dtype=torch.bfloat16)
    native.adamw(nan, torch.zeros(16), torch.zeros(16), torch.zeros(16), lr=0.0, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, step=1.0, grad_scale=1.0, out=out)
    assert out.isnan().all()


@pytest.mark.parametrize("sources,first", [(2, True), (3, True), (2, False)])
@pytest.mark.parametrize("offset", [0, 1])  # 1: not 32-byte aligned, the plain loop
def test_sum_with_norm_is_torchs_sum_and_the_float64_norm(sources: int, first: bool, offset: int) -> None:
    numel = 2 * NORM_CHUNK + 1234
    norm_numel = numel - 100  # the last elements are buffers: summed, left out of the norm
    gen = torch.Generator().manual_seed(sources)
    srcs = [torch.randn(numel, generator=gen) * 1e-3 for _ in range(sources)]
    srcs[0][::7] *= 50
    before = torch.randn(numel + offset, generator=gen)[offset:]
    want = before.clone()
    accumulate(want, srcs, first=first)
    dst = before.clone() if offset == 0 else torch.randn(numel + offset)[offset:].copy_(before)
    norm = native.sum_with_norm(dst, srcs, first=first, norm_numel=norm_numel)
    assert torch.equal(dst, want)
    exact = float(torch.sum(want[:norm_numel].double() ** 2))
    assert norm is not None and abs(norm - exact) <= 1e-12 * exact


def test_the_norm_does_not_depend_on_the_thread_count() -> None:
    numel = 5 * native.SPLIT_MIN + 3
    gen = torch.Generator().manual_seed(0)
    srcs = [torch.randn(numel, generator=gen) for _ in range(2)]
    norms = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            norms.append(native.sum_with_norm(torch.empty(numel), srcs, first=True, norm_numel=numel))
    finally:
        torch.set_num_threads(threads)
    assert norms[0] == norms[1] == norms[2]


def test_a_non_finite_gradient_has_a_non_finite_norm() -> None:
    a, b = torch.zeros(1000), torch.zeros(1000)
    a[3] = float("inf")
    assert native.sum_with_norm(torch.empty(1000), [a, b], first=True, norm_numel=1000) == float("inf")
    a[3] = float("nan")
    norm = native.sum_with_norm(torch.empty(1000), [a, b], first=True, norm_numel=1000)
    assert norm is not None and norm != norm
    big = torch.full((1000,), 3e38)  # squares past float32's range: finite in float64
    assert native.sum_with_norm(torch.empty(1000), [big, -big / 2], first=True, norm_numel=1000) == pytest.approx(1000 * 1.5e38**2)


def grouped_stage() -> tuple[m.StageSpec, list[m.GroupSpec]]:
    """A frozen parameter, a no-decay group with its own lr scale, a buffer, and default ones."""
    spec = build_stage_spec(
        "0",
        [("w", (300, 7)), ("frozen", (50,), 0, True), ("bias", (33,), 1), ("ln", (41,)), ("count", (1,), 0, True, "float32")],
    )
    return spec, [m.GroupSpec(name="no_decay", weight_decay=0.0, lr_scale=0.5)]


class _Whole:
    """A flat stage's one parameter: the whole master."""

    def __init__(self, numel: int) -> None:
        self.at = self.offset = 0
        self.numel = numel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, None])
@pytest.mark.parametrize("grouped", [False, True])
def test_stage_update_with_its_published_copy_equals_torchs_then_a_copy(dtype: torch.dtype | None, grouped: bool) -> None:
    """StageOptimizer.step(publish=) against the torch path (native turned off) on the same stage:
    the same master and state to the bit (but tails), and the copy is the master's once the
    untrained ranges (frozen parameter, buffer, gaps) are copied as UpdateTask copies them. dtype
    None: no published copy, only the grad_scale, which the native kernel runs too."""
    spec, groups = grouped_stage() if grouped else (build_stage_spec("0", [("w", (1000, 3)), ("b", (17,))]), [])
    gen = torch.Generator().manual_seed(1)
    start = torch.randn(spec.numel, generator=gen)
    opt_spec = AdamW(lr=1e-2, weight_decay=0.1)
    fast = StageOptimizer(opt_spec, start.clone(), spec, groups)
    slow = StageOptimizer(opt_spec, start.clone(), spec, groups)
    assert fast.flat is not grouped and bool(fast.untrained) is grouped
    published = torch.zeros(spec.numel, dtype=dtype) if dtype is not None else None
    for step in range(3):
        grad = torch.randn(fast.layout.numel, generator=gen)
        fast_grad = grad.clone()
        assert fast.step(fast_grad, grad_scale=2.0, lr=1e-2 * (step + 1), publish=published) is (published is not None)
        assert torch.equal(fast_grad, grad)  # the native kernel leaves the gradient as it was
        if published is not None:
            for s, e in fast.untrained:
                published[s:e].copy_(fast.master[s:e])
        with native.turned_off():
            assert not slow.step(grad.clone(), grad_scale=2.0, lr=1e-2 * (step + 1), publish=None)
    trained = fast._trained or [_Whole(spec.numel)]  # noqa: SLF001  (each parameter's place)
    assert_same_but_tails(fast.master, slow.master, [(t.at, t.numel) for t in trained])
    fs, ss = fast.state_tensors(), slow.state_tensors()
    assert fs.keys() == ss.keys() == {"step", "exp_avg", "exp_avg_sq"}
    assert torch.equal(fs["step"], ss["step"])
    for k in ("exp_avg", "exp_avg_sq"):
        assert_same_but_tails(fs[k], ss[k], [(t.offset, t.numel) for t in trained])
    if published is not None:
        assert torch.equal(published, fast.master.to(dtype))


def test_the_library_is_built_once_and_kept(tmp_path: Path) -> None:
    """A second server finds the build in the cache; another source (or flags, compiler, CPU) gets
    its own file."""
    cc = os.environ.get("CC") or shutil.which("cc")
    assert cc is not None
    env = {**os.environ, "WSTREAM_NATIVE_CACHE": str(tmp_path)}
    script = "from wstream.server import native; print(native.available())"
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert done.stdout.strip() == "True", done.stderr
    built = list(tmp_path.glob("update-*.so"))
    assert len(built) == 1
    first = built[0].stat().st_mtime_ns
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
    assert built[0].stat().st_mtime_ns == first
