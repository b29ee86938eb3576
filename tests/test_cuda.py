"""The GPU data path on a CUDA device (skipped without one; tests/test_device.py runs the same
classes on a CPU): registration of shared memory, copies on their own stream ordered by events,
the weight ring within its budget, and training equal to the CPU reference.

Run on a GPU machine with ``pytest -m cuda -s`` (``-s`` shows the registration rates)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import models
from test_equivalence import assert_weights_equal, reference_train
from wstream.client import AdamW, Client, LossScale
from wstream.client.device import CudaCopyEngine, HostRegistration, tensor_nbytes
from wstream.client.gradient_write import GradientStager
from wstream.client.scatter import scatter_grads
from wstream.client.stages import spec_of
from wstream.protocol.shm import create_segment, map_segment, unlink_segment

pytestmark = pytest.mark.cuda

DEV = torch.device("cuda")
STEPS = 5
SLEEP_CYCLES = 5_000_000  # a few ms of GPU time: compute lags far behind the host's issue


class Slow(nn.Module):
    """A stage whose GPU work is delayed, so that copies issued by other threads would overtake it
    if they were not ordered by events (on a CPU it is the wrapped stage)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            torch.cuda._sleep(SLEEP_CYCLES)
        return self.inner(x)


def test_registration_pins_a_shared_mapping_once_and_unregisters_it() -> None:
    nbytes = 256 * 2**20
    path = create_segment(nbytes)
    try:
        mapping = map_segment(path, nbytes)
        reg = HostRegistration(mapping, DEV, what="test segment")
        print(f"registered {reg.nbytes} bytes in {reg.seconds:.4f} s ({reg.nbytes / reg.seconds / 1e9:.2f} GB/s)")
        assert reg.registered and reg.nbytes == nbytes and reg.seconds > 0
        assert mapping.is_pinned()
        reg.unregister()
        reg.unregister()  # idempotent
        assert not reg.registered and not mapping.is_pinned()
        again = HostRegistration(mapping, DEV, what="test segment again")  # no stale registration left
        t0 = again.seconds
        again.unregister()
        assert t0 > 0
    finally:
        unlink_segment(path)


def _registered(n: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, HostRegistration]:
    host = torch.empty(n, dtype=dtype)
    return host, HostRegistration(host, DEV, what="test buffer")


def test_h2d_copy_waits_for_the_consumer_and_compute_waits_for_the_copy() -> None:
    engine = CudaCopyEngine(DEV, "h2d")
    src, reg = _registered(1 << 22)
    src.copy_(torch.randn(1 << 22))
    dst = torch.empty(1 << 22, device=DEV)
    try:
        torch.cuda._sleep(SLEEP_CYCLES * 4)  # the compute stream is busy...
        dst.fill_(7.0)  # ...and then still writes dst: the copy must come after this
        ticket = engine.copy(dst, src, after=[engine.mark()])
        assert not ticket.done()  # it waits behind the compute stream's work
        ticket.wait_stream()
        out = dst * 1.0  # computed after the copy
        torch.cuda.synchronize()
        assert ticket.done() and torch.equal(out.cpu(), src)
    finally:
        torch.cuda.synchronize()
        reg.unregister()


def test_gradients_are_staged_in_fp32_and_copied_into_the_registered_slot() -> None:
    module = models.Residual(32, 64)
    spec = spec_of(0, module)
    grads_cpu = [torch.randn_like(p) for p in module.parameters()]
    want = torch.empty(spec.numel)
    scatter_grads(want, spec, [g.to(torch.bfloat16).float() for g in grads_cpu])
    stager = GradientStager(DEV, spec.numel, CudaCopyEngine(DEV, "d2h"))
    slot, reg = _registered(spec.numel)
    on_device = [g.to(DEV, torch.bfloat16) for g in grads_cpu]  # (a copy from pageable memory syncs the stream: before the sleep)
    try:
        for _ in range(3):
            slot.fill_(float("nan"))
            torch.cuda._sleep(SLEEP_CYCLES)  # the gradients are "still being computed"
            grads = [g * 1 for g in on_device]  # queued after the sleep, on the compute stream
            ticket = stager.write(slot, spec, grads)
            ticket.synchronize()
            assert torch.equal(slot, want)
    finally:
        torch.cuda.synchronize()
        reg.unregister()


@pytest.mark.parametrize("mode", ["shm", "frames"])
def test_cuda_worker_trains_to_the_cpu_reference_within_its_weight_budget(client: Client, mode: str) -> None:
    stages = [Slow(s) for s in models.mixed(seed=9)]
    start = copy.deepcopy(stages)
    job = client.create_job("cuda", stages, optimizer=AdamW(lr=3e-3), token="t", unit_bytes=None)
    largest = max(spec_of(i, s).numel for i, s in enumerate(models.mixed())) * 4
    budget = 2 * largest + largest // 2  # two buffers: every copy reuses one compute just left
    warm = nn.Linear(8, 8).to(DEV)  # cuBLAS takes its workspace from the caching allocator once
    warm(torch.ones(4, 8, device=DEV)).sum().backward()
    del warm
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with job.trainer("cuda", shm=mode == "shm", weight_budget=budget) as trainer:
        st = trainer.stats()
        assert st.ring_capacity == 2 and st.ring_bytes == 2 * largest <= budget
        # allocated once; the caching allocator rounds each block up to 512 bytes (a few blocks here)
        assert torch.cuda.memory_allocated() - base <= st.ring_bytes + st.grad_staging_bytes + 8 * 512
        assert st.registered_bytes > 0 and st.registration_s > 0
        ptrs = [b.data_ptr() for b in trainer.connection.ring.buffers]
        for s in range(STEPS):
            trainer.step(*models.batch("mixed", s), models.loss_fn)  # CPU tensors: placed on the GPU
            assert [b.data_ptr() for b in trainer.connection.ring.buffers] == ptrs
        peak = torch.cuda.max_memory_allocated() - base
        print(f"{mode}: ring {st.ring_bytes} B (budget {budget}), staging {st.grad_staging_bytes} B, peak {peak} B")
        assert peak < st.ring_bytes + st.grad_staging_bytes + 8 * 2**20  # + this tiny model's activations
    want = reference_train(start, lambda p: torch.optim.AdamW(p, lr=3e-3), "mixed", STEPS)
    assert_weights_equal(job.state_dict(), want, atol=1e-5)


@pytest.mark.parametrize("k", [1, 2])
def test_cuda_taped_forwards_train_to_the_cpu_reference(client: Client, k: int) -> None:
    """Early stop on a GPU (NOTE [Taped forwards and early stop]): with a ring of two buffers a
    stage's forward buffer holds other weights by its backward, whose recomputation must bind the
    weights fetched for it; ``k`` micro-batches keep a graph each."""
    from test_microbatches import accumulated_reference

    stages = [Slow(s) for s in models.mixed(seed=9)]
    start = copy.deepcopy(stages)
    job = client.create_job(f"cuda-es{k}", stages, optimizer=AdamW(lr=3e-3, weight_decay=0.05), token="t", unit_bytes=None)
    with job.trainer("cuda", early_stop=True, prefetch=1) as trainer:
        for s in range(STEPS):
            trainer.step(*models.batch("mixed", s), models.loss_fn, micro_batches=k)
        assert trainer.plan_summary()["early_stopped_recomputations"] == len(stages) - 1
    want, _ = accumulated_reference(start, k, STEPS, 16)
    assert_weights_equal(job.state_dict(), want, atol=1e-5)


def test_bfloat16_job_on_cuda_trains_close_to_float32(client: Client) -> None:
    def run(dtype: str) -> tuple[list[float], dict[str, torch.Tensor]]:
        job = client.create_job(f"mp-{dtype}", models.mixed(seed=6), optimizer=AdamW(lr=3e-3), token="t", dtype=dtype)  # type: ignore[arg-type]
        batch = models.batch("mixed", 0, size=64)
        with job.trainer("cuda") as trainer:
            losses = [trainer.step(*batch, lambda o, t: models.loss_fn(o.float(), t)) for _ in range(8)]
        return losses, job.state_dict()

    l32, w32 = run("float32")
    l16, w16 = run("bfloat16")
    start = nn.Sequential(*models.mixed(seed=6)).state_dict()
    d32 = torch.cat([(w32[k] - start[k]).flatten() for k in start])
    d16 = torch.cat([(w16[k] - start[k]).flatten() for k in start])
    assert l16 == pytest.approx(l32, rel=1e-2)
    assert ((d16 - d32).norm() / d32.norm()).item() < 0.06


def test_float16_job_on_cuda_overflows_backs_off_and_trains_every_step(client: Client) -> None:
    """From 2^30 the first backward overflows; each overflowing stage runs again at a lower scale
    on the GPU (the finiteness check synchronizes once per stage) and no step is lost."""

    def run(name: str, init: float) -> tuple[dict[str, torch.Tensor], int]:
        job = client.create_job(name, models.mixed(seed=3), optimizer=AdamW(lr=3e-3), token="t", dtype="float16")
        with job.trainer("cuda", loss_scale=LossScale(init_scale=init)) as trainer:
            for t in range(STEPS):
                trainer.step(*models.batch("mixed", t), lambda o, y: models.loss_fn(o.float(), y))
            backoffs = trainer.stats().loss_scale_backoffs
        return job.state_dict(), backoffs

    high, backed = run("fp16-high", 2.0**30)
    low, none = run("fp16-low", 2.0**8)
    assert backed >= 14 and none == 0
    assert_weights_equal(high, low, atol=2e-5)  # powers of two scale exactly


def test_tensor_nbytes_counts_the_dtype() -> None:
    assert tensor_nbytes(torch.empty(10, dtype=torch.bfloat16, device=DEV)) == 20


def test_offload_moves_only_the_gpu_tensors_of_a_boundary_and_keeps_their_layout() -> None:
    """NOTE [Ordering of offload copies] rule 6 on a GPU: a CPU tensor in a boundary (the
    ``lengths`` that ``pack_padded_sequence`` wants on the host) comes back on the CPU, and a
    channels_last activation comes back channels_last."""
    from wstream.client.offload import HostMover

    mover = HostMover(DEV)
    try:
        image = torch.randn(2, 3, 4, 4, device=DEV).to(memory_format=torch.channels_last)
        lengths = torch.tensor([4, 3])
        host = mover.to_host((image, lengths, None))
        back = mover.to_device(host).result()
        torch.cuda.current_stream(DEV).synchronize()
        assert host.result()[0].is_pinned() and host.result()[1] is lengths
        assert back[0].device.type == "cuda" and back[0].stride() == image.stride() and torch.equal(back[0], image)
        assert back[1] is lengths and back[2] is None
    finally:
        mover.close()
