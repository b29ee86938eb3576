"""The streaming trainer: one optimizer step of a stage chain with weights fetched just in time.

The step is driven by a checkpoint plan (:mod:`wstream.client.plans`): untaped ADVANCEs move the
current stage input forward, SNAPSHOT/RESTORE/FREE keep and reuse inputs, and each BACKWARD re-runs
one stage with autograd from its input, pushes its gradient and passes dx_i down. The weights of
every compute action are fetched in the plan's order by the prefetch thread.

The plan's chain is one of *positions*; each runs on a weight stage, usually its own, sometimes
an earlier one (a tied head: NOTE [Positions and weight stages] in ``stages.py``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from wstream.protocol import ServerUnavailable, SessionExpiredError, StateError, WstreamError
from wstream.protocol import messages as m
from wstream.protocol.shm import map_segment

from .channel import attach_session
from .device import (
    GradientStager,
    HostRegistration,
    ReceiveRing,
    copy_engine,
    host_staging,
    ring_capacity,
    synchronize,
)
from .distributed import AllReduceGradients, flat_spec
from .loss_scale import LossScale, LossScaler, all_finite, unscaled
from .offload import HostMover, PendingMove
from .plans import OnlineBisection, Op, Plan, StageCosts
from .stages import Boundary, StageRunner, as_boundary, boundary_bytes, join_lanes, lanes_of, split_micro_batches
from .timeline import SERVER_LANES, WORKER_LANES, Tracer, chrome_trace, server_spans, write_trace
from .streaming import (
    TORCH_DTYPES,
    Fetched,
    GradientPusher,
    HeartbeatThread,
    LatencyWindow,
    Prefetcher,
    StreamContext,
    WeightRing,
)

if TYPE_CHECKING:
    from .client import Job

log = logging.getLogger(__name__)

LossFn = Callable[[Any, Any], torch.Tensor]


class Resynced(Exception):
    """A step was interrupted (the server restarted from a snapshot, or this worker was detached)
    and the trainer reconnected to a job at another step: train ``step`` next, with its data.
    :meth:`Trainer.fit` handles this itself."""

    def __init__(self, interrupted: int, step: int) -> None:
        super().__init__(f"step {interrupted} was interrupted; the job is at step {step} now")
        self.interrupted = interrupted
        self.step = step


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


class Trainer:
    """Trains a job's stages as one data-parallel worker. Create with ``job.trainer(...)``."""

    def __init__(
        self,
        job: Job,
        runners: list[StageRunner],
        *,
        device: torch.device,
        prefetch: int,
        shm: bool | None,
        grad_slots: int,
        world_size: int,
        preserve_rng: bool,
        zero_copy: bool | None,
        plan: Plan | None,
        plan_from_profile: Callable[[StageCosts], Plan] | None = None,
        reconnect_s: float = 300.0,
        reduce: str = "server",
        weight_budget: int | None = None,
        loss_scale: LossScale | bool | None = None,
    ) -> None:
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        if plan is not None and plan.n != len(runners):
            raise ValueError(f"the plan is for {plan.n} positions, the job's chain has {len(runners)}")
        if (plan is None) == (plan_from_profile is None):
            raise ValueError("give either a plan or a planner to apply to the first step's profile")
        if reduce not in ("server", "allreduce"):
            raise ValueError(f"reduce must be 'server' or 'allreduce', got {reduce!r}")
        self._allreduce = (
            AllReduceGradients(max(r.spec.numel for r in runners)) if reduce == "allreduce" else None
        )
        if self._allreduce is not None and world_size != 1:
            raise ValueError(
                "with reduce='allreduce' the ranks reduce among themselves and rank 0 alone pushes: leave "
                f"world_size at 1 (the server sees one worker), got {world_size}"
            )
        self.plan: Plan | None = plan
        self._plan_from = plan_from_profile
        self.profile: StageCosts | None = None
        """The costs the plan was made for: ``_profile_one`` (a profile of one micro-batch, measured
        again whenever the number of micro-batches changes) scaled to ``_plan_k`` micro-batches."""
        self._profile_one: StageCosts | None = None
        self._plan_k = 1
        self.job = job
        self.device = device
        self.prefetch = prefetch
        self.preserve_rng = preserve_rng
        self._runners = runners  # one per chain position
        self._first_use: dict[int, int] = {}  # weight stage -> its lowest position (its push follows that backward)
        for position, runner in enumerate(runners):
            self._first_use.setdefault(runner.stage, position)
        self._closed = False
        self.reconnect_s = reconnect_s
        self.reconnects = 0
        self.weight_budget = weight_budget
        self._loss_scale = loss_scale
        self._scaler: LossScaler | None = None  # made at the first connect, once the dtype is known
        self._registrations: list[HostRegistration] = []
        self._receive: ReceiveRing | None = None
        self._connect_args = (shm, grad_slots, world_size, prefetch, zero_copy)
        self._steps_done = 0
        self._peak_boundary = 0
        self.last_loop_steps = 0
        self._fetch_order = self._stages_of(self.plan.fetch_order()) if self.plan is not None else []
        self._mover: HostMover | None = None
        self._tracer: Tracer | None = None
        client = job.client
        self._chan = client.channel()
        try:
            self._connect(*self._connect_args)
        except BaseException:
            if hasattr(self, "worker_id"):  # joined already: don't leave a worker others wait for
                with contextlib.suppress(WstreamError):
                    self._chan.request(m.Leave(session=self.session), m.Ok, timeout_s=5.0)
            self._chan.close()
            raise
        client._trainers.add(self)
        log.info(
            "worker %d joined job %r at step %d: %d positions on %d stages, prefetch %d, ring %d bytes, %s",
            self.worker_id,
            job.name,
            self._step,
            len(runners),
            len(self._first_use),
            self.prefetch,
            self._ring.nbytes,
            ("shared memory, zero-copy" if self.zero_copy else "shared memory") if self.shm else "data frames",
        )

    def _connect(
        self, shm: bool | None, grad_slots: int, world_size: int, prefetch: int, zero_copy: bool | None
    ) -> None:
        """Attach a fresh session, join as a worker, map shared memory and start the threads."""
        job = self.job
        client = job.client
        attached, signer = attach_session(self._chan, job.name, job._token)
        self.session = attached.session
        self._chan.signer = signer
        published = None
        if shm is not False:
            try:
                published = map_segment(attached.published_path, attached.published_bytes)
            except (FileNotFoundError, PermissionError, RuntimeError) as exc:
                if shm:
                    raise StateError(
                        f"shm=True but the job's shared memory {attached.published_path} cannot be mapped "
                        f"({exc}); is the server on another host? use shm=False"
                    ) from None
        self.shm = published is not None
        cpu_shm = self.shm and self.device.type == "cpu"
        if zero_copy and not cpu_shm:
            raise StateError("zero_copy=True needs a CPU device and shared memory (shm)")
        self.zero_copy = cpu_shm if zero_copy is None else zero_copy
        if published is not None:  # once, at attach (NOTE [Copy ordering on a GPU] in device.py)
            self._register(published, f"job {job.name!r} published weights")
        self.delayed_update = attached.delayed_update
        self.delay_after = attached.delay_after
        self.reader = self._allreduce is not None and self._allreduce.rank != 0
        joined, _ = self._chan.request(
            m.Join(session=self.session, shm=self.shm, grad_slots=grad_slots, world_size=world_size, reader=self.reader),
            m.Joined,
        )
        self.worker_id = joined.worker
        self._step = joined.step
        max_numel = max(s.numel for s in attached.stages)
        if self.shm and joined.grad_slots:
            ring = map_segment(joined.grad_path, joined.grad_slot_bytes * joined.grad_slots)
            self._register(ring, "gradient slots")
            grad_views = [
                ring[k * joined.grad_slot_bytes : k * joined.grad_slot_bytes + max_numel * 4].view(torch.float32)
                for k in range(joined.grad_slots)
            ]
        else:  # the worker's own slots, sent as data frames
            grad_views = [torch.empty(max_numel, dtype=torch.float32) for _ in range(joined.grad_slots)]
            for k, view in enumerate(grad_views):
                self._register(view, f"gradient buffer {k}")
        pub_dtype = TORCH_DTYPES[attached.published_dtype]
        self.compute_dtype = pub_dtype
        if self._scaler is None:  # made once, kept across reconnects
            wanted = pub_dtype == torch.float16 if self._loss_scale is None else self._loss_scale
            if wanted is not False:
                self._scaler = LossScaler(LossScale() if wanted is True else wanted)
        if pub_dtype == torch.float16 and self._scaler is None:
            log.warning(
                "job %r computes in float16 with loss scaling switched off: gradients below 6e-8 "
                "become 0 and above 65504 become inf",
                job.name,
            )
        base_numels = [s.numel for s in attached.base_stages]
        base_published = (
            map_segment(attached.base_path, attached.base_bytes) if published is not None and attached.base else None
        )
        if base_published is not None:
            self._register(base_published, f"job {job.name!r} frozen base {attached.base!r}")
        self._sc = StreamContext(
            ctx=client.ctx,
            address=client.address,
            curve=client.curve,
            timeout_s=client.timeout_s,
            wait_timeout_s=client.wait_timeout_s,
            session=self.session,
            signer=signer,
            numels=[s.numel for s in attached.stages],
            published=published,
            published_dtype=pub_dtype,
            zero_copy=self.zero_copy,
            tracer=self._tracer,
            base_published=base_published,
            base_numels=base_numels,
        )
        largest = max(n + (base_numels[i] if base_numels else 0) for i, n in enumerate(self._sc.numels))
        stage_bytes = largest * pub_dtype.itemsize
        capacity = prefetch + 1 if self.weight_budget is None else ring_capacity(self.weight_budget, stage_bytes, len(self._sc.numels))
        self.prefetch = capacity - 1
        self._ring = WeightRing(capacity, largest, pub_dtype, self.device, allocate=not self.zero_copy)
        staged = host_staging(self.device)
        if not self.shm and staged:
            if attached.base:
                raise StateError(
                    "a job on a frozen base cannot be trained over data frames on a GPU yet (not built): "
                    "run the worker on the server's host (shared memory)"
                )
            self._receive = ReceiveRing(2, stage_bytes, self.device)
        self._prefetcher = Prefetcher(self._sc, self._ring, copy_engine(self.device, "h2d"), self._receive)
        self._stager = GradientStager(self.device, max_numel, copy_engine(self.device, "d2h"), staged=staged)
        self._pusher = GradientPusher(self._sc, grad_views, shm=self.shm, stager=self._stager)
        self._heartbeat = HeartbeatThread(
            self._sc, interval_s=max(0.05, attached.lease_s / 3), timeout_s=min(client.timeout_s, max(1.0, attached.lease_s))
        )

    def _recover(self, cause: WstreamError) -> None:
        """Reconnect after the server restarted or this worker was detached: a new session and
        worker, retried with backoff for up to ``reconnect_s`` seconds."""
        log.warning("worker %d of job %r lost its connection (%s); reconnecting", self.worker_id, self.job.name, cause)
        self._heartbeat.close()
        self._prefetcher.close()
        self._pusher.close()
        self._release_host_memory()
        old_session, old_signer = self.session, self._sc.signer
        self._chan.close()
        client = self.job.client
        with contextlib.suppress(WstreamError):  # if the server is alive, drop the old worker at once
            probe = client.channel(timeout_s=1.0, signer=old_signer)
            try:
                probe.request(m.Leave(session=old_session), m.Ok)
            finally:
                probe.close()
        deadline = time.monotonic() + self.reconnect_s
        delay = 0.05
        while True:
            self._chan = client.channel(timeout_s=min(client.timeout_s, 5.0))
            try:
                self._connect(*self._connect_args)
                break
            except (ServerUnavailable, SessionExpiredError) as exc:
                self._chan.close()
                if time.monotonic() + delay > deadline:
                    self._closed = True
                    raise ServerUnavailable(
                        f"could not reconnect to job {self.job.name!r} within {self.reconnect_s:g} s: {exc}"
                    ) from cause
                time.sleep(delay)
                delay = min(2 * delay, 2.0)
        self._chan.timeout_s = client.timeout_s
        self.reconnects += 1
        log.warning("worker %d rejoined job %r at step %d", self.worker_id, self.job.name, self._step)

    # ---- public ------------------------------------------------------------------------------------
    @property
    def step_index(self) -> int:
        """The step the next ``step()`` call trains (the job's step when this worker is in sync)."""
        return self._step

    def step(self, inputs: Any, targets: Any, loss_fn: LossFn, *, micro_batches: int = 1) -> float:
        """One optimizer step on ``inputs``/``targets``; returns the loss as a float.

        With ``micro_batches=k`` every tensor of ``inputs`` and ``targets`` is cut into k chunks
        along dim 0 and the step runs *stage-major* (after L2L): while a stage's weights are
        resident it runs for every micro-batch, forward and backward, so the weights move once per
        step whatever k is. The gradient is that of ordinary gradient accumulation,
        ``sum_j grad(loss_fn(out_j, targets_j) / k)``, and the loss returned is the mean of the
        micro-batches' losses. The checkpoint plan applies to every micro-batch (a kept input is
        kept for all k); plans made from a profile count k in their memory budget.

        Returns once the server has applied this step's update to every stage; in a job with
        ``delayed_update``, once every gradient of the step is sent (:meth:`flush` waits for
        their updates).
        """
        if self._closed:
            raise StateError("this trainer is closed")
        return self._recovering(lambda: self._step_once(inputs, targets, loss_fn, micro_batches))

    @contextlib.contextmanager
    def trace(self, path: str | os.PathLike[str]) -> Iterator[Tracer]:
        """Record a timeline of the steps run inside ``with trainer.trace("step.json"):`` and
        write it, with the server's side of the same time (gradients gathered, updates queued and
        run per stage, fetches it held back), as Chrome-trace JSON for https://ui.perfetto.dev or
        chrome://tracing. See docs/throughput.md for how to read it."""
        if self._tracer is not None:
            raise StateError("this trainer is already tracing")
        tracer = Tracer()
        self._tracer = tracer
        self._sc.tracer = tracer
        try:
            yield tracer
            self.flush()  # a delayed-update job's last updates belong in the picture
        finally:
            self._tracer = None
            self._sc.tracer = None
        sent = time.monotonic_ns()
        reply, _ = self._chan.request(m.Timeline(session=self.session), m.TimelineReply)
        received = time.monotonic_ns()
        offset = reply.now_ns - (sent + received) // 2
        server = server_spans(reply.events, offset, tracer.started_ns)
        if reply.dropped:
            log.warning("the server's timeline of job %r lost %d older events", self.job.name, reply.dropped)
        processes = [
            (f"worker {self.worker_id} (job {self.job.name})", tracer.spans, WORKER_LANES),
            (f"wstream-server (job {self.job.name})", server, SERVER_LANES),
        ]
        start = min((s.start_ns for _, spans, _ in processes for s in spans), default=tracer.started_ns)
        trace = chrome_trace(processes, t0_ns=start)
        trace["otherData"] = {
            "job": self.job.name,
            "worker": self.worker_id,
            "clock_offset_ns": offset,  # server clock - worker clock
            "clock_uncertainty_ns": (received - sent) // 2,  # the offset is right to within this
            "server_events_dropped": reply.dropped,
        }
        write_trace(path, trace)
        log.info("timeline of %d worker and %d server events written to %s", len(tracer.spans), len(server), path)

    def flush(self) -> None:
        """Wait until the server has applied every gradient this worker sent. Only a job with
        ``delayed_update`` has any outstanding between steps; ``close()`` flushes too."""
        if not self._closed:
            self._pusher.drain()

    def _recovering(self, run: Callable[[], float]) -> float:
        """``run()`` a step; when the connection is lost reconnect, and retry the step if the job
        is still at it, or raise :class:`Resynced` when it is at another step now."""
        step = self._step
        while True:
            try:
                return run()
            except (ServerUnavailable, SessionExpiredError) as exc:
                if self.reconnect_s <= 0 or self._closed:
                    raise
                self._recover(exc)
            if self._step != step:
                raise Resynced(step, self._step)

    def fit(
        self,
        batch_of: Callable[[int], tuple[Any, Any]],
        loss_fn: LossFn,
        *,
        steps: int,
        on_step: Callable[[int, float], None] | None = None,
        micro_batches: int = 1,
    ) -> dict[int, float]:
        """Train until the job reaches step ``steps``; ``batch_of(t)`` gives the inputs and targets
        of step t. Steps interrupted by a server restart or a detach are trained again from the
        job's step (so with deterministic data a recovered run ends with the weights of an
        uninterrupted one). Returns the loss of every step this worker completed."""
        losses: dict[int, float] = {}
        while self._step < steps:
            t = self._step
            inputs, targets = batch_of(t)
            try:
                losses[t] = self.step(inputs, targets, loss_fn, micro_batches=micro_batches)
            except Resynced as r:
                log.warning("%s; going on from there", r)
                continue
            if on_step is not None:
                on_step(t, losses[t])
        self.flush()
        return losses

    def _step_once(self, inputs: Any, targets: Any, loss_fn: LossFn, k: int) -> float:
        inputs, targets = _place(inputs, self.device, self.compute_dtype), _place(targets, self.device)
        lanes = split_micro_batches(inputs, k, what="inputs")
        lane_targets = split_micro_batches(targets, k, what="targets")
        if self.plan is None or (self._plan_from is not None and k != self._plan_k):
            self._plan_from_profile(lanes[0], k)
        assert self.plan is not None
        self._prefetcher.start(self._step, self._fetch_order)
        run = _PlanRun(
            join_lanes(as_boundary(x) for x in lanes),
            self._runners.__getitem__,
            k=k,
            targets=lane_targets,
            last=len(self._runners) - 1,
            scale=self._next_scale(),
        )
        started = time.monotonic_ns()
        try:
            for op, i in self.plan.actions:
                self._execute(run, op, i, loss_fn)
            if not self._delayed():  # see server/job.py NOTE [Versions ...] rule 5
                self._pusher.drain()
        except (ServerUnavailable, SessionExpiredError):
            self._abort_step(run.pushed, recoverable=self.reconnect_s > 0)
            raise
        except BaseException:
            self._abort_step(run.pushed)
            raise
        self._end_run(run)
        if self._tracer is not None:
            self._tracer.add(f"step {self._step}", "step", "steps", started, step=self._step, micro_batches=k)
        self._step += 1
        self._steps_done += 1
        return run.loss

    def step_loop(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: LossFn,
        *,
        halt: Callable[..., bool],
        max_steps: int,
    ) -> float:
        """One optimizer step of a recurrent job: its one stage (the loop body) is applied to
        ``inputs`` until ``halt(*x)`` is true after an application, or ``max_steps`` times; the
        data decides how many. The length is learned while running, so the plan is online
        bisection (O(log n) live states, O(n log n) recomputation); the body's gradient is summed
        over its applications and pushed once. ``self.last_loop_steps`` says how many ran."""
        if self._closed:
            raise StateError("this trainer is closed")
        if len(self._runners) != 1:
            raise StateError(f"step_loop trains a job of one stage (the loop body); this job has {len(self._runners)}")
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        inputs, targets = _place(inputs, self.device, self.compute_dtype), _place(targets, self.device)
        self._prefetcher.start(self._step, [0])
        fetched = self._prefetcher.get(0)  # the body's weights serve every application
        body = self._runners[0]
        run = _PlanRun(
            as_boundary(inputs),
            lambda position: body,
            targets=[targets],
            scale=self._next_scale(),
        )
        run.held[0] = fetched.weights
        planner = OnlineBisection()
        try:
            self._execute(run, *planner.actions[0], loss_fn)
            while True:
                for op, i in planner.advance():
                    self._execute(run, op, i, loss_fn)
                assert run.current is not None
                with torch.no_grad():
                    if planner.position >= max_steps or halt(*run.current[1]):
                        break
            run.last = planner.position - 1
            for op, i in planner.finish():  # position 0's backward pushes the sum over applications
                self._execute(run, op, i, loss_fn)
            assert run.pushed, "the loop body's gradient was not pushed: a bug in wstream"
            self._prefetcher.release(fetched)
            self._pusher.drain()
        except BaseException:
            self._abort_step(run.pushed)
            raise
        self.last_loop_steps = planner.position
        self._end_run(run)
        self._step += 1
        self._steps_done += 1
        return run.loss

    def _next_scale(self) -> float | None:
        return None if self._scaler is None else self._scaler.scale

    def _end_run(self, run: _PlanRun) -> None:
        """A step's run completed: record its peak, and move the loss scale by what it met."""
        self._peak_boundary = max(self._peak_boundary, run.peak_bytes)
        if self._scaler is not None:
            assert run.scales is not None
            self._scaler.end_step(run.scales)

    def plan_summary(self) -> dict[str, Any]:
        """What the checkpoint plan costs per step: recomputation, memory and weight traffic."""
        if self.plan is None:
            raise StateError("the plan is made from a profile of the first step: call step() first")
        stage_bytes = [n * self._sc.published_dtype.itemsize for n in self._sc.numels]
        return {
            "schedule": self.plan.name,
            "stages": self.plan.n,
            "forward_evaluations": self.plan.forward_evaluations,
            "recomputed_forwards": self.plan.advances,
            "peak_kept_states": self.plan.peak_slots,
            "peak_live_states": self.plan.peak_states,
            "peak_activation_bytes_measured": self._peak_boundary,
            "weight_bytes_fetched": sum(stage_bytes[i] for i in self._fetch_order),
        }

    def forward(self, inputs: Any, *, train: bool = False) -> Any:
        """Run the chain forward on ``inputs`` with the job's current weights and return the last
        position's output (e.g. logits), without gradients and without an update: evaluation or
        inference. ``train=False`` puts the skeletons in eval mode meanwhile (dropout off)."""
        if self._closed:
            raise StateError("this trainer is closed")
        modes = [r.skeleton.training for r in self._runners]
        self._prefetcher.start(self._step, [r.stage for r in self._runners])
        current = as_boundary(inputs)
        out: Any = None
        try:
            for r in self._runners:
                r.skeleton.train(train)
            for runner in self._runners:
                fetched = self._prefetcher.get(runner.stage)
                with torch.no_grad():
                    out = runner(fetched.weights, current, fetched.base)
                self._prefetcher.release(fetched)
                current = as_boundary(out)
        except BaseException:
            self._prefetcher.reset()
            raise
        finally:
            for r, mode in zip(self._runners, modes):
                r.skeleton.train(mode)
        return out

    def stats(self) -> TrainerStats:
        pf, pu = self._prefetcher.stats, self._pusher.stats
        return TrainerStats(
            steps=self._steps_done,
            prefetch=self.prefetch,
            ring_capacity=self._ring.capacity,
            ring_bytes=self._ring.nbytes,
            peak_resident_stages=self._ring.peak,
            fetches=pf.fetches,
            bytes_fetched=pf.bytes_fetched,
            fetch_wait_s=pf.fetch_wait_s,
            pushes=pu.pushes,
            bytes_pushed=pu.bytes_pushed,
            push_wait_s=pu.push_wait_s,
            peak_boundary_bytes=self._peak_boundary,
            fetch_latency=pf.fetch_latency,
            fetch_latency_skipped=pf.fetch_latency_skipped,
            reconnects=self.reconnects,
            weight_budget=self.weight_budget,
            registered_bytes=sum(r.nbytes for r in self._registrations)
            + (sum(r.nbytes for r in self._receive.registrations) if self._receive is not None else 0),
            registration_s=sum(r.seconds for r in self._registrations)
            + (sum(r.seconds for r in self._receive.registrations) if self._receive is not None else 0.0),
            grad_staging_bytes=self._stager.nbytes,
            loss_scale=self._next_scale(),
            loss_scale_backoffs=0 if self._scaler is None else self._scaler.backoffs,
        )

    def close(self) -> None:
        """Leave the job (the server detaches this worker) and stop every thread."""
        if self._closed:
            return
        try:
            self._pusher.drain()  # a delayed-update job's last gradients
        except WstreamError as exc:
            log.warning("the last gradients were not acknowledged: %s", exc)
        self._shut_down()

    def _shut_down(self) -> None:
        """Leave the job, stop the threads and close the sockets, without waiting for pushes."""
        self._closed = True
        self._heartbeat.close()
        self._prefetcher.close()
        if self._mover is not None:
            self._mover.close()
        try:
            self._chan.request(m.Leave(session=self.session), m.Ok, timeout_s=min(5.0, self._chan.timeout_s))
        except WstreamError as exc:
            log.warning("leave failed (the server will detach this worker when its lease ends): %s", exc)
        self._pusher.close()
        self._release_host_memory()
        self._chan.close()

    def _register(self, mapping: torch.Tensor, what: str) -> None:
        """Page-lock ``mapping`` for DMA (nothing on a CPU worker); undone by ``_release_host_memory``."""
        self._registrations.append(HostRegistration(mapping, self.device, what=what))

    def _release_host_memory(self) -> None:
        """Unregister host memory once no copy can touch it any more (before its unmapping)."""
        synchronize(self.device)
        if self._receive is not None:
            self._receive.close()
            self._registrations.extend(self._receive.registrations)
            self._receive = None
        for r in self._registrations:
            r.unregister()
        self._registrations.clear()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- profiling (schedules "optimal" and "min_peak") ----------------------------------------------------------
    def _plan_from_profile(self, inputs: Any, k: int) -> None:
        """Measure each stage once on ``inputs`` (one micro-batch: forward time, input size, tape
        size) and plan for ``k`` micro-batches (see :meth:`StageCosts.for_micro_batches`).

        Runs inside a forked RNG and pushes nothing, so training afterwards is exactly what it
        would have been; a budget no plan fits is refused here, before any update."""
        assert self._plan_from is not None
        self._profile_one = self._measure_profile(inputs)
        self.profile = self._profile_one.for_micro_batches(k)
        self.plan = self._plan_from(self.profile)
        self._plan_k = k
        self._fetch_order = self._stages_of(self.plan.fetch_order())
        log.info(
            "schedule %r from the profile (%d micro-batch%s): %d recomputed forwards, %d live inputs at most",
            self.plan.name,
            k,
            "" if k == 1 else "es",
            self.plan.advances,
            self.plan.peak_states,
        )

    def _measure_profile(self, inputs: Any) -> StageCosts:
        n = len(self._runners)
        self._prefetcher.start(self._step, [r.stage for r in self._runners])
        forward_s: list[float] = []
        state_bytes: list[int] = []
        tape_bytes: list[int] = []
        devices = [self.device] if self.device.type == "cuda" else []
        current = as_boundary(inputs)
        host_s = 0.0
        t_fetch = time.perf_counter()
        try:
            with torch.random.fork_rng(devices=devices):
                for i in range(n):
                    fetched = self._prefetcher.get(self._runners[i].stage)
                    state_bytes.append(boundary_bytes(current))
                    synchronize(self.device)  # a GPU runs asynchronously: time the work, not its launch
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        out = self._runners[i](fetched.weights, current, fetched.base)
                    synchronize(self.device)
                    forward_s.append(time.perf_counter() - t0)
                    tape_bytes.append(self._tape_bytes(i, fetched, current))
                    self._prefetcher.release(fetched)
                    t0 = time.perf_counter()
                    _to_device(current, torch.device("cpu"))
                    host_s += time.perf_counter() - t0
                    current = as_boundary(out)
        except BaseException:
            self._prefetcher.reset()
            raise
        elapsed = time.perf_counter() - t_fetch
        weight_bytes = tuple(self._sc.numels[r.stage] * self._sc.published_dtype.itemsize for r in self._runners)
        fetch_s = max(elapsed - sum(forward_s) - host_s, 1e-9)
        bandwidth = 0.0 if self.zero_copy else sum(weight_bytes) / fetch_s
        return StageCosts(
            forward_s=tuple(forward_s),
            state_bytes=tuple(state_bytes),
            tape_bytes=tuple(tape_bytes),
            weight_bytes=weight_bytes,
            bandwidth=bandwidth,
            host_bandwidth=sum(state_bytes) / max(host_s, 1e-9),
        )

    def _tape_bytes(self, i: int, fetched: Fetched, inputs: Boundary) -> int:
        """Bytes autograd saves for backward when stage i runs with grad (plus its output); the
        stage's weights (and its base's) are not new memory."""
        saved = 0
        weights = [w.untyped_storage().data_ptr() for w in (fetched.weights, fetched.base) if w is not None]

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal saved
            if t.untyped_storage().data_ptr() not in weights:
                saved += t.numel() * t.element_size()
            return t

        params = self._runners[i].leaves(fetched.weights, fetched.base)
        xs = tuple(x.detach().requires_grad_(True) if i > 0 and _wants_grad(x) else x for x in inputs)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self._runners[i].call_with(params, xs)
        return saved + boundary_bytes(as_boundary(out))

    # ---- the plan executor ------------------------------------------------------------------------
    def _execute(self, run: _PlanRun, op: Op, i: int, loss_fn: LossFn) -> None:
        if op == Op.ADVANCE:
            assert run.current is not None and run.current[0] == i, "plan out of step: a bug in wstream"
            runner = run.runner_at(i)
            weights, base, fetched = self._weights(run, runner.stage)
            outs: list[Boundary] = []
            first = i not in run.advanced
            run.advanced.add(i)
            with self._span(("forward " if first else "recompute ") + str(i), "forward" if first else "recompute", i):
                for j, lane in enumerate(lanes_of(run.current[1], run.k)):  # stage-major: every micro-batch
                    with torch.no_grad(), self._stage_rng(run, i, j):
                        outs.append(as_boundary(runner(weights, lane, base)))
            if fetched is not None:
                self._prefetcher.release(fetched)
            run.set_current(i + 1, join_lanes(outs))
        elif op == Op.SNAPSHOT:
            assert run.current is not None and run.current[0] == i
            run.keep(i)
        elif op == Op.RESTORE:
            run.restore(i)
        elif op == Op.FREE:
            run.free(i)
        elif op == Op.OFFLOAD:
            assert run.current is not None and run.current[0] == i
            run.host[i] = self._host_mover().to_host(run.current[1])
        elif op == Op.PREFETCH:
            run.arrive(i, self._host_mover().to_device(run.host[i]))
        elif op == Op.FREE_HOST:
            run.host.pop(i).result()  # never drop memory a copy may still be writing
        else:
            assert run.current is not None and run.current[0] == i
            self._backward_stage(run, i, loss_fn)

    def _stages_of(self, positions: list[int]) -> list[int]:
        """The weight stages to fetch for a plan's compute positions (its ``fetch_order``)."""
        return [self._runners[p].stage for p in positions]

    def _weights(self, run: _PlanRun, stage: int) -> tuple[torch.Tensor, torch.Tensor | None, Fetched | None]:
        """Stage ``stage``'s weights and its frozen base's (if any): held for the whole step (a
        loop body), or the next fetch, which the caller releases after use."""
        held = run.held.get(stage)
        if held is not None:
            return held, None, None
        fetched = self._prefetcher.get(stage)
        return fetched.weights, fetched.base, fetched

    def _delayed(self) -> bool:
        """Whether this step may end before its updates (a delayed-update job past its warm-up)."""
        return self.delayed_update and self._step >= self.delay_after

    def _span(self, name: str, cat: str, stage: int) -> contextlib.AbstractContextManager[None]:
        """A compute span on the timeline (nothing when not tracing)."""
        if self._tracer is None:
            return contextlib.nullcontext()
        return self._tracer.span(name, cat, "compute", stage=stage, step=self._step)

    def _host_mover(self) -> HostMover:
        if self._mover is None:
            self._mover = HostMover(self.device)
        return self._mover

    def _backward_stage(self, run: _PlanRun, i: int, loss_fn: LossFn) -> None:
        """Re-run position i with autograd from the current state and backpropagate; push its
        stage's gradient when i is the stage's lowest position, else add it to the stage's sum.

        With k micro-batches this runs once per micro-batch on the same weights (one tape live at
        a time) and sums their parameter gradients in micro-batch order, as accumulation into
        ``.grad`` would."""
        assert run.current is not None
        runner = run.runner_at(i)
        weights, base, fetched = self._weights(run, runner.stage)
        params = runner.leaves(weights, base)
        lanes = lanes_of(run.current[1], run.k)
        grad_lanes = [None] * run.k if i == run.last else lanes_of(tuple(run.grad_out or ()), run.k)
        run.drop_current()
        with self._span(f"backward {i}", "backward", i):
            param_grads, grad_out = self._backward_lanes(run, i, runner, params, lanes, grad_lanes, loss_fn)
        run.grad_out = grad_out
        del params
        stage = runner.stage
        grads = run.add_grads(stage, runner.stage_grads(param_grads))
        if i == self._first_use[stage]:  # backward has no use of this stage left
            del run.grads[stage]
            if self._delayed() and not self.reader:  # (s, t) applies to version t: (s, t - 1) must be done
                self._pusher.wait_stage(stage)
            if self._allreduce is None:
                self._pusher.push(stage, self._step, runner.spec, grads)
            else:  # every rank averages; rank 0 pushes the mean (client/distributed.py)
                device = next((g.device for g in grads if g is not None), self.device)
                mean = self._allreduce.mean(runner.spec, grads, device)
                if not self.reader:
                    self._pusher.push(stage, self._step, flat_spec(runner.spec), [mean])
            run.pushed = True
        if fetched is not None:
            self._prefetcher.release(fetched)

    def _backward_lanes(
        self,
        run: _PlanRun,
        i: int,
        runner: StageRunner,
        params: dict[str, torch.Tensor],
        lanes: list[Boundary],
        grad_lanes: list[Boundary | None],
        loss_fn: LossFn,
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Backpropagate stage i for every micro-batch: (summed parameter gradients, the input
        gradients of every micro-batch, packed). With loss scaling a micro-batch whose gradients
        are not finite is run again at a lower scale (NOTE [Per-stage loss scaling]) and its
        parameter gradients are summed unscaled, in fp32."""
        leaves = [v for v in params.values() if v.requires_grad]  # not a frozen base's views
        param_grads: list[torch.Tensor | None] = [None] * len(leaves)
        grad_out: list[torch.Tensor | None] = []
        scaler = self._scaler
        for j, (lane, lane_grad_out) in enumerate(zip(lanes, grad_lanes)):
            first = True
            while True:
                inputs = tuple(x.detach().requires_grad_(True) if i > 0 and _wants_grad(x) else x for x in lane)
                with self._stage_rng(run, i, j), torch.enable_grad():
                    out = runner.call_with(params, inputs)
                grad_inputs = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
                roots, root_grads = self._roots(run, out, lane_grad_out, loss_fn, j, first=first)
                grads = torch.autograd.grad(roots, [*leaves, *grad_inputs], root_grads, allow_unused=True)
                del out, roots, root_grads
                if scaler is None or all_finite(grads):
                    break
                where = f"step {self._step}, position {i}, micro-batch {j}"
                lower = scaler.back_off(run.scales[j], where)
                factor = lower / run.scales[j]
                run.scales[j] = lower
                if lane_grad_out is not None:  # exact for a power-of-two factor
                    lane_grad_out = tuple(g * factor if isinstance(g, torch.Tensor) else g for g in lane_grad_out)
                first = False
            own = grads[: len(leaves)]
            _add_into(param_grads, own if scaler is None else unscaled(own, run.scales[j]))
            it = iter(grads[len(leaves) :])
            grad_out.extend(next(it) if isinstance(x, torch.Tensor) and x.requires_grad else None for x in inputs)
            del grads, inputs, grad_inputs, own
        return param_grads, grad_out

    @staticmethod
    def _roots(
        run: _PlanRun, out: Any, grad_out: Boundary | None, loss_fn: LossFn, lane: int, *, first: bool = True
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """What micro-batch ``lane`` of a stage backpropagates from: the loss (divided by the
        number of micro-batches; seeded with the lane's loss scale, if any) at the chain's end,
        else the outputs that have a gradient. ``first``: not a loss-scaling retry (the loss is
        counted once)."""
        if grad_out is None:
            loss = loss_fn(out, run.targets[lane])
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
            value = float(loss.detach())
            if not math.isfinite(value):
                raise FloatingPointError(
                    f"the loss of micro-batch {lane} is {value}: nothing of this step was sent (the job's "
                    "weights are unchanged); check the data and the learning rate"
                )
            if first:
                run.loss += value / run.k
            root = loss if run.k == 1 else loss / run.k
            if run.scales is None:
                return [root], [None]
            return [root.float()], [torch.tensor(run.scales[lane], dtype=torch.float32, device=root.device)]
        roots: list[torch.Tensor] = []
        root_grads: list[torch.Tensor | None] = []
        for o, g in zip(as_boundary(out), grad_out):
            if isinstance(o, torch.Tensor) and o.requires_grad and g is not None:
                roots.append(o)
                root_grads.append(g)
        return roots, root_grads

    def _abort_step(self, pushed_any: bool, *, recoverable: bool = False) -> None:
        self._prefetcher.reset()
        if recoverable:  # the caller reconnects: the server discards this worker's step
            self._pusher.forget_outstanding()
            return
        if pushed_any:
            self._pusher.forget_outstanding()
            log.error(
                "a step failed after gradients were sent; this trainer is closed, create a new one "
                "(the server discards this worker's unfinished step when it leaves)"
            )
            self._shut_down()

    # ---- RNG ---------------------------------------------------------------------------------------
    def _stage_rng(self, run: _PlanRun, i: int, lane: int = 0) -> contextlib.AbstractContextManager[None]:
        """A stage's first run (per micro-batch) uses the live RNG and records its state, so the RNG
        ends where plain training leaves it; every re-run replays the recorded state in a forked
        RNG. (Stage-major order draws random numbers stage by stage, so with k > 1 dropout masks
        differ from those of micro-batch-major accumulation; their distribution does not.)"""
        if not self.preserve_rng:
            return contextlib.nullcontext()
        key = (i, lane)
        if key not in run.rng:
            cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
            run.rng[key] = (torch.get_rng_state(), cuda)
            return contextlib.nullcontext()
        return self._restore_rng(run.rng[key])

    @contextlib.contextmanager
    def _restore_rng(self, state: Any) -> Iterator[None]:
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(state[0])
            if state[1] is not None:
                torch.cuda.set_rng_state(state[1], self.device)
            yield


class _PlanRun:
    """The executor's state during one step. Live bytes are counted incrementally (O(1) per
    action: a 10,000-stage chain makes tens of thousands of actions per step)."""

    __slots__ = (
        "current", "kept", "host", "arriving", "rng", "grad_out", "loss", "pushed", "peak_bytes", "last",
        "runner_at", "held", "grads", "_kept_bytes", "_arriving_bytes", "_current_bytes", "_current_kept",
        "k", "targets", "advanced", "scales",
    )

    def __init__(
        self,
        inputs: Boundary,
        runner_at: Callable[[int], StageRunner],
        *,
        targets: list[Any],
        k: int = 1,
        last: int = -1,
        scale: float | None = None,
    ) -> None:
        self.k = k  # micro-batches: every state is k lanes packed (see ``join_lanes``)
        self.scales = None if scale is None else [scale] * k  # each micro-batch's loss scale, if scaling
        self.advanced: set[int] = set()  # positions run forward this step (a rerun is a recomputation)
        self.targets = targets  # one per micro-batch
        self.last = last  # the position whose BACKWARD computes the loss
        self.runner_at = runner_at  # position -> its runner (a loop: the body, for any position)
        self.held: dict[int, torch.Tensor] = {}  # weights fetched once for the whole step (a loop body's)
        self.grads: dict[int, list[torch.Tensor | None]] = {}  # stage -> gradient summed over its positions so far
        self.current: tuple[int, Boundary] | None = None
        self.kept: dict[int, Boundary] = {}
        self.host: dict[int, PendingMove] = {}  # offloaded inputs (a copy, also on a CPU worker)
        self.arriving: dict[int, PendingMove] = {}  # inputs being prefetched back from the host
        self.rng: dict[tuple[int, int], Any] = {}  # (stage, micro-batch) -> RNG state of its first run
        self.grad_out: list[torch.Tensor | None] | None = None
        self.loss = 0.0
        self.pushed = False
        self.peak_bytes = 0
        self._kept_bytes = 0
        self._arriving_bytes = 0
        self._current_bytes = 0
        self._current_kept: int | None = None  # the kept index ``current`` is, if it is one
        self.set_current(0, inputs)

    def set_current(self, index: int, b: Boundary) -> None:
        self.current = (index, b)
        self._current_bytes = boundary_bytes(b)
        self._current_kept = None
        self._account()

    def drop_current(self) -> None:
        self.current = None
        self._current_bytes = 0
        self._current_kept = None

    def keep(self, i: int) -> None:
        assert self.current is not None
        self.kept[i] = self.current[1]
        self._kept_bytes += self._current_bytes
        self._current_kept = i
        self._account()

    def restore(self, i: int) -> None:
        if i in self.arriving:  # a PREFETCH still in flight: the compute waits for it here
            pending = self.arriving.pop(i)
            self._arriving_bytes -= pending.nbytes
            self.kept[i] = pending.result()
            self._kept_bytes += boundary_bytes(self.kept[i])
        self.current = (i, self.kept[i])
        self._current_bytes = boundary_bytes(self.kept[i])
        self._current_kept = i

    def free(self, i: int) -> None:
        if i in self.kept:
            self._kept_bytes -= boundary_bytes(self.kept.pop(i))
            if self._current_kept == i:
                self._current_kept = None  # still the current input: counted as that now
        else:
            self._arriving_bytes -= self.arriving.pop(i).nbytes
        self._account()

    def arrive(self, i: int, pending: PendingMove) -> None:
        self.arriving[i] = pending
        self._arriving_bytes += pending.nbytes
        self._account()

    def add_grads(self, stage: int, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Add one position's gradients (``spec.params`` order) to its stage's sum; return the sum."""
        acc = self.grads.get(stage)
        if acc is None:
            self.grads[stage] = acc = list(grads)
            return acc
        _add_into(acc, grads)
        return acc

    def _account(self) -> None:
        live = self._kept_bytes + self._arriving_bytes
        if self.current is not None and self._current_kept is None:
            live += self._current_bytes
        self.peak_bytes = max(self.peak_bytes, live)


def _to_device(b: Boundary, device: torch.device) -> Boundary:
    """A synchronous copy of a boundary's tensors on ``device`` (the profile times it)."""
    return tuple(t.to(device, copy=True) if isinstance(t, torch.Tensor) else t for t in b)


def _add_into(acc: list[torch.Tensor | None], grads: Sequence[torch.Tensor | None]) -> None:
    """``acc[k] += grads[k]`` in place where both exist (the first gradient of a slot is taken as it
    is), as accumulation into ``.grad`` would."""
    for k, g in enumerate(grads):
        if g is not None:
            acc[k] = g if acc[k] is None else acc[k].add_(g)


def _place(value: Any, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    """``value`` (a tensor, or a tuple or list of items) on ``device``, floating-point tensors cast
    to ``dtype`` when given: a job computes in its published dtype from its first stage's input on
    (a no-op for fp32 tensors already there)."""
    if isinstance(value, torch.Tensor):
        cast = dtype if dtype is not None and value.is_floating_point() else None
        return value.to(device=device, dtype=cast)
    if type(value) in (tuple, list):
        return type(value)(_place(v, device, dtype) for v in value)
    return value


def _wants_grad(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()

