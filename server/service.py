"""The server process: its parts composed, ``run()`` until stopped, and a clean shutdown.

One loop thread owns every job and session: the :class:`~wstream.server.transport.Transport` polls
the ROUTER socket next to the mailboxes of the :class:`~wstream.server.update_pool.UpdatePool`
(optimizer threads only run :meth:`UpdateTask.run`) and of the
:class:`~wstream.server.snapshot_scheduler.SnapshotScheduler` (the writer thread), and hands each
message to the :class:`~wstream.server.handlers.Handlers`. A message that fails to decode or
validate is answered with an ``error`` reply and never leaves the loop.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from collections.abc import Mapping

import torch

from wstream.protocol.host import host_cores
from wstream.protocol import PROTOCOL_VERSION
from wstream.protocol.shm import configure_huge_pages, reap_stale_segments

from .native import library as native_kernels
from .config import ServerConfig
from .counters import ServerCounters
from .handlers import Handlers
from .job import Job
from .memory import MemoryAccount, memory_limit_warnings
from .metrics import MetricsEndpoint
from .outgoing import Outbox
from .sessions import Session, SessionTable
from .snapshot import SnapshotStore
from .snapshot_scheduler import SnapshotScheduler
from .transport import Transport
from .update_pool import UpdatePool

log = logging.getLogger(__name__)


class Server:
    """A wstream parameter server. ``run()`` blocks until :meth:`stop` or SIGTERM/SIGINT."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        configure_huge_pages(config.huge_pages)  # type: ignore[arg-type]  # validated by ServerConfig
        self.memory = MemoryAccount(config.memory_limit)
        for warning in memory_limit_warnings(config.memory_limit):
            log.warning("%s", warning)
        if config.insecure and config.admin_secret_file is None:
            log.warning(
                "--insecure: listening on %s without an admin secret; anyone who reaches the server may "
                "create jobs until its memory is full",
                ", ".join(config.bind),
            )
        if config.store is not None and not config.snapshot_every:
            log.warning(
                "--store without --snapshot-every: jobs are snapshotted at creation, on save and at a clean stop "
                "only, so a crash loses every step since (give --snapshot-every N to bound it)"
            )
        self.jobs: dict[str, Job] = {}
        self.started = time.monotonic()
        self._stop = threading.Event()
        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        self._updates = UpdatePool(config.optimizer_workers)
        native_kernels()  # built (or found in its cache) now, not by the first update (NOTE [Native kernels])
        store = SnapshotStore(config.store, config.keep_snapshots) if config.store is not None else None
        try:
            self.transport = Transport(config)
        except BaseException:
            if store is not None:
                store.close()  # give the store up again: this server never ran
            raise
        self.counters = ServerCounters()
        outbox = Outbox(self.transport.send, self.counters.errors)
        self.snapshots = SnapshotScheduler(store, config, self.jobs, outbox)
        self._sessions = SessionTable(config)
        self.handlers = Handlers(
            config, self.jobs, self.memory, self._sessions, self.snapshots, outbox, self.counters,
            submit=self._updates.submit, stop=self.stop, started=self.started,
        )
        self.metrics: MetricsEndpoint | None = None  # last: a scrape reads everything above
        if config.metrics_port is not None:
            try:
                self.metrics = MetricsEndpoint(self, config.metrics_addr, config.metrics_port)
            except OSError as exc:
                self.transport.close()
                if store is not None:
                    store.close()
                raise OSError(f"cannot serve metrics on {config.metrics_addr}:{config.metrics_port}: {exc}") from None

    @property
    def sessions(self) -> Mapping[bytes, Session]:
        return self._sessions.all

    @property
    def endpoints(self) -> list[str]:
        return self.transport.endpoints

    @property
    def curve_public_key(self) -> bytes | None:
        return self.transport.curve_public_key

    def run(self) -> None:
        """Serve until stopped; then free every job and shared-memory segment."""
        reap_stale_segments()
        if threading.current_thread() is threading.main_thread():  # before the restore: a signal then also cleans up
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # a hangup too: a clean stop, not a kill
                signal.signal(sig, lambda *_: self.stop())
        warmup = threading.Thread(target=_warm_up_optimizer, name="wstream-warmup")
        warmup.start()  # torch's first fused optimizer takes seconds to import: not in a request
        try:
            self._restore_and_serve()
        finally:
            warmup.join()
            self._shutdown()

    def _restore_and_serve(self) -> None:
        self.snapshots.restore_jobs(self.memory, self._stop)
        log.info(
            "wstream-server (protocol %d, pid %d) listening on %s, memory limit %d bytes",
            PROTOCOL_VERSION,
            os.getpid(),
            self.transport.describe(),
            self.memory.limit,
        )
        self.transport.log_security()
        log.info(
            "updates on %d torch threads of %d cores; OpenMP waits %s",
            torch.get_num_threads(), host_cores(), os.environ.get("OMP_WAIT_POLICY", "as its default (spinning first)"),
        )
        if self.metrics is not None:
            log.info("Prometheus metrics at %s", self.metrics.url)
        self.transport.serve(
            self._stop,
            self.handlers.receive,
            [self._updates.fileno(), self.snapshots.fileno()],
            self._drain,
            self.handlers.expire,
            tick_every_s=min(1.0, self.config.lease_s / 4),
        )

    def stop(self) -> None:
        """Ask the loop to exit (safe from any thread or a signal handler)."""
        self._stop.set()
        self._updates.done.wake()

    def _finish_updates(self, within_s: float) -> None:
        """Let the updates of committed steps finish, and finish them on this thread as the loop
        would, before the final snapshots: a step is committed once its last gradient is in, and a
        job stopped with some stages updated and others not has no consistent step to snapshot
        (found by review: half of the SIGTERMs during training lost every step since the last
        snapshot). Bounded by ``within_s``: a job whose updates take longer resumes from its last
        snapshot, as a job stopped in the middle of a step does."""
        end = time.monotonic() + within_s
        waits = [self._updates.fileno(), self.snapshots.fileno()]
        while any(job.step_commit.updating for job in self.jobs.values()):
            left = end - time.monotonic()
            if left <= 0:
                log.warning("updates still running after %.0f s at shutdown: their jobs resume from their last snapshot", within_s)
                return
            select.select(waits, [], [], min(left, 0.5))
            self._drain()

    def _drain(self) -> None:
        """The loop's turn for its mailboxes: finished updates first, then finished snapshots."""
        self.handlers.updates_done(self._updates.drain())
        self.snapshots.drain()

    def _shutdown(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        self._finish_updates(SHUTDOWN_UPDATES_S)
        self._updates.shutdown()
        self.snapshots.shutdown()
        for job in list(self.jobs.values()):
            job.close()
        self.jobs.clear()
        self._sessions.all.clear()
        self.transport.close(linger=self.handlers.shutdown_requested)
        self._updates.done.close()
        log.info("wstream-server stopped; all shared-memory segments removed")


SHUTDOWN_UPDATES_S = 120.0
"""How long a stopping server lets the updates of committed steps run (a whole large model's
updates take about one optimizer pass: seconds)."""


def _warm_up_optimizer() -> None:
    """Build and step one tiny fused AdamW, so the first job's stages do not wait for the imports."""
    w = torch.zeros(16)
    w.grad = torch.zeros(16)
    torch.optim.AdamW([w], fused=True).step()
