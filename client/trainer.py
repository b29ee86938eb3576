"""The streaming trainer: a thin façade over a worker's named parts.

A :class:`Trainer` trains a job's stage chain as one data-parallel worker. It composes:

* :class:`~wstream.client.connection.WorkerConnection` (``connection.py``): session, membership,
  shared memory, prefetcher, pusher, heartbeat, reconnect;
* :class:`~wstream.client.executor.PlanExecutor` (``executor.py``, with its per-step state in
  ``plan_run.py``): runs a checkpoint plan's actions on the stages, fetch -> run -> release;
* loss scaling (``loss_scale.py``), the per-stage RNG (``rng.py``), profiling and the plan made
  from it (``profile.py``), and the timeline (``timeline.py``).

What is left here is a step's life: place the batch, start the prefetch of the plan's fetch
order, run the plan, wait for the updates, and on a lost connection reconnect and retry (or say
:class:`Resynced`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

from wstream.protocol import ServerUnavailable, SessionExpiredError, StateError, WstreamError
from wstream.protocol import messages as m

from .boundary import as_boundary, check_micro_batches, join_lanes, lane_weights, output_boundary, place, split_micro_batches
from .connection import WorkerConnection
from .distributed import AllReduceGradients
from .endpoint import WorkerEndpoint
from .executor import LossFn, PlanExecutor
from .loss_scale import scaler_for
from .options import TrainerOptions
from .plan_run import PlanRun
from .plans import OnlineBisection, Plan, StageCosts
from .profile import Planning, measure_profile, shapes_of
from .rng import StageRng
from .stages import StageRunner
from .stats import TrainerStats, trainer_stats
from .throughput import Throughput, work_of
from .timeline import Tracer, write_worker_trace

log = logging.getLogger(__name__)

_T = TypeVar("_T")

__all__ = ["LossFn", "Resynced", "Trainer", "TrainerStats"]


class Resynced(Exception):
    """A step was interrupted (the server restarted from a snapshot, or this worker was detached)
    and the trainer reconnected to a job at another step: train ``step`` next, with its data.
    :meth:`Trainer.fit` handles this itself."""

    def __init__(self, interrupted: int, step: int) -> None:
        super().__init__(f"step {interrupted} was interrupted; the job is at step {step} now")
        self.interrupted = interrupted
        self.step = step


_P = ParamSpec("_P")


def _exclusive(method: Callable[Concatenate[Trainer, _P], _T]) -> Callable[Concatenate[Trainer, _P], _T]:
    """One call of a trainer at a time: a second, from another thread or from inside ``loss_fn``,
    is refused at once (two interleaved steps broke the prefetch order and the step count)."""

    @functools.wraps(method)
    def exclusive(self: Trainer, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        if not self._busy.acquire(blocking=False):
            raise StateError(
                f"this trainer is busy with another call: {method.__name__}() came from another thread or from "
                "inside loss_fn; a trainer serves one call at a time (one trainer per thread)"
            )
        try:
            return method(self, *args, **kwargs)
        finally:
            self._busy.release()

    return exclusive


class Trainer:
    """Trains a job's stages as one data-parallel worker. Create with ``job.trainer(...)``."""

    def __init__(
        self, endpoint: WorkerEndpoint, runners: list[StageRunner], *, device: torch.device, options: TrainerOptions
    ) -> None:
        self.options = options
        self.device = device
        self.job_name = endpoint.job
        self._busy = threading.Lock()  # held by the call running (``_exclusive``)
        plan, from_profile = options.checkpointing.planner(len(runners))
        if plan is not None and plan.n != len(runners):
            raise ValueError(f"the plan is for {plan.n} positions, the job's chain has {len(runners)}")
        parallel = options.parallelism
        allreduce = AllReduceGradients(max(r.spec.numel for r in runners)) if parallel.reduce == "allreduce" else None
        reader = allreduce is not None and allreduce.rank != 0
        self.connection = conn = WorkerConnection(
            endpoint, device, options.transport, world_size=parallel.world_size, reader=reader
        )
        try:  # joined: whatever fails from here leaves the job again (a worker left joined would be waited for)
            self.executor = PlanExecutor(
                runners,
                conn,
                device=device,
                rng=StageRng(device, options.checkpointing.preserve_rng),
                scaler=scaler_for(conn.compute_dtype, options.precision.loss_scale, endpoint.job),
                allreduce=allreduce,
                early_stop=options.checkpointing.early_stop,
            )
            self.planning = Planning(plan, from_profile, self.executor.stages_of)
        except BaseException:
            conn.shut_down()
            raise
        self._step = conn.joined_step
        self._steps_done = 0
        self._peak_boundary = 0
        self.last_loop_steps = 0
        self._loop_summary: dict[str, Any] | None = None  # plan_summary() after a step_loop
        self._throughput = Throughput()  # samples and tokens per second, for stats()
        self._tracer: Tracer | None = None
        self._endpoint = endpoint
        endpoint.register(self)
        log.info(
            "worker %d joined job %r at step %d: %d positions on %d stages, prefetch %d, ring %d bytes, %s",
            conn.worker_id,
            endpoint.job,
            self._step,
            len(runners),
            len(self.executor.first_use),
            conn.prefetch,
            conn.ring.nbytes,
            ("shared memory, zero-copy" if conn.zero_copy else "shared memory") if conn.shm else "data frames",
        )

    # ---- what the parts know, read through ---------------------------------------------------------
    @property
    def plan(self) -> Plan | None:
        """The checkpoint plan (None until the first step of a schedule planned from a profile)."""
        return self.planning.plan

    @property
    def profile(self) -> StageCosts | None:
        """The costs a profiled plan was made for (see :class:`~wstream.client.profile.Planning`)."""
        return self.planning.profile

    @property
    def step_index(self) -> int:
        """The step the next ``step()`` call trains (the job's step when this worker is in sync)."""
        return self._step

    # The connection's facts: its session, whether weights come through shared memory (``shm``)
    # and are computed on in place (``zero_copy``), the dtype stages compute in, the ring's depth
    # and how often this worker reconnected.
    @property
    def session(self) -> bytes:
        return self.connection.session

    @property
    def shm(self) -> bool:
        return self.connection.shm

    @property
    def zero_copy(self) -> bool:
        return self.connection.zero_copy

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.connection.compute_dtype

    @property
    def prefetch(self) -> int:
        return self.connection.prefetch

    @property
    def reconnects(self) -> int:
        return self.connection.reconnects

    # ---- public ------------------------------------------------------------------------------------
    @_exclusive
    def step(self, inputs: Any, targets: Any, loss_fn: LossFn, *, micro_batches: int = 1) -> float:
        """One optimizer step on ``inputs``/``targets``; returns the loss as a float.

        With ``micro_batches=k`` every tensor of ``inputs`` and ``targets`` is cut into k chunks
        along dim 0 and the step runs *stage-major* (after L2L): while a stage's weights are
        resident it runs for every micro-batch, forward and backward, so the weights move once per
        step whatever k is. The gradient is that of ordinary gradient accumulation,
        ``sum_j grad(loss_fn(out_j, targets_j) / k)``, and the loss returned is the mean of the
        micro-batches' losses. The checkpoint plan applies to every micro-batch (a kept input is
        kept for all k); plans made from a profile count k in their memory budget.

        Returns once the step has committed on the server: every worker's gradient of every stage
        is in and the updates are queued (they run while the next step's forward starts; a fetch
        or ``job.state_dict()`` waits for the stages it reads). In a job with ``delayed_update``,
        once every gradient of the step is sent (:meth:`flush` waits for the commits).
        """
        self._check_open()
        started = time.perf_counter()
        loss = self._recovering(lambda: self._step_once(inputs, targets, loss_fn, micro_batches))
        self._loop_summary = None
        self._throughput.add(*work_of(inputs), time.perf_counter() - started)
        return loss

    @contextlib.contextmanager
    def trace(self, path: str | os.PathLike[str]) -> Iterator[Tracer]:
        """Record a timeline of the steps run inside ``with trainer.trace("step.json"):`` and
        write it, with the server's side of the same time (gradients gathered, updates queued and
        run per stage, fetches it held back), as Chrome-trace JSON for https://ui.perfetto.dev or
        chrome://tracing. See docs/throughput.md for how to read it."""
        if self._tracer is not None:
            raise StateError("this trainer is already tracing")
        tracer = Tracer()
        self._set_tracer(tracer)
        try:
            yield tracer
            self.flush()  # a delayed-update job's last updates belong in the picture
        finally:
            self._set_tracer(None)
        conn = self.connection

        def timeline() -> m.TimelineReply:
            reply, _ = conn.chan.request(m.Timeline(session=conn.session), m.TimelineReply)
            return reply

        write_worker_trace(path, tracer, timeline, job=self.job_name, worker=conn.worker_id)

    def _set_tracer(self, tracer: Tracer | None) -> None:
        self._tracer = self.executor.tracer = self.connection.sc.tracer = tracer

    @_exclusive
    def flush(self) -> None:
        """Wait until the server has taken every gradient this worker sent and its steps
        committed. Only a job with ``delayed_update`` has any outstanding between steps;
        ``close()`` flushes too. The updates may still run: :meth:`wait_updates` waits for them."""
        self._drain()

    def _drain(self) -> None:
        if not self.connection.closed:
            self.connection.pusher.drain()

    @_exclusive
    def wait_updates(self, timeout: float | None = None) -> int:
        """Wait until the server has applied the updates of every step this worker trained (the
        job's weights are those after :attr:`step_index` steps: ``await_step``, which moves no
        weights); returns the job's step. ``timeout``: seconds (default: the client's
        ``wait_timeout``); with several workers it waits for theirs too."""
        self._drain()
        conn = self.connection
        reply, _ = conn.chan.request(
            m.AwaitStep(session=conn.session, step=self._step), m.StepReached,
            timeout_s=conn.endpoint.wait_timeout_s if timeout is None else timeout, held=True,
        )
        return reply.step

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
        uninterrupted one), also when it comes while the last step's gradients are flushed.
        Returns the loss of every step this worker completed."""
        losses: dict[int, float] = {}
        while True:
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
            try:
                self._recovering(self._flush_once)
                return losses
            except Resynced as r:  # the job lost steps in the restart: train them again
                log.warning("%s; going on from there", r)

    def _flush_once(self) -> None:
        """:meth:`flush`, made ready for a reconnect when the connection is lost in it."""
        try:
            self.flush()
        except (ServerUnavailable, SessionExpiredError):
            self._abort_step(False, recoverable=self.options.transport.reconnect_s > 0)
            raise

    @_exclusive
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
        over its applications and pushed once. ``self.last_loop_steps`` says how many ran;
        :meth:`plan_summary` what the last loop's plan cost. Memory: O(log n) live states on the
        device, but the worker's host memory grows with n by a little per application (the plan's
        actions, and ~5 KiB of RNG state per application that draws random numbers). A lost
        connection is recovered as :meth:`step`'s is."""
        self._check_open()
        runners = self.executor.runners
        if len(runners) != 1:
            raise StateError(f"step_loop trains a job of one stage (the loop body); this job has {len(runners)}")
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")
        started = time.perf_counter()
        loss = self._recovering(lambda: self._loop_once(inputs, targets, loss_fn, halt, max_steps))
        self._throughput.add(*work_of(inputs), time.perf_counter() - started)
        return loss

    def _loop_once(self, inputs: Any, targets: Any, loss_fn: LossFn, halt: Callable[..., bool], max_steps: int) -> float:
        inputs, targets = place(inputs, self.device, self.compute_dtype), place(targets, self.device)
        body = self.executor.runners[0]
        started = time.monotonic_ns()
        run = self._new_run(as_boundary(inputs), lambda position: body, targets=[targets])
        ex, prefetcher = self.executor, self.connection.prefetcher
        prefetcher.start(self._step, [0])
        planner = OnlineBisection()
        try:
            with ex.stage_weights(0) as (weights, base):  # the body's weights serve every application
                run.held[0] = (weights, base)
                ex.execute(run, *planner.actions[0], loss_fn)
                while True:
                    for op, i in planner.advance():
                        ex.execute(run, op, i, loss_fn)
                    assert run.current is not None
                    with torch.no_grad():
                        if planner.position >= max_steps or halt(*run.current[1]):
                            break
                run.last = planner.position - 1
                for op, i in planner.finish():  # position 0's backward pushes the sum over applications
                    ex.execute(run, op, i, loss_fn)
                assert run.pushed, "the loop body's gradient was not pushed: a bug in wstream"
            ex.end_fetches()
            self._commit(run)
        except (ServerUnavailable, SessionExpiredError):
            self._abort_step(run.pushed, recoverable=self.options.transport.reconnect_s > 0)
            raise
        except BaseException:
            self._abort_step(run.pushed)
            raise
        if self._tracer is not None:
            self._tracer.add(f"step {self._step}", "step", "steps", started, step=self._step, loop=planner.position)
        self.last_loop_steps = planner.position
        sim = planner.simulation
        assert sim is not None
        self._loop_summary = {
            "schedule": "online bisection (a loop)", "stages": planner.position,
            "forward_evaluations": planner.position + sim.advances, "recomputed_forwards": sim.advances,
            "peak_kept_states": sim.peak_slots, "peak_live_states": sim.peak_states,
        }
        self._end_run(run)
        return run.loss

    @_exclusive
    def forward(self, inputs: Any, *, train: bool = False) -> Any:
        """Run the chain forward on ``inputs`` with the job's current weights and return the last
        position's output (e.g. logits), without gradients and without an update: evaluation or
        inference. ``train=False`` puts the skeletons in eval mode meanwhile (dropout off)."""
        self._check_open()
        runners = self.executor.runners
        modes = [r.skeleton.training for r in runners]
        current = as_boundary(place(inputs, self.device, self.compute_dtype))  # as step() places them
        self.connection.prefetcher.start(self._step, self.executor.stages_of(list(range(len(runners)))))
        out: Any = None
        try:
            for r in runners:
                r.skeleton.train(train)
            for runner in runners:
                with self.executor.stage_weights(runner.stage) as (weights, base), torch.no_grad():
                    out = runner(weights, current, base)
                current = output_boundary(out)
            self.executor.end_fetches()
        except BaseException:
            self.executor.forget_resident()
            self.connection.prefetcher.reset()
            raise
        finally:
            for r, mode in zip(runners, modes):
                r.skeleton.train(mode)
        return out

    def plan_summary(self) -> dict[str, Any]:
        """What the checkpoint plan costs per step: recomputation, memory and weight traffic;
        after :meth:`step_loop`, what the last loop's plan cost (its length decides it)."""
        if self._loop_summary is not None:
            return {
                **self._loop_summary, "peak_activation_bytes_measured": self._peak_boundary,
                "weight_bytes_fetched": self.connection.stage_bytes()[0],
            }
        return self.planning.summary(self.connection.stage_bytes(), peak_boundary=self._peak_boundary, tapes=self.executor.tapes)

    def stats(self) -> TrainerStats:
        """What the steps so far did (fetches, pushes, waits, memory, loss scale)."""
        return trainer_stats(
            self.connection, self.executor.scaler, steps=self._steps_done, peak_boundary=self._peak_boundary,
            throughput=self._throughput,
        )

    def close(self) -> None:
        """Leave the job (the server detaches this worker) and stop every thread."""
        if self.connection.closed:
            return
        pusher = self.connection.pusher
        if pusher.uncommitted():  # a step left half-way: the server discards it when this worker leaves
            log.warning("closing with gradients of a step that was never committed: the server discards that step")
            pusher.forget_outstanding()
            self._shut_down()
            return
        try:
            pusher.drain()  # a delayed-update job's last gradients
        except WstreamError as exc:
            log.warning("the last gradients were not acknowledged: %s", exc)
        finally:  # also on Ctrl-C or another error in the drain: leave, and stop the heartbeat
            self._shut_down()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- a step's life -----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.connection.closed:
            raise StateError("this trainer is closed")

    def _recovering(self, run: Callable[[], _T]) -> _T:
        """``run()`` a step (or the last flush); when the connection is lost reconnect, and retry the step if the job
        is still at it, or raise :class:`Resynced` when it is at another step now. A step tried again
        starts from the RNG state its first try started from: its dropout masks are those of a run
        that never lost its connection."""
        step = self._step
        rng = self.executor.rng
        start = rng.state()
        while True:
            try:
                return run()
            except (ServerUnavailable, SessionExpiredError) as exc:
                if self.options.transport.reconnect_s <= 0 or self.connection.closed:
                    raise
                if self.executor.allreduce is not None:
                    raise StateError(
                        f"rank {self.executor.allreduce.rank} lost its connection ({exc}); with reduce='allreduce' the ranks "
                        "all-reduce every stage in lockstep, so one rank cannot train a step again alone: restart every "
                        "rank (torchrun does with --max-restarts) to resume from the job's step"
                    ) from exc
                # without its traceback: the failed step's frames, and the activations they hold (on
                # a GPU, device memory), are freed before the reconnect allocates its buffers
                cause = exc.with_traceback(None)
            self.connection.recover(cause)
            del cause
            self._step = self.connection.joined_step
            if self._step != step:
                raise Resynced(step, self._step)
            rng.set_state(start)

    def _new_run(self, inputs: Any, runner_at: Callable[[int], StageRunner], **kw: Any) -> PlanRun:
        conn, scaler = self.connection, self.executor.scaler
        delayed = conn.delayed_update and self._step >= conn.delay_after  # may end before its updates
        allreduce = self.executor.allreduce
        all_finite = None if allreduce is None else functools.partial(allreduce.all_finite, device=self.device)
        return PlanRun(
            inputs, runner_at, step=self._step, delayed=delayed, scale=None if scaler is None else scaler.scale,
            all_finite=all_finite, **kw
        )

    def _step_once(self, inputs: Any, targets: Any, loss_fn: LossFn, k: int) -> float:
        check_micro_batches(inputs, targets, k)
        if self.executor.allreduce is not None:
            self.executor.allreduce.same_micro_batches(k, self.device)
        inputs, targets = place(inputs, self.device, self.compute_dtype), place(targets, self.device)
        lanes = split_micro_batches(inputs, k, what="inputs")
        lane_targets = split_micro_batches(targets, k, what="targets")
        conn, ex, planning = self.connection, self.executor, self.planning
        shapes = shapes_of(lanes[0])
        if planning.needs_profile(k, shapes):
            one = measure_profile(
                ex, conn.prefetcher, lanes[0], step=self._step, stage_bytes=conn.stage_bytes(), zero_copy=conn.zero_copy
            )
            planning.plan_for(one, k, shapes)
        plan = planning.plan
        assert plan is not None
        conn.prefetcher.start(self._step, planning.fetch_order)
        runners = ex.runners
        run = self._new_run(
            join_lanes(as_boundary(x) for x in lanes), runners.__getitem__, k=k, targets=lane_targets, last=len(runners) - 1,
            lane_weights=lane_weights(inputs, k),
        )
        del inputs, lanes  # the run holds x_0 now: an OFFLOAD 0 frees it from the device (the plan counts on it)
        started = time.monotonic_ns()
        try:
            ex.run_actions(run, plan.actions, loss_fn, planning.taped)
            ex.end_fetches()
            self._commit(run)
        except (ServerUnavailable, SessionExpiredError):
            self._abort_step(run.pushed, recoverable=self.options.transport.reconnect_s > 0)
            raise
        except BaseException:
            self._abort_step(run.pushed)
            raise
        if self._tracer is not None:
            self._tracer.add(f"step {self._step}", "step", "steps", started, step=self._step, micro_batches=k)
        self._end_run(run)
        return run.loss

    def _commit(self, run: PlanRun) -> None:
        """Every gradient of the step is pushed: send the step's commit and, unless the job's
        updates are delayed, wait until the step committed (server/step_commit.py NOTE [The step
        commit point]); the update itself overlaps the next step's forward."""
        pusher = self.connection.pusher
        if self.executor.reader:
            return
        pusher.commit(run.step)
        if not run.delayed:
            pusher.wait_committed(run.step)  # held slots come back as their updates end

    def _end_run(self, run: PlanRun) -> None:
        """A step's run completed: record its peak, move the loss scale by what it met, and count it."""
        self._peak_boundary = max(self._peak_boundary, run.peak_bytes)
        scaler = self.executor.scaler
        if scaler is not None:
            assert run.scales is not None
            scaler.end_step(run.scales)
        self._step += 1
        self._steps_done += 1

    def _abort_step(self, pushed_any: bool, *, recoverable: bool = False) -> None:
        conn = self.connection
        self.executor.forget_resident()
        conn.prefetcher.reset()
        if recoverable:  # the caller reconnects: the server discards this worker's step
            conn.pusher.forget_outstanding()
            return
        if pushed_any:
            conn.pusher.forget_outstanding()
            log.error(
                "a step failed after gradients were sent; this trainer is closed, create a new one "
                "(the server discards this worker's unfinished step when it leaves)"
            )
            self._shut_down()

    def _shut_down(self) -> None:
        """Leave the job, stop the threads and close the sockets, without waiting for pushes."""
        self.executor.close()
        self.connection.shut_down()
        self._endpoint.unregister(self)

