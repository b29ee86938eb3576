"""The GPU data path's classes on a CPU worker: ring sizing from a budget, buffers allocated once,
host registration (a no-op that still reports), copy engines, the receive ring and the gradient
staging, and the staged path end to end through a real server (copy on CPU standing in for the
DMA copies). The same paths on a GPU: tests/test_cuda.py."""

from __future__ import annotations

import copy
import logging
import threading

import pytest
import torch
from torch import nn

import models
from test_equivalence import assert_weights_equal, reference_train
from wstream.client import SGD, AdamW, Client
from wstream.client import connection as connection_module
from wstream.client import gradient_write
from wstream.client.device import (
    DONE,
    CopyEngine,
    HostRegistration,
    ReceiveRing,
    ring_capacity,
)
from wstream.client.gradient_write import GradientStager
from wstream.client.scatter import scatter_grads
from wstream.client.stages import spec_of
from wstream.protocol import StaleStepError
from wstream.protocol.frames import tensor_frames
from wstream.protocol.grad_norm import squared_norm
from wstream.protocol.layout import grad_layout, push_layout

STEPS = 4


# ---- ring sizing ----------------------------------------------------------------------------------
def test_ring_capacity_is_the_budget_over_the_largest_stage() -> None:
    assert ring_capacity(10 * 100, 100, stages=64) == 10
    assert ring_capacity(10 * 100 + 99, 100, stages=64) == 10  # floor: never more than the budget
    assert ring_capacity(2 * 100, 100, stages=64) == 2
    assert ring_capacity(10**9, 100, stages=5) == 5  # one buffer per stage at most
    assert ring_capacity(10**9, 100, stages=1) == 2  # but never fewer than two


def test_a_budget_below_two_stages_is_refused_naming_the_numbers() -> None:
    with pytest.raises(ValueError) as err:
        ring_capacity(150, 100, stages=8)
    text = str(err.value)
    assert "150 bytes" in text and "100 bytes" in text and "holds 1" in text and ">= 200 bytes" in text


def _stage_bytes() -> int:
    return max(spec_of(i, s).numel for i, s in enumerate(models.mixed())) * 4


def test_trainer_ring_from_weight_budget_and_its_buffers_are_never_reallocated(client: Client) -> None:
    stages = models.mixed(seed=2)
    start = copy.deepcopy(stages)
    job = client.create_job("budget", stages, optimizer=AdamW(lr=3e-3), token="t", unit_bytes=None)  # a budget of stages
    largest = _stage_bytes()
    budget = 3 * largest + largest // 2
    with job.trainer(zero_copy=False, weight_budget=budget) as trainer:
        st = trainer.stats()
        assert st.ring_capacity == 3 and trainer.prefetch == 2
        assert st.ring_bytes == 3 * largest <= budget and st.weight_budget == budget
        ptrs = [b.data_ptr() for b in trainer.connection.ring.buffers]
        for s in range(STEPS):
            trainer.step(*models.batch("mixed", s), models.loss_fn)
            assert [b.data_ptr() for b in trainer.connection.ring.buffers] == ptrs  # no per-step allocation
        assert trainer.stats().peak_resident_stages <= 3
    want = reference_train(start, lambda p: torch.optim.AdamW(p, lr=3e-3), "mixed", STEPS)
    assert_weights_equal(job.state_dict(), want, atol=1e-6)


def test_trainer_refuses_a_weight_budget_that_cannot_hold_two_stages(client: Client) -> None:
    job = client.create_job("small", models.mixed(), optimizer=AdamW(lr=1e-3), token="t", unit_bytes=None)  # a budget of stages
    largest = _stage_bytes()
    with pytest.raises(ValueError, match=f">= {2 * largest} bytes"):
        job.trainer(zero_copy=False, weight_budget=2 * largest - 1)
    with pytest.raises(ValueError, match="not both"):
        job.trainer(prefetch=1, weight_budget="1GiB")
    units = client.create_job("units", [nn.Linear(64, 64) for _ in range(40)], optimizer=AdamW(), token="t")  # one unit
    with pytest.raises(ValueError, match="a transfer unit of several chain stages.*smaller unit_bytes"):
        units.trainer(zero_copy=False, weight_budget="64KiB")
    with job.trainer(weight_budget=2 * largest) as trainer:  # the job is still usable
        trainer.step(*models.batch("mixed", 0), models.loss_fn)


# ---- registration and copies on a CPU ---------------------------------------------------------------
def test_registration_on_a_cpu_registers_nothing_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    mapping = torch.zeros(1 << 16, dtype=torch.uint8)
    with caplog.at_level(logging.DEBUG, logger="wstream.client.device"):
        reg = HostRegistration(mapping, torch.device("cpu"), what="test mapping")
    assert "test mapping: registered 0 bytes in 0 s" in caplog.text
    assert (reg.registered, reg.nbytes, reg.seconds) == (False, 0, 0.0)
    reg.unregister()
    reg.unregister()  # idempotent
    assert not reg.registered


def test_cpu_copy_engine_copies_at_once_and_counts() -> None:
    engine = CopyEngine(torch.device("cpu"), "h2d")
    src, dst = torch.randn(1000), torch.empty(1000)
    ticket = engine.copy(dst, src, after=[DONE, engine.mark()])
    assert ticket.done() and torch.equal(dst, src)
    ticket.wait_stream()
    ticket.synchronize()
    assert (engine.copies, engine.bytes) == (1, 4000)


def test_receive_ring_lands_frames_in_reused_host_buffers() -> None:
    ring = ReceiveRing(2, 4 * 3000, torch.device("cpu"))
    engine = CopyEngine(torch.device("cpu"))
    ptrs = [b.data_ptr() for b in ring.buffers]
    for n in (3000, 17, 2999, 3000, 1):
        src = torch.randn(n)
        dst = torch.empty(n)
        frames = tensor_frames(src, chunk=1024)  # several frames per stage
        assert ring.load(engine, dst, frames, after=[DONE]).done()
        assert torch.equal(dst, src)
    assert [b.data_ptr() for b in ring.buffers] == ptrs
    assert engine.copies == 5
    ring.close()


@pytest.mark.filterwarnings("ignore::wstream.client.scatter.UnusedParameterWarning")  # missing gradients on purpose
def test_staged_gradients_equal_the_direct_scatter_bit_for_bit() -> None:
    module = models.Residual(32, 64)
    spec = spec_of(0, module)
    grads = [torch.randn_like(p) for p in module.parameters()]
    grads[1] = None  # an unused parameter becomes zeros
    direct = torch.full((spec.numel + 5,), float("nan"))
    GradientStager(torch.device("cpu"), spec.numel, CopyEngine(torch.device("cpu"))).write(direct, spec, grads).synchronize()
    stager = GradientStager(torch.device("cpu"), spec.numel + 5, CopyEngine(torch.device("cpu")), staged=True)
    assert stager.nbytes == 2 * (spec.numel + 5) * 4
    ptrs = [b.data_ptr() for b in stager.buffers]
    for _ in range(3):  # alternating staging buffers
        slot = torch.full((spec.numel + 5,), float("nan"))
        assert stager.write(slot, spec, grads).done()
        assert torch.equal(slot[: spec.numel], direct[: spec.numel])
    assert [b.data_ptr() for b in stager.buffers] == ptrs
    want = torch.empty(spec.numel)
    scatter_grads(want, spec, grads)
    assert torch.equal(direct[: spec.numel], want)


# ---- the staged path end to end ----------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["shm-copy", "frames"])
def test_staged_path_on_a_cpu_trains_to_plain_pytorch(
    client: Client, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU path's logic (frames through the receive ring, gradients through the staging
    buffers and the copy engine, pushes sent after their copy) with copy_ standing in for DMA."""
    monkeypatch.setattr(connection_module, "host_staging", lambda device: True)
    stages = models.mixed(seed=4)
    start = copy.deepcopy(stages)
    job = client.create_job(
        "staged", stages, optimizer=AdamW(lr=3e-3, weight_decay=0.05), token="t",
        unit_bytes=None,  # staging sized by the largest chain stage (test_units trains a unit staged)
    )
    with job.trainer(shm=mode != "frames", zero_copy=False, prefetch=1) as trainer:
        assert (trainer.connection.receive is not None) == (mode == "frames")
        assert trainer.stats().grad_staging_bytes == 2 * _stage_bytes()
        for s in range(STEPS):
            trainer.step(*models.batch("mixed", s), models.loss_fn)
        assert trainer.stats().registered_bytes == 0  # nothing is page-locked on a CPU
    want = reference_train(start, lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.05), "mixed", STEPS)
    assert_weights_equal(job.state_dict(), want, atol=1e-6)


# ---- the pusher's sender thread ------------------------------------------------------------------
class _HeldTicket:
    """A copy that completes only when the test says so (a D2H copy still running)."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def wait_stream(self) -> None:
        pass

    def synchronize(self) -> None:
        assert self.released.wait(60), "the test never released the copy"

    def done(self) -> bool:
        return self.released.is_set()


def test_the_pushed_norm_is_the_gradient_parts_staged_or_not() -> None:
    """``Push.sumsq``: ``squared_norm`` of the gradient part, the same float either way."""
    module = models.Residual(32, 64)
    spec = spec_of(0, module)
    grads = [torch.randn_like(p) for p in module.parameters()]
    want = torch.empty(spec.numel)
    scatter_grads(want, spec, grads)
    expected = squared_norm(want[: grad_layout(spec).numel])
    for staged, deferred in ((False, False), (False, True), (True, None)):
        stager = GradientStager(torch.device("cpu"), spec.numel, CopyEngine(torch.device("cpu")), staged=staged, deferred=deferred)
        slot = torch.full((spec.numel,), float("nan"))
        ticket, sumsq = stager.write_measured(slot, spec, grads)
        assert ticket.done() != bool(deferred)  # a deferred write waits for a thread to need it
        assert sumsq() == expected and ticket.done()
        assert torch.equal(slot, want)


def test_a_cpu_workers_deferred_writes_are_bounded_and_run_once_by_whoever_needs_them() -> None:
    """The default on a CPU: the write (scatter and norm) runs on the thread that first waits for
    it (the pusher's sender, before it sends); the compute thread writes the oldest itself once
    MAX_DEFERRED_WRITES are pending, so it never keeps more gradients alive than that."""
    module = models.Residual(32, 64)
    spec = spec_of(0, module)
    stager = GradientStager(torch.device("cpu"), spec.numel, CopyEngine(torch.device("cpu")))
    assert stager.deferred
    pushes = [[torch.randn_like(p) for p in module.parameters()] for _ in range(gradient_write.MAX_DEFERRED_WRITES + 2)]
    slots = [torch.full((spec.numel,), float("nan")) for _ in pushes]
    tickets = []
    for k, (slot, grads) in enumerate(zip(slots, pushes)):
        tickets.append(stager.write_measured(slot, spec, grads)[0])
        pending = [t for t in tickets if not t.done()]
        assert len(pending) == min(k + 1, gradient_write.MAX_DEFERRED_WRITES), k
    assert tickets[0].done() and tickets[1].done() and not tickets[-1].done()
    written_by: list[str] = []
    last = tickets[-1]
    thread = threading.Thread(target=lambda: (last.synchronize(), written_by.append(threading.current_thread().name)), name="sender")
    thread.start()
    thread.join(60)
    assert written_by == ["sender"] and last.done()
    for slot, grads in zip(slots, pushes):
        want = torch.empty(spec.numel)
        scatter_grads(want, spec, grads)
        for t in tickets:
            t.synchronize()  # once written, a no-op
        assert torch.equal(slot, want)


def test_a_deferred_write_that_fails_raises_in_every_thread_that_waits_for_it() -> None:
    module = models.Residual(32, 64)
    spec = spec_of(0, module)
    stager = GradientStager(torch.device("cpu"), spec.numel, CopyEngine(torch.device("cpu")))
    grads = [torch.randn(3) for _ in module.parameters()]  # the wrong shapes
    ticket, sumsq = stager.write_measured(torch.zeros(spec.numel), spec, grads)
    for _ in range(2):
        with pytest.raises(RuntimeError):
            ticket.synchronize()
    with pytest.raises(RuntimeError):
        sumsq()


class _HeldStager:
    def __init__(self, inner: GradientStager) -> None:
        self.inner = inner
        self.ticket = _HeldTicket()
        self.nbytes = 0

    def write_measured(self, slot: torch.Tensor, spec: object, grads: list[torch.Tensor | None], **kw: object) -> tuple[_HeldTicket, object]:
        _, sumsq = self.inner.write_measured(slot, spec, grads, **kw)  # type: ignore[arg-type]
        return self.ticket, sumsq


def test_a_push_is_sent_only_once_its_copy_is_complete(client: Client) -> None:
    job = client.create_job("held", models.mixed(), optimizer=SGD(lr=0.1), token="t", unit_bytes=None)  # pushes stage 4 by hand
    with job.trainer(zero_copy=False, step_ring=False) as trainer:  # gathered (a step ring holds it until a commit)
        pusher = trainer.connection.pusher
        held = _HeldStager(pusher._stager)
        pusher._stager = held  # type: ignore[assignment]
        spec = trainer.executor.runners[4].spec
        pusher.push(4, 0, spec, [torch.ones(5, 48)])
        assert pusher._unsent and not pusher._outstanding  # waiting for its copy, compute went on
        held.ticket.released.set()
        pusher.drain()  # sent, and acknowledged once gathered on the server
        assert not pusher._unsent and not pusher._outstanding
        assert pusher.stats.pushes == 1
        pusher._stager = held.inner  # type: ignore[assignment]
    # one stage's gradient of a step that never committed: nothing was applied
    assert torch.equal(job.state_dict()["4.weight"], models.mixed()[4].weight.detach())


def test_an_error_reply_to_a_push_is_raised_in_the_compute_thread(client: Client) -> None:
    job = client.create_job("bad-push", models.mixed(), optimizer=SGD(lr=0.1), token="t", unit_bytes=None)  # pushes stage 4 by hand
    trainer = job.trainer()
    try:
        pusher = trainer.connection.pusher
        pusher.push(4, 7, trainer.executor.runners[4].spec, [torch.ones(5, 48)])  # the job is at step 0
        with pytest.raises(StaleStepError, match="only gradients for step 0"):
            pusher.drain()
        with pytest.raises(StaleStepError):  # and again: the sender thread stopped on it
            pusher.drain()
    finally:
        trainer.connection.pusher.forget_outstanding()
        trainer.close()


class _Stat(nn.Module):
    """A float buffer, which a stage may update under autograd (its push then requires grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.register_buffer("stat", torch.zeros(3))


MODULES_TO_SCATTER = {
    "grad-tracked buffer": _Stat,
    "missing gradient": lambda: nn.Sequential(nn.Linear(5, 3), nn.Linear(300, 300)),
    "padding between pieces": lambda: nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 7)),
    "small pieces, no padding (flattened)": lambda: nn.Sequential(*[nn.Linear(16, 16) for _ in range(20)]),
    "large pieces, no padding (concatenated)": lambda: nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32)),
}


@pytest.mark.filterwarnings("ignore::wstream.client.scatter.UnusedParameterWarning")  # missing gradients on purpose
@pytest.mark.parametrize("case", list(MODULES_TO_SCATTER))
def test_scatter_grads_writes_every_piece_as_the_layout_says(case: str) -> None:
    mod = MODULES_TO_SCATTER[case]()
    spec = spec_of(0, mod)
    grads: list[torch.Tensor | None] = [torch.randn(p.shape) for p in spec.params]
    if case == "grad-tracked buffer":
        grads[-1] = torch.randn(3, requires_grad=True) * 1.0
    elif case == "missing gradient":
        grads[2] = None  # 90,000 zeros, written in place rather than through a temporary
    layout = push_layout(spec)
    want = torch.zeros(layout.numel)
    for off, g in zip(layout.offsets, grads):
        if off is not None and g is not None:
            want[off : off + g.numel()] = g.detach().reshape(-1)
    dst = torch.full((layout.numel + 8,), 7.0)
    scatter_grads(dst, spec, grads)  # grad mode on, as in a step
    assert torch.equal(dst[: layout.numel], want) and not dst.requires_grad
    assert torch.all(dst[layout.numel :] == 7.0)  # nothing past the push


def test_an_aborted_steps_ring_buffers_are_refilled_only_after_its_queued_reads() -> None:
    """Found by a review of the GPU paths: after an aborted step the ring's buffers were freed with
    their old "consumed" marks, older than the aborted step's kernels still queued on the device,
    so the next copy into a buffer could overwrite weights those kernels read. ``reset`` marks the
    compute stream's work so far on every buffer (a CPU engine's mark is already done)."""
    from wstream.client.prefetch import Prefetcher, WeightRing

    class Engine:
        marked = object()

        def mark(self) -> object:
            return self.marked

    ring = WeightRing(3, 4, torch.float32, torch.device("cpu"))
    prefetcher = Prefetcher(None, ring, Engine())  # type: ignore[arg-type]  (no stream: nothing is fetched)
    prefetcher.reset()
    assert [ring.consumed(i) for i in range(3)] == [Engine.marked] * 3
