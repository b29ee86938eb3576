"""What a trainer reports: :class:`TrainerStats`, gathered from its connection and loss scaler.

Separate so the trainer stays a façade: every figure here is read off a part (the ring, the
prefetcher's and pusher's counters, the host registrations, the scaler).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from wstream.protocol.units import format_bytes

from .connection import WorkerConnection
from .loss_scale import LossScaler
from .streaming import LatencyWindow
from .throughput import Throughput


@dataclass(slots=True, repr=False)
class TrainerStats:
    """What the last steps did; ``peak_resident_stages`` never exceeds ``prefetch + 1``. The ring,
    fetches and pushes count the server's stages: a job's transfer units (NOTE [Transfer units] in
    ``units.py``), or its stages themselves with ``unit_bytes=None``.

    ``repr`` (and ``print``) gives a summary in units, a few lines; the fields hold the numbers."""

    steps: int
    prefetch: int
    ring_capacity: int
    ring_bytes: int
    peak_resident_stages: int
    fetches: int
    bytes_fetched: int
    """Weight bytes copied into the worker's ring or received as data frames; 0 on the CPU's
    zero-copy path, which computes on the published segment (``bytes_read_in_place``)."""
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
    grad_slots: int = 0
    """Slots of this worker's gradient ring (a step ring: one per server stage)."""
    step_ring: bool = False
    """Whether the ring is a step ring (``Transport.step_ring`` granted): every push held
    in place until its update, none copied on the server."""
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
    zero_copy: bool = False
    """Whether the worker computes on the published weights in place (a CPU worker on shared memory)."""
    bytes_read_in_place: int = 0
    """Zero-copy: the weight bytes the steps computed on where the server published them (no copy)."""

    def __repr__(self) -> str:
        """A summary that reads well: throughput, weight and gradient traffic, waits, memory, and
        the newest commit, one topic a line, in units."""
        rate = [f"{self.samples_per_s:,.1f} samples/s" if self.samples_per_s is not None else "no samples/s yet"]
        if self.tokens_per_s is not None:
            rate.append(f"{self.tokens_per_s:,.0f} tokens/s")
        lines = [f"TrainerStats: {self.steps} step{'' if self.steps == 1 else 's'}, {', '.join(rate)}"]
        if self.zero_copy:
            moved = f"{format_bytes(self.bytes_read_in_place)} read in place (zero-copy, nothing copied)"
        else:
            moved = f"{format_bytes(self.bytes_fetched)} copied"
        p50, p99 = self.fetch_latency.quantile(0.5), self.fetch_latency.quantile(0.99)
        latency = "" if math.isnan(p50) else f"; round trip p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms"
        lines.append(f"  weights: {self.fetches} fetches, {moved}, compute waited {self.fetch_wait_s:.3f} s{latency}")
        kind = "a step ring" if self.step_ring else "a ring"
        lines.append(
            f"  gradients: {self.pushes} pushes, {format_bytes(self.bytes_pushed)}, compute waited {self.push_wait_s:.3f} s; "
            f"{kind} of {self.grad_slots} slot{'' if self.grad_slots == 1 else 's'}"
        )
        ring = f"{format_bytes(self.ring_bytes)}, " if self.ring_bytes else ""
        memory = (
            f"  memory: weight ring {ring}{self.ring_capacity} server stages at most (peak {self.peak_resident_stages}), "
            f"stage inputs peak {format_bytes(self.peak_boundary_bytes)}"
        )
        if self.registered_bytes or self.grad_staging_bytes:
            memory += (
                f", {format_bytes(self.registered_bytes)} page-locked in {self.registration_s:.2f} s, "
                f"{format_bytes(self.grad_staging_bytes)} gradient staging"
            )
        lines.append(memory)
        last = []
        if self.grad_norm is not None:
            last.append(f"|g| {self.grad_norm:.4g}" + (f" clipped x{self.clip:.3g}" if self.clip != 1.0 else ""))
        if self.lr is not None:
            last.append(f"lr {self.lr:.3g}")
        if self.loss_scale is not None:
            last.append(f"loss scale {self.loss_scale:g} ({self.loss_scale_backoffs} back-offs)")
        if self.skipped_steps:
            last.append(f"{self.skipped_steps} skipped")
        if self.reconnects:
            last.append(f"{self.reconnects} reconnects")
        if last:
            lines.append(f"  last commit: {', '.join(last)}")
        return "\n".join(lines)


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
        grad_slots=conn.pusher.slots,
        step_ring=conn.step_ring,
        loss_scale=None if scaler is None else scaler.scale,
        loss_scale_backoffs=0 if scaler is None else scaler.backoffs,
        samples_per_s=throughput.samples_per_s,
        tokens_per_s=throughput.tokens_per_s,
        grad_norm=None if committed is None else committed.grad_norm,
        lr=None if committed is None else committed.lr,
        clip=1.0 if committed is None else committed.clip,
        skipped_steps=pu.skipped_steps,
        zero_copy=conn.zero_copy,
        bytes_read_in_place=pf.bytes_read_in_place,
    )
