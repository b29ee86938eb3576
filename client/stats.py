"""What a trainer reports: :class:`TrainerStats`, gathered from its connection and loss scaler.

Separate so the trainer stays a façade: every figure here is read off a part (the ring, the
prefetcher's and pusher's counters, the host registrations, the scaler).
"""

from __future__ import annotations

from dataclasses import dataclass

from .connection import WorkerConnection
from .loss_scale import LossScaler
from .streaming import LatencyWindow
from .throughput import Throughput


@dataclass(slots=True)
class TrainerStats:
    """What the last steps did; ``peak_resident_stages`` never exceeds ``prefetch + 1``."""

    steps: int
    prefetch: int
    ring_capacity: int
    ring_bytes: int
    peak_resident_stages: int
    fetches: int
    bytes_fetched: int
    fetch_wait_s: float
    pushes: int
    bytes_pushed: int
    push_wait_s: float
    peak_boundary_bytes: int
    fetch_latency: LatencyWindow
    """Round trips of recent fetches (request sent -> weights reply read), for percentiles."""
    fetch_latency_skipped: int
    """Fetches left out of ``fetch_latency``: their reply waited for a ring buffer compute held."""
    reconnects: int
    weight_budget: int | None = None
    """The device bytes the weight ring was sized from (None: ``prefetch + 1`` stages)."""
    registered_bytes: int = 0
    """Host memory page-locked with ``cudaHostRegister`` at attach (0 on a CPU worker)."""
    registration_s: float = 0.0
    """Seconds those registrations took."""
    grad_staging_bytes: int = 0
    """Device memory of the two fp32 gradient staging buffers (0 on a CPU worker)."""
    loss_scale: float | None = None
    """The loss scale of the next step (None: no loss scaling; NOTE [Per-stage loss scaling])."""
    loss_scale_backoffs: int = 0
    """Stage backward passes run again at a lower scale because a gradient was not finite."""
    samples_per_s: float | None = None
    """Samples (first dimension of the first input) per second over the last steps (None: no step yet)."""
    tokens_per_s: float | None = None
    """Token ids per second over the last steps (None: the inputs are not integer token ids)."""
    grad_norm: float | None = None
    """The global gradient norm of the newest step this worker saw commit, before clipping (the
    norm of the mean over workers, as ``torch.nn.utils.clip_grad_norm_`` returns it)."""
    lr: float | None = None
    """The base learning rate of that step's update (the job's schedule at that step)."""
    clip: float = 1.0
    """The factor that step's gradient was multiplied by (1.0: not clipped)."""
    skipped_steps: int = 0
    """Steps this worker saw commit without an update because their gradient norm was not finite."""


def trainer_stats(
    conn: WorkerConnection, scaler: LossScaler | None, *, steps: int, peak_boundary: int, throughput: Throughput
) -> TrainerStats:
    """A trainer's stats: ``steps`` completed, ``peak_boundary`` the most activation bytes a step held."""
    pf, pu = conn.prefetcher.stats, conn.pusher.stats
    registered_bytes, registration_s = conn.registered()
    committed = conn.pusher.committed
    weight_budget = conn.transport.weight_budget
    assert weight_budget is None or isinstance(weight_budget, int)  # Transport parsed it
    return TrainerStats(
        steps=steps,
        prefetch=conn.prefetch,
        ring_capacity=conn.ring.capacity,
        ring_bytes=conn.ring.nbytes,
        peak_resident_stages=conn.ring.peak,
        fetches=pf.fetches,
        bytes_fetched=pf.bytes_fetched,
        fetch_wait_s=pf.fetch_wait_s,
        pushes=pu.pushes,
        bytes_pushed=pu.bytes_pushed,
        push_wait_s=pu.push_wait_s,
        peak_boundary_bytes=peak_boundary,
        fetch_latency=pf.fetch_latency,
        fetch_latency_skipped=pf.fetch_latency_skipped,
        reconnects=conn.reconnects,
        weight_budget=weight_budget,
        registered_bytes=registered_bytes,
        registration_s=registration_s,
        grad_staging_bytes=conn.stager.nbytes,
        loss_scale=None if scaler is None else scaler.scale,
        loss_scale_backoffs=0 if scaler is None else scaler.backoffs,
        samples_per_s=throughput.samples_per_s,
        tokens_per_s=throughput.tokens_per_s,
        grad_norm=None if committed is None else committed.grad_norm,
        lr=None if committed is None else committed.lr,
        clip=1.0 if committed is None else committed.clip,
        skipped_steps=pu.skipped_steps,
    )
