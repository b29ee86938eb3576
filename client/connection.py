"""A worker's connection to its job: session, membership, shared memory, streaming threads, lease.

:class:`WorkerConnection` attaches a session, joins the job as a worker, maps the server's shared
memory (page-locked for DMA on a GPU) and builds what streams through it: the
:class:`StreamContext`, the weight ring and its prefetch thread, the gradient stager and pusher,
and the heartbeat that keeps the lease. When the server restarts or detaches the worker,
:meth:`recover` tears that down and builds it again, retrying with backoff. Separate from the
trainer so that the trainer never sees sockets, mappings or threads, only the parts it asks for.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from wstream.protocol import LayoutError, ServerUnavailable, SessionExpiredError, StateError, UnknownJobError, WstreamError
from wstream.protocol import messages as m
from wstream.protocol.layout import describe_mismatch
from wstream.protocol.shm import map_segment

from .channel import attach_session
from .device import (
    HostRegistration,
    ReceiveRing,
    copy_engine,
    host_staging,
    ring_capacity,
    synchronize,
)
from .endpoint import WorkerEndpoint
from .gradient_write import GradientStager
from .options import Transport
from .prefetch import Prefetcher, WeightRing
from .push import GradientPusher
from .streaming import TORCH_DTYPES, HeartbeatThread, StreamContext
from .threads import share_cores
from .units import chain_layout, describe_cut
from .waiting import job_waiting

log = logging.getLogger(__name__)

_JOINED_HERE: dict[tuple[str, str], set[int]] = {}
"""The workers this process has joined, by (server address, job): a second trainer of a job in
one process is named at once (its steps wait for the first trainer's gradients)."""


class WorkerConnection:
    """One worker's membership of a job and everything that streams through it.

    ``reader``: a data-parallel rank that reads weights and pushes nothing (``reduce="allreduce"``,
    rank > 0). After :meth:`recover` the prefetcher, pusher and the rest are new objects: read
    them from here at each use."""

    def __init__(
        self, endpoint: WorkerEndpoint, device: torch.device, transport: Transport, *, world_size: int, reader: bool
    ) -> None:
        self.endpoint = endpoint
        self.device = device
        self.transport = transport
        self.world_size = world_size
        self.reader = reader
        self.reconnects = 0
        self.closed = False
        self.registrations: list[HostRegistration] = []
        self.receive: ReceiveRing | None = None
        self.worker_id = -1  # not joined yet
        self.incarnation = b""  # the job's identity (Attached.incarnation), from the first attach
        self.chan = endpoint.channel()
        try:
            self._connect_or_undo()
        except BaseException:
            self.chan.close()
            raise

    def _connect_or_undo(self) -> None:
        """:meth:`_connect`; when it fails after joining, leave again (a worker the others would wait
        for until its lease ends), forget the worker and unregister what it page-locked."""
        self.worker_id = -1
        try:
            self._connect()
        except BaseException:
            if self.worker_id >= 0:
                self._forget_joined()
                with contextlib.suppress(WstreamError):
                    self.chan.request(m.Leave(session=self.session), m.Ok, timeout_s=5.0)
            self.release_host_memory()
            raise

    def _connect(self) -> None:
        """Attach a fresh session, join as a worker, map shared memory and start the threads."""
        ep, transport = self.endpoint, self.transport
        shm, zero_copy = transport.shm, transport.zero_copy
        attached, signer = attach_session(self.chan, ep.job, ep.token)
        if self.incarnation and attached.incarnation != self.incarnation:
            raise UnknownJobError(
                f"job {ep.job!r} was dropped and created again since this worker joined it: its step belongs to "
                "the old job, and the new one is not trained from here (make a new trainer for it)"
            )
        self.incarnation = attached.incarnation
        self._check_layout(attached)
        self.session = attached.session
        self.chan.signer = signer
        published = None
        if shm is not False:
            try:
                # read-only where nothing page-locks it (a CPU worker computes on it in place: a write
                # would change the weights every worker reads, past the commit point)
                published = map_segment(attached.published_path, attached.published_bytes, writable=self.device.type == "cuda")
            except (FileNotFoundError, PermissionError, RuntimeError) as exc:
                if shm:
                    raise StateError(
                        f"shm=True but the job's shared memory {attached.published_path} cannot be mapped "
                        f"({exc}); is the server on another host? use shm=False"
                    ) from None
        self.shm = published is not None
        self.server_threads = attached.compute_threads
        if self.shm:  # on the server's host
            share_cores(attached.compute_threads, attached.server_pid, transport.cpu_threads)
        cpu_shm = self.shm and self.device.type == "cpu"
        if zero_copy and not cpu_shm:
            raise StateError("zero_copy=True needs a CPU device and shared memory (shm)")
        self.zero_copy = cpu_shm if zero_copy is None else zero_copy
        if published is not None:  # once, at attach (NOTE [Copy ordering on a GPU] in device.py)
            self._register(published, f"job {ep.job!r} published weights")
        self.delayed_update = attached.options.delayed_update
        self.delay_after = attached.options.delay_after
        joined, _ = self.chan.request(
            m.Join(
                session=self.session,
                shm=self.shm,
                grad_slots=transport.grad_slots,
                world_size=self.world_size,
                reader=self.reader,
                step_ring=self.shm and (self.device.type == "cpu" if transport.step_ring is None else transport.step_ring),
            ),
            m.Joined,
        )
        self.worker_id = joined.worker
        self.joined_step = joined.step
        """The job's step when this worker joined (the trainer trains it next)."""
        self._say_what_it_waits_for()
        max_numel = max(s.numel for s in attached.stages)
        self.step_ring = bool(joined.grad_slot_offsets)
        """Whether the gradient ring has a slot per stage (``Transport.step_ring`` granted)."""
        if self.step_ring:
            ring = map_segment(joined.grad_path, joined.grad_ring_bytes)
            self._register(ring, "gradient step ring")
            ends = [*joined.grad_slot_offsets[1:], joined.grad_ring_bytes]
            grad_views = [ring[at:end].view(torch.float32) for at, end in zip(joined.grad_slot_offsets, ends)]
        elif self.shm and joined.grad_slots:
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
        base_numels = [s.numel for s in attached.base_stages]
        base_published = (
            map_segment(attached.base_path, attached.base_bytes, writable=self.device.type == "cuda")
            if published is not None and attached.options.base
            else None
        )
        if base_published is not None:
            self._register(base_published, f"job {ep.job!r} frozen base {attached.options.base!r}")
        self.sc = StreamContext(
            endpoint=ep,
            session=self.session,
            signer=signer,
            numels=[s.numel for s in attached.stages],
            published=published,
            published_dtype=pub_dtype,
            zero_copy=self.zero_copy,
            base_published=base_published,
            base_numels=base_numels,
        )
        largest = max(n + (base_numels[i] if base_numels else 0) for i, n in enumerate(self.sc.numels))
        stage_bytes = largest * pub_dtype.itemsize
        budget = transport.weight_budget
        assert budget is None or isinstance(budget, int)  # Transport parsed it
        capacity = transport.depth + 1 if budget is None else ring_capacity(budget, stage_bytes, len(self.sc.numels))
        self.prefetch = capacity - 1
        self.ring = WeightRing(capacity, largest, pub_dtype, self.device, allocate=not self.zero_copy)
        staged = host_staging(self.device)
        if not self.shm and staged:
            if attached.options.base:
                raise StateError(
                    "a job on a frozen base cannot be trained over data frames on a GPU yet (not built): "
                    "run the worker on the server's host (shared memory)"
                )
            self.receive = ReceiveRing(2, stage_bytes, self.device)
        self.prefetcher = Prefetcher(self.sc, self.ring, copy_engine(self.device, "h2d"), self.receive)
        self.stager = GradientStager(  # a reader pushes nothing: no staging buffers on its device
            self.device, max_numel, copy_engine(self.device, "d2h"), staged=staged and not self.reader,
            tracer=lambda: self.sc.tracer,
        )
        self.pusher = GradientPusher(self.sc, grad_views, shm=self.shm, stager=self.stager, step_ring=self.step_ring)
        self.heartbeat = HeartbeatThread(
            self.sc, interval_s=max(0.05, attached.lease_s / 3), timeout_s=min(ep.timeout_s, max(1.0, attached.lease_s))
        )

    def _say_what_it_waits_for(self) -> None:
        """At once on joining: whether the job waits for more workers, and whether this process
        already has a worker of the job (stepped from one thread, the two would wait for each other)."""
        ep = self.endpoint
        here = _JOINED_HERE.setdefault((ep.address, ep.job), set())
        if here and not self.reader:
            log.warning(
                "job %r already has a trainer in this process (worker %s); this one is worker %d. A step commits "
                "only when every worker's gradients are in, so two trainers of one job stepped one after the "
                "other from one thread wait for each other (until wait_timeout). Use one trainer per job and "
                "process (data parallel: one process per rank), or close the first trainer before making another.",
                ep.job, ", ".join(map(str, sorted(here))), self.worker_id,
            )
        if not self.reader:
            here.add(self.worker_id)
        waiting = job_waiting(ep)
        if waiting is not None:
            log.info("job %r: worker %d joined; %s", ep.job, self.worker_id, waiting)

    def _forget_joined(self) -> None:
        _JOINED_HERE.get((self.endpoint.address, self.endpoint.job), set()).discard(self.worker_id)

    def _check_layout(self, attached: m.Attached) -> None:
        """Refuse to join a job whose layout is not the one the trainer's stages were made for
        (the job was dropped and created again under its name): the worker would read its weights
        at the wrong offsets and push gradients of the wrong size."""
        ep = self.endpoint
        cut = None if attached.options.units is None else tuple(attached.options.units)
        # compared stage by stage (with units too), so that a difference names the chain's stage
        mismatch = describe_mismatch(chain_layout(attached.stages, cut), chain_layout(ep.stages, ep.units))
        if mismatch is None and cut != ep.units:  # the same stages, cut otherwise (another unit_bytes)
            mismatch = f"the job holds its stages as {describe_cut(cut)}, the trainer was made for {describe_cut(ep.units)}"
        if mismatch is None:
            base = describe_mismatch(list(attached.base_stages), list(ep.base_stages))
            mismatch = None if base is None else f"its frozen base: {base}"
        if mismatch is not None:
            raise LayoutError(
                f"job {ep.job!r} on the server does not have the layout this trainer was made for (was it dropped "
                f"and created again?): {mismatch}; attach to it again with stages of its layout"
            )

    def stage_bytes(self) -> list[int]:
        """Each weight stage's size in the published dtype."""
        return [n * self.sc.published_dtype.itemsize for n in self.sc.numels]

    def recover(self, cause: WstreamError) -> None:
        """Reconnect after the server restarted or this worker was detached: a new session and
        worker, retried with backoff for up to ``reconnect_s`` seconds."""
        ep = self.endpoint
        log.warning("worker %d of job %r lost its connection (%s); reconnecting", self.worker_id, ep.job, cause)
        tracer = self.sc.tracer
        self.heartbeat.close()
        self.prefetcher.close()
        self.pusher.close()
        self.release_host_memory()  # (after a device synchronize: no copy touches the old buffers now)
        # the old ring and staging buffers go before the new connection allocates its own: on a GPU
        # a ring sized close to the free memory (weight_budget) would not fit twice
        self.ring.buffers.clear()
        self.stager.buffers.clear()
        self._unmap()  # the new connection maps the job's segments afresh
        self._forget_joined()
        old_session, old_signer = self.session, self.sc.signer
        self.chan.close()
        with contextlib.suppress(WstreamError):  # if the server is alive, drop the old worker at once
            probe = ep.channel(timeout_s=1.0, signer=old_signer)
            try:
                probe.request(m.Leave(session=old_session), m.Ok)
            finally:
                probe.close()
        reconnect_s = self.transport.reconnect_s
        deadline = time.monotonic() + reconnect_s
        delay = 0.05
        while True:
            self.chan = ep.channel(timeout_s=min(ep.timeout_s, 5.0))
            try:
                self._connect_or_undo()
                break
            except (ServerUnavailable, SessionExpiredError) as exc:
                self.chan.close()
                if time.monotonic() + delay > deadline:
                    self.closed = True
                    raise ServerUnavailable(
                        f"could not reconnect to job {ep.job!r} within {reconnect_s:g} s: {exc}"
                    ) from cause
                time.sleep(delay)
                delay = min(2 * delay, 2.0)
        self.chan.timeout_s = ep.timeout_s
        self.sc.tracer = tracer
        self.reconnects += 1
        log.warning("worker %d rejoined job %r at step %d", self.worker_id, ep.job, self.joined_step)

    def shut_down(self) -> None:
        """Leave the job, stop the threads and close the sockets, without waiting for pushes."""
        self.closed = True
        self._forget_joined()
        self.heartbeat.close()
        self.prefetcher.close()
        try:
            self.chan.request(m.Leave(session=self.session), m.Ok, timeout_s=min(5.0, self.chan.timeout_s))
        except WstreamError as exc:
            log.warning("leave failed (the server will detach this worker when its lease ends): %s", exc)
        self.pusher.close()
        self.release_host_memory()
        self._unmap()
        self.chan.close()

    def _unmap(self) -> None:
        """Let the job's segments go now (the threads that read them have stopped): a closed
        trainer kept them mapped until Python's cyclic collector ran, pages the server's account
        no longer counts once the job is dropped or this worker left."""
        self.sc.published = None
        self.sc.base_published = None

    def _register(self, mapping: torch.Tensor, what: str) -> None:
        """Page-lock ``mapping`` for DMA (nothing on a CPU worker); undone by ``release_host_memory``."""
        self.registrations.append(HostRegistration(mapping, self.device, what=what))

    def registered(self) -> tuple[int, float]:
        """Host memory page-locked now (bytes) and the seconds its registrations took."""
        regs = [*self.registrations, *(self.receive.registrations if self.receive is not None else [])]
        return sum(r.nbytes for r in regs), sum((r.seconds for r in regs), 0.0)

    def release_host_memory(self) -> None:
        """Unregister host memory once no copy can touch it any more (before its unmapping)."""
        synchronize(self.device)
        if self.receive is not None:
            self.receive.close()
            self.registrations.extend(self.receive.registrations)
            self.receive = None
        for r in self.registrations:
            r.unregister()
        self.registrations.clear()
