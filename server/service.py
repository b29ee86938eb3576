"""The server process: one ROUTER socket loop, a pool for stage updates, and clean shutdown.

The loop thread owns the socket and all job state; optimizer threads only run
:meth:`UpdateTask.run` and hand the finished task back through a queue plus a wake-up pipe that the
loop polls next to the socket. A message that fails to decode or validate is answered with an
``error`` reply and never leaves the loop.
"""

from __future__ import annotations

import functools
import hmac
import logging
import os
import queue
import secrets
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import zmq
from zmq.auth.thread import ThreadAuthenticator

from wstream.protocol import (
    PROTOCOL_VERSION,
    AuthError,
    InternalError,
    JobExistsError,
    LayoutError,
    MemoryLimitError,
    NotReadyError,
    ProtocolError,
    SessionExpiredError,
    StateError,
    UnknownJobError,
    WstreamError,
    check_frames,
    decode_request,
    encode,
    peek_id,
)
from wstream.protocol import messages as m
from wstream.protocol.auth import admin_proof, mac_matches, secret_key, session_key
from wstream.protocol.curve import load_secret_certificate, uses_curve
from wstream.protocol.shm import SegmentSpaceError, configure_huge_pages, reap_stale_segments

from .auth import NonceStore, ReplayWindow, start_authenticator
from .config import ServerConfig, read_admin_secret
from .job import Job, Outgoing, UpdateTask
from .memory import MemoryAccount
from .counters import ServerCounters
from .metrics import MetricsEndpoint
from .snapshot import Snapshot, SnapshotError, SnapshotStore, Waiter

log = logging.getLogger(__name__)

_MAX_MESSAGES_PER_TURN = 256


class Session:
    """A signed session: of one job, or (``job`` None) an admin session."""

    __slots__ = ("id", "job", "key", "replay", "worker", "created")

    def __init__(self, sid: bytes, job: Job | None, key: bytes) -> None:
        self.id = sid
        self.job = job
        self.key = key
        self.replay = ReplayWindow()
        self.worker: int | None = None
        self.created = time.monotonic()

    @property
    def admin(self) -> bool:
        return self.job is None


class Server:
    """A wstream parameter server. ``run()`` blocks until :meth:`stop` or SIGTERM/SIGINT."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        configure_huge_pages(config.huge_pages)  # type: ignore[arg-type]  # validated by ServerConfig
        self.memory = MemoryAccount(config.memory_limit)
        self.jobs: dict[str, Job] = {}
        self.sessions: dict[bytes, Session] = {}
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._done: queue.SimpleQueue[tuple[UpdateTask, BaseException | None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        self._pool = ThreadPoolExecutor(max_workers=config.optimizer_workers, thread_name_prefix="wstream-opt")
        self.store = SnapshotStore(config.store, config.keep_snapshots) if config.store is not None else None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wstream-snapshot")
        self._snap_done: queue.SimpleQueue[tuple[Job, Snapshot, str | None, BaseException | None]] = queue.SimpleQueue()
        self._save_waiters: dict[str, list[Waiter]] = {}
        self._shutdown_requested = False  # read by _close_sockets, also when a bind fails below
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # A reply that cannot be queued must be reported, not dropped silently (ZeroMQ's default
        # for a ROUTER at its high-water mark): raise instead, and queue up to 64 Ki replies per
        # peer (a worker's deferred fetches alone can be answered 1,024 at once).
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.sndhwm = 65_536
        self._authenticator: ThreadAuthenticator | None = None
        self.endpoints: list[str] = []
        self.curve_public_key: bytes | None = None
        try:
            self._listen(config)
        except BaseException:
            self._close_sockets()
            raise
        self.counters = ServerCounters()
        self.metrics: MetricsEndpoint | None = None
        if config.metrics_port is not None:
            try:
                self.metrics = MetricsEndpoint(self, config.metrics_addr, config.metrics_port)
            except OSError as exc:
                self._close_sockets()
                raise OSError(f"cannot serve metrics on {config.metrics_addr}:{config.metrics_port}: {exc}") from None
        self._handlers: dict[type[m.Message], Callable[[bytes, m.Message, list[zmq.Frame]], Outgoing | None]] = {
            m.Hello: self._on_hello,
            m.CreateJob: self._on_create_job,
            m.Attach: self._on_attach,
            m.AdminAttach: self._on_admin_attach,
            m.Shutdown: self._on_shutdown,
            m.AddStage: self._on_add_stage,
            m.Seal: self._on_seal,
            m.Join: self._on_join,
            m.Fetch: self._on_fetch,
            m.Push: self._on_push,
            m.Pull: self._on_pull,
            m.Heartbeat: self._on_heartbeat,
            m.Leave: self._on_leave,
            m.DropJob: self._on_drop_job,
            m.Status: self._on_status,
            m.Save: self._on_save,
            m.Timeline: self._on_timeline,
            m.Describe: self._on_describe,
        }
        self._last_seen: dict[bytes, float] = {}
        self._nonces = NonceStore(config.nonce_ttl_s, config.max_pending_nonces)
        self._admin_key = (
            secret_key(read_admin_secret(config.admin_secret_file)) if config.admin_secret_file is not None else None
        )

    def _listen(self, config: ServerConfig) -> None:
        """Bind every endpoint: CURVE on the non-ipc ones when the server has a key (NOTE [Which
        endpoints are encrypted] in ``wstream.protocol.curve``), behind the authorized-keys check
        when there is a directory of them."""
        if config.curve_secret_key_file is not None:
            public, secret = load_secret_certificate(config.curve_secret_key_file, "server secret key")
            self._sock.curve_publickey = public
            self._sock.curve_secretkey = secret
            self.curve_public_key = public
            if config.curve_authorized_keys_dir is not None:  # the ZAP handler must be up before a bind
                self._authenticator = start_authenticator(self._ctx, config.curve_authorized_keys_dir)
        for addr in config.bind:
            if self.curve_public_key is not None:  # security options apply to the binds after them
                self._sock.curve_server = uses_curve(addr)
            try:
                self._sock.bind(addr)
            except zmq.ZMQError as exc:
                raise OSError(f"cannot listen on {addr}: {exc}") from None
            self.endpoints.append(self._sock.getsockopt_string(zmq.LAST_ENDPOINT))

    def _transport_security(self, endpoint: str) -> str:
        """How ``endpoint`` is protected, for the start-up log."""
        if not uses_curve(endpoint):
            return "plaintext: local socket, file permissions"
        if self.curve_public_key is None:
            return "plaintext"
        if self._authenticator is not None:
            return f"CURVE, only clients of {self.config.curve_authorized_keys_dir}"
        return "CURVE, any client with the server's public key"

    def _log_security(self) -> None:
        if self.curve_public_key is not None:
            log.info("CURVE public key of this server: %s", self.curve_public_key.decode())
            if not any(uses_curve(ep) for ep in self.endpoints):
                log.warning("a CURVE key was given but every endpoint is ipc://: nothing is encrypted")
            return
        exposed = [ep for ep in self.endpoints if uses_curve(ep) and not _loopback(ep)]
        if exposed:
            log.warning(
                "%s not encrypted: job tokens (sent once, by create_job) and tensor data cross the network "
                "in clear; start with --curve-secret-key to encrypt them",
                ", ".join(exposed),
            )

    # ---- lifecycle -----------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until stopped; then free every job and shared-memory segment."""
        reap_stale_segments()
        warmup = threading.Thread(target=_warm_up_optimizer, name="wstream-warmup")
        warmup.start()  # torch's first fused optimizer takes seconds to import: not in a request
        self._restore_jobs()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stop())
        log.info(
            "wstream-server (protocol %d, pid %d) listening on %s, memory limit %d bytes",
            PROTOCOL_VERSION,
            os.getpid(),
            ", ".join(f"{ep} ({self._transport_security(ep)})" for ep in self.endpoints),
            self.memory.limit,
        )
        self._log_security()
        if self.metrics is not None:
            log.info("Prometheus metrics at %s", self.metrics.url)
        try:
            self._loop()
        finally:
            warmup.join()
            self._shutdown()

    def stop(self) -> None:
        """Ask the loop to exit (safe from any thread or a signal handler)."""
        self._stop.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _shutdown(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._writer.shutdown(wait=True)
        self._final_snapshots()
        for job in list(self.jobs.values()):
            job.close()
        self.jobs.clear()
        self.sessions.clear()
        self._close_sockets()
        os.close(self._wake_r)
        os.close(self._wake_w)
        log.info("wstream-server stopped; all shared-memory segments removed")

    def _close_sockets(self) -> None:
        # after a 'shutdown' request, give its 'ok' a moment to leave
        self._sock.close(linger=1000 if self._shutdown_requested else 0)
        if self._authenticator is not None:  # its sockets are on the context: before term()
            self._authenticator.stop()
            self._authenticator = None
        self._ctx.term()

    # ---- the loop --------------------------------------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_lease_check = time.monotonic() + 1.0
        while not self._stop.is_set():
            events = dict(poller.poll(timeout=500))
            if self._wake_r in events:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            self._drain_completions()
            if self._sock in events:
                for _ in range(_MAX_MESSAGES_PER_TURN):
                    try:
                        frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(frames)
            now = time.monotonic()
            if now >= next_lease_check:
                self._expire_leases(now)
                next_lease_check = now + min(1.0, self.config.lease_s / 4)

    def _send(self, out: Outgoing) -> None:
        try:
            self._sock.send_multipart([out.identity, encode(out.message), *out.frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or queue full: never fatal for the loop
            log.warning("could not send %s: %s", type(out.message).__name__, exc)

    def _error(self, identity: bytes, request_id: int, exc: WstreamError) -> None:
        self.counters.errors[exc.code.value] += 1
        self._send(Outgoing(identity, m.Error(id=request_id, code=exc.code.value, message=exc.message)))

    def _handle(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        if len(frames) < 2:
            self._error(identity, 0, ProtocolError("empty message: expected a header frame"))
            return
        header = frames[1].buffer
        data = frames[2:]
        request_id = 0
        try:
            request_id = peek_id(header)
            msg = decode_request(header)
            self.counters.requests[m.op_of(type(msg))] += 1
            check_frames(msg, data)
            if isinstance(msg, m.SessionMessage):
                self._authenticate(msg)
                self._last_seen[msg.session] = time.monotonic()
            out = self._handlers[type(msg)](identity, msg, data)
        except WstreamError as exc:
            log.debug("request %d rejected: %s", request_id, exc)
            self._error(identity, request_id, exc)
            return
        except Exception as exc:  # a bug: answer, log with traceback, keep serving
            log.exception("internal error while handling request %d", request_id)
            self._error(identity, request_id, InternalError(f"internal server error: {exc!r} (a bug in wstream)"))
            return
        if out is not None:
            self._send(out)

    # ---- updates -------------------------------------------------------------------------------
    def _submit(self, task: UpdateTask) -> None:
        fut = self._pool.submit(task.run)
        fut.add_done_callback(lambda f, t=task: self._post_completion(t, f))

    def _post_completion(self, task: UpdateTask, fut: Future[UpdateTask]) -> None:
        error = None if fut.cancelled() else fut.exception()
        self._done.put((task, error))
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is already full of wake-ups (or closed at shutdown)

    def _drain_completions(self) -> None:
        while True:
            try:
                task, error = self._done.get_nowait()
            except queue.Empty:
                break
            if error is not None:
                log.error("update of job %r stage %d failed: %r", task.job.name, task.stage.index, error)
            if self.jobs.get(task.job.name) is not task.job:
                continue  # the job was dropped meanwhile
            for out in task.job.finish_update(task, error):
                self._send(out)
            self._maybe_snapshot(task.job)
        while True:
            try:
                job, snap, path, error = self._snap_done.get_nowait()
            except queue.Empty:
                return
            self._snapshot_finished(job, snap, path, error)

    # ---- sessions ------------------------------------------------------------------------------
    def _new_session(self, job: Job | None, key: bytes) -> bytes:
        """A session of ``job`` (None: an admin session) whose requests are signed with ``key``."""
        sid = secrets.token_bytes(16)
        self.sessions[sid] = Session(sid, job, key)
        self._last_seen[sid] = time.monotonic()
        plain = [s for s in self.sessions.values() if s.job is job and s.worker is None]
        if len(plain) > self.config.max_sessions_per_job:
            oldest = min(plain, key=lambda s: s.created)
            self._end_session(oldest.id, "evicted: too many sessions")
        return sid

    def _known_session(self, sid: bytes) -> Session:
        s = self.sessions.get(sid)
        if s is None:
            raise SessionExpiredError(
                "unknown or expired session (its lease ended, the job was dropped, or the server restarted): "
                "attach to the job again"
            )
        return s

    def _authenticate(self, msg: m.SessionMessage) -> None:
        """Check a signed request's mac, then its seq (a forged message must not use up seqs)."""
        s = self._known_session(msg.session)
        if not msg.mac:
            raise AuthError(f"{m.op_of(type(msg))!r} is not signed: protocol {PROTOCOL_VERSION} needs 'seq' and 'mac'")
        if not mac_matches(s.key, msg):
            raise AuthError(
                f"bad mac on {m.op_of(type(msg))!r}: not signed with this session's key (altered on the way, "
                "or signed for another session)"
            )
        s.replay.check(msg.seq)

    def _session(self, sid: bytes) -> Session:
        """The job session ``sid`` (admin sessions have no job)."""
        s = self._known_session(sid)
        if s.job is None:
            raise StateError("an admin session has no job: attach to the job to use it")
        return s

    def _job_of(self, s: Session, name: str | None, what: str) -> Job:
        """The job an admin-guarded op (``drop_job``, ``save``) acts on, by the rule of
        ``protocol/README.md``: an admin session names any job; a job session acts only on its own,
        and only where the server has no admin secret (or, for ``drop_job``, while its job is still
        being created, so a failed creation can clean up after itself)."""
        job = self._named_job(s, name, what)
        if s.job is None:
            return job
        creating = what == "drop" and not job.ready
        if self._admin_key is not None and not creating:
            raise AuthError(
                f"this server has an admin secret: to {what} job {job.name!r} attach with the admin secret "
                "(admin_attach; Client(admin_secret=...) or --admin-secret-file)"
            )
        return job

    def _end_session(self, sid: bytes, reason: str) -> None:
        s = self.sessions.pop(sid, None)
        self._last_seen.pop(sid, None)
        if s is not None and s.worker is not None:
            for out in s.job.remove_worker(s.worker, self._submit, reason):
                self._send(out)
            self._maybe_snapshot(s.job)

    def _expire_leases(self, now: float) -> None:
        lease = self.config.lease_s
        for sid, s in list(self.sessions.items()):
            if s.worker is not None and now - self._last_seen.get(sid, now) > lease:
                self._end_session(sid, f"silent for more than its {lease:g} s lease")
        limit = self.config.creation_timeout_s
        for job in [j for j in self.jobs.values() if not j.sealed and now - j.last_activity > limit]:
            self._drop(job, f"dropped: still unsealed after {limit:g} s without a new stage")

    # ---- handlers --------------------------------------------------------------------------------
    def _on_hello(self, identity: bytes, msg: m.Message, _data: list[zmq.Frame]) -> Outgoing:
        return Outgoing(identity, m.Challenge(id=msg.id, nonce=self._nonces.issue()))

    def _on_create_job(self, identity: bytes, msg: m.Message, _data: list[zmq.Frame]) -> Outgoing:
        assert isinstance(msg, m.CreateJob)
        self._nonces.take(msg.nonce)
        if msg.name in self.jobs:
            raise JobExistsError(f"a job named {msg.name!r} already exists on this server")
        base = self._base_for(msg)
        try:
            job = Job.create(msg, self.memory)
        except SegmentSpaceError as exc:
            raise MemoryLimitError(str(exc)) from None
        job.base = base
        self.jobs[msg.name] = job
        log.info("job %r created; waiting for its stages", msg.name)
        sid = self._new_session(job, job.session_key(msg.nonce, msg.client_nonce))
        return Outgoing(identity, job.attached_reply(sid, self.config.lease_s, msg.id))

    def _base_for(self, msg: m.CreateJob) -> Job | None:
        """The frozen job a new job trains on top of, once its ``base_proof`` is checked."""
        if msg.base is None:
            return None
        if msg.frozen:
            raise StateError("a frozen job cannot have a base itself (bases do not stack)")
        base = self.jobs.get(msg.base)
        if base is None:
            raise UnknownJobError(f"no job named {msg.base!r} on this server (the base of {msg.name!r})")
        if not base.frozen or not base.ready:
            raise StateError(f"job {msg.base!r} is not a frozen, ready base (create it with frozen=True)")
        base.check_base_proof(msg.nonce, msg.client_nonce, msg.base_proof)
        if msg.dtype != base.dtype:
            raise LayoutError(
                f"job {msg.name!r} computes in {msg.dtype}; its base {msg.base!r} in {base.dtype}: "
                "create both with the same dtype"
            )
        return base

    def _on_attach(self, identity: bytes, msg: m.Message, _data: list[zmq.Frame]) -> Outgoing:
        assert isinstance(msg, m.Attach)
        self._nonces.take(msg.nonce)  # consumed whatever follows: one guess per nonce
        job = self.jobs.get(msg.name)
        if job is None:
            raise UnknownJobError(f"no job named {msg.name!r} on this server")
        job.check_proof(msg.nonce, msg.client_nonce, msg.proof)
        sid = self._new_session(job, job.session_key(msg.nonce, msg.client_nonce))
        return Outgoing(identity, job.attached_reply(sid, self.config.lease_s, msg.id))

    def _on_admin_attach(self, identity: bytes, msg: m.Message, _data: list[zmq.Frame]) -> Outgoing:
        assert isinstance(msg, m.AdminAttach)
        self._nonces.take(msg.nonce)
        if self._admin_key is None:
            raise AuthError("this server has no admin secret (start it with --admin-secret-file FILE)")
        if not hmac.compare_digest(msg.proof, admin_proof(self._admin_key, msg.nonce, msg.client_nonce)):
            raise AuthError("wrong admin secret: the admin_attach proof does not match")
        sid = self._new_session(None, session_key(self._admin_key, msg.nonce, msg.client_nonce))
        log.info("admin session opened")
        return Outgoing(identity, m.AdminAttached(id=msg.id, session=sid))

    def _on_shutdown(self, identity: bytes, msg: m.Message, _data: list[zmq.Frame]) -> Outgoing:
        assert isinstance(msg, m.Shutdown)
        if not self._known_session(msg.session).admin:
            raise AuthError("shutdown needs an admin session (attach with the server's admin secret)")
        log.info("shutdown requested by an admin session")
        self._shutdown_requested = True
        self.stop()
        return Outgoing(identity, m.Ok(id=msg.id))

    def _on_add_stage(self, identity: bytes, msg: m.Message, data: list[zmq.Frame]) -> Outgoing:
        assert isinstance(msg, m.AddStage)
        job = self._session(msg.session).job
        try:
            job.add_stage(msg, data)
        except SegmentSpaceError as exc:
            raise MemoryLimitError(str(exc)) from None
        return Outgoing(identity, m.Ok(id=msg.id))

    def _on_seal(self, identity: bytes, msg: m.Message, _data: list[zmq.Frame]) -> Outgoing | None:
        assert isinstance(msg, m.Seal)
        job = self._session(msg.session).job
        job.seal()
        log.info(
            "job %r sealed: %d stages, %d bytes reserved (%d bytes free)",
            job.name,
            len(job.stages),
            job.reserved,
            self.memory.free,
        )
        if self.store is not None:  # answered once the job is durable: a crash cannot lose it after
            reply = job.attached_reply(msg.session, self.config.lease_s, msg.id)
            self._save_waiters.setdefault(job.name, []).append(Waiter(identity, msg.id, lambda *_: reply))
            self._maybe_snapshot(job, reason="creation")
            return None
        return Outgoing(identity, job.attached_reply(msg.session, self.config.lease_s, msg.id))

    def _on_join(self, identity: bytes, msg: m.Message, _data: list[zmq.Frame]) -> Outgoing:
        assert isinstance(msg, m.Join)
        s = self._session(msg.session)
        try:
            w = s.job.join(s.id, msg)
        except SegmentSpaceError as exc:
            raise MemoryLimitError(str(exc)) from None
        s.worker = w.id
        s.job.open_barrier(self._submit)
        reply = m.Joined(
            id=msg.id,
            worker=w.id,
            step=w.first_step,
            grad_path=w.grad_path,
            grad_slot_bytes=w.slot_bytes,
            grad_slots=len(w.slots),
        )
        return Outgoing(identity, reply)

    def _worker_session(self, sid: bytes) -> tuple[Session, Job]:
        s = self._session(sid)
        return s, s.job

    def _on_fetch(self, identity: bytes, msg: m.Message, _data: list[zmq.Frame]) -> Outgoing | None:
        assert isinstance(msg, m.Fetch)
        s, job = self._worker_session(msg.session)
        worker = job.worker_of(s.id)
        return job.fetch(msg, identity, worker)

    def _on_push(self, identity: bytes, msg: m.Message, data: list[zmq.Frame]) -> None:
        assert isinstance(msg, m.Push)
        s, job = self._worker_session(msg.session)
        job.push(msg, data, identity, job.worker_of(s.id), self._submit)
        return None

    def _on_pull(self, identity: bytes, msg: m.Message, _data: list[zmq.Frame]) -> Outgoing | None:
        assert isinstance(msg, m.Pull)
        return self._readable_job(msg.session, msg.job).pull(msg, identity)

    def _on_describe(self, identity: bytes, msg: m.Message, _data: list[zmq.Frame]) -> Outgoing:
        assert isinstance(msg, m.Describe)
        job = self._readable_job(msg.session, msg.job)
        return Outgoing(identity, m.Layout(id=msg.id, job=job.name, stages=[s.spec for s in job.stages], step=job.step))

    def _named_job(self, s: Session, name: str | None, what: str) -> Job:
        """The job ``name`` of an op an admin session may aim at any job (it must name one), and a
        job session only at its own (``name`` None or its job's)."""
        if s.job is None:
            if name is None:
                raise StateError(f"{what} with an admin session: name the job ('job' field)")
            job = self.jobs.get(name)
            if job is None:
                raise UnknownJobError(f"no job named {name!r} on this server")
            return job
        if name is not None and name != s.job.name:
            raise AuthError(f"a session of job {s.job.name!r} cannot {what} job {name!r}: use an admin session")
        return s.job

    def _readable_job(self, sid: bytes, name: str | None) -> Job:
        """The job whose weights a session may read (``pull``, ``describe``): its own, or any named
        one for an admin session; reading needs no admin secret beyond that."""
        return self._named_job(self._known_session(sid), name, "read")

    def _on_heartbeat(self, identity: bytes, msg: m.Message, _data: list[zmq.Frame]) -> Outgoing:
        assert isinstance(msg, m.Heartbeat)
        self._session(msg.session)
        return Outgoing(identity, m.Ok(id=msg.id))

    def _on_leave(self, identity: bytes, msg: m.Message, _data: list[zmq.Frame]) -> Outgoing:
        assert isinstance(msg, m.Leave)
        self._session(msg.session)
        self._end_session(msg.session, "left")
        return Outgoing(identity, m.Ok(id=msg.id))

    def _on_drop_job(self, identity: bytes, msg: m.Message, _data: list[zmq.Frame]) -> Outgoing:
        assert isinstance(msg, m.DropJob)
        job = self._job_of(self._known_session(msg.session), msg.job, "drop")
        users = sorted(j.name for j in self.jobs.values() if j.base is job)
        if users:
            raise StateError(f"job {job.name!r} is the base of {users}: drop those first")
        self._drop(job, "dropped")
        return Outgoing(identity, m.Ok(id=msg.id))

    def _drop(self, job: Job, reason: str) -> None:
        """Remove ``job``: its sessions, snapshots and memory; requests waiting on it get errors."""
        for sid in [sid for sid, s in self.sessions.items() if s.job is job]:
            self.sessions.pop(sid, None)
            self._last_seen.pop(sid, None)
        del self.jobs[job.name]
        if job.snapshot is not None:
            job.snapshot.cancel()
        gone = UnknownJobError(f"job {job.name!r} was {reason}")
        for w in self._save_waiters.pop(job.name, []):
            self._error(w.identity, w.request_id, gone)
        job.refuse_waiters(lambda identity, request_id: self._error(identity, request_id, gone))
        if self.store is not None:  # after any write in progress: the writer runs one task at a time
            self._writer.submit(self.store.delete_job, job.name)
        job.close()
        log.info("job %r %s; %d bytes free", job.name, reason, self.memory.free)

    def _on_timeline(self, identity: bytes, msg: m.Message, _data: list[zmq.Frame]) -> Outgoing:
        assert isinstance(msg, m.Timeline)
        job = self._session(msg.session).job
        if job is None:
            raise StateError("timeline needs a job's session, not an admin session")
        events = job.timeline_since(msg.since_ns)
        reply = m.TimelineReply(id=msg.id, now_ns=time.monotonic_ns(), events=events, dropped=job.timeline_dropped)
        return Outgoing(identity, reply)

    def _on_status(self, identity: bytes, msg: m.Message, _data: list[zmq.Frame]) -> Outgoing:
        reply = m.StatusReply(
            id=msg.id,
            protocol=PROTOCOL_VERSION,
            pid=os.getpid(),
            uptime_s=time.monotonic() - self.started,
            memory_limit=self.memory.limit,
            memory_used=self.memory.used,
            jobs=[j.info() for j in self.jobs.values()],
        )
        return Outgoing(identity, reply)

    def _on_save(self, identity: bytes, msg: m.Message, _data: list[zmq.Frame]) -> Outgoing | None:
        assert isinstance(msg, m.Save)
        job = self._job_of(self._known_session(msg.session), msg.job, "save")
        if self.store is None:
            raise StateError("this server has no store: start it with --store DIR to save snapshots")
        if not job.ready:
            raise NotReadyError(f"job {job.name!r} is still uploading its weights")
        reply = functools.partial(_saved, msg.id)
        self._save_waiters.setdefault(job.name, []).append(Waiter(identity, msg.id, reply))
        self._maybe_snapshot(job, reason="save request")
        return None

    # ---- snapshots (NOTE [Consistent snapshots while training goes on] in snapshot.py) ---------
    def _restore_jobs(self) -> None:
        """Resume every job of the store from its newest intact snapshot."""
        if self.store is None:
            return
        self.store.remove_partial()
        on_a_base: list[str] = []
        for name in self.store.jobs():  # bases and plain jobs first, jobs on a base after them
            self._restore_job(name, on_a_base)
        for name in on_a_base:
            self._restore_job(name, None)

    def _restore_job(self, name: str, defer: list[str] | None) -> None:
        """Resume job ``name`` from its newest intact snapshot; a job on top of a base is only
        noted in ``defer`` when that is given (its base may not be resumed yet)."""
        assert self.store is not None
        t0 = time.perf_counter()
        try:
            step, record, stages, path = self.store.load_latest(name)
            if record.base is not None and defer is not None:
                defer.append(name)
                return
            base = self.jobs.get(record.base) if record.base is not None else None
            if record.base is not None and base is None:
                raise UnknownJobError(f"its base {record.base!r} was not resumed")
            job = Job.restore(record, step, stages, self.memory, base=base)
        except (SnapshotError, WstreamError) as exc:
            log.error("job %r not resumed: %s (its files are left in place)", name, exc)
            return
        self.jobs[name] = job
        log.info(
            "job %r resumed at step %d from %s (%d stages, %.2f s)",
            name, step, path, len(job.stages), time.perf_counter() - t0,
        )

    def _maybe_snapshot(self, job: Job, reason: str | None = None) -> None:
        """Start a snapshot of ``job`` if one is due and the job is at a consistent step."""
        if self.store is None or job.snapshot is not None or self.jobs.get(job.name) is not job:
            return
        step = job.consistent_step()
        if step is None:
            return
        waiters = self._save_waiters.pop(job.name, [])
        if step == job.last_snapshot_step:
            path = str(self.store.snapshots(job.name)[0])
            for w in waiters:  # nothing changed since: that snapshot is it
                self._send(Outgoing(w.identity, w.reply(step, path)))
            return
        every = self.config.snapshot_every
        if reason is None and waiters:
            reason = "save request"
        last = job.last_snapshot_step if job.last_snapshot_step is not None else -every
        if reason is None and every and step >= last + every:
            reason = f"every {every} steps"  # also when the step it was due at came during a write
        if reason is None:
            return
        snap = Snapshot(job.record(), step, self.config.snapshot_buffer, reason, waiters=waiters)
        job.snapshot = snap
        self._writer.submit(self._write_snapshot, job, snap)

    def _write_snapshot(self, job: Job, snap: Snapshot) -> None:
        """On the writer thread; the result goes back to the loop."""
        assert self.store is not None
        path: str | None = None
        error: BaseException | None = None
        try:
            written = self.store.write(snap, job.snapshot_sources())
            path = str(written) if written is not None else None
        except BaseException as exc:  # reported on the loop thread
            error = exc
        self._snap_done.put((job, snap, path, error))
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def _snapshot_finished(self, job: Job, snap: Snapshot, path: str | None, error: BaseException | None) -> None:
        if job.snapshot is snap:
            job.snapshot = None
        seconds = time.monotonic() - snap.started
        if error is not None:
            job.counters.snapshot_failures += 1
            log.error("snapshot of job %r at step %d failed: %r", job.name, snap.step, error)
            for w in snap.waiters:
                self._error(w.identity, w.request_id, InternalError(f"snapshot failed: {error}"))
        elif path is not None:
            job.last_snapshot_step = snap.step
            job.counters.snapshots.observe(seconds)
            job.counters.snapshot_bytes += snap.bytes_written
            log.info(
                "job %r: snapshot of step %d (%s) written to %s: %d bytes in %.2f s",
                job.name, snap.step, snap.reason, path, snap.bytes_written, seconds,
            )
            for w in snap.waiters:
                self._send(Outgoing(w.identity, w.reply(snap.step, path)))
        if self.jobs.get(job.name) is job:
            self._maybe_snapshot(job)

    def _final_snapshots(self) -> None:
        """At shutdown, snapshot every job whose consistent state is newer than its last snapshot
        (a job stopped in the middle of a step resumes from its last snapshot instead)."""
        while True:  # the completions of writes that finished during shutdown
            try:
                job, snap, path, error = self._snap_done.get_nowait()
            except queue.Empty:
                break
            if path is not None and error is None:
                job.last_snapshot_step = snap.step
        if self.store is None:
            return
        for job in self.jobs.values():
            job.snapshot = None
            step = job.consistent_step()
            if step is None or step == job.last_snapshot_step:
                if step is None:
                    log.warning("job %r is in the middle of a step: it will resume from its last snapshot", job.name)
                continue
            snap = Snapshot(job.record(), step, self.config.snapshot_buffer, "shutdown")
            try:
                path = self.store.write(snap, job.snapshot_sources())
                job.last_snapshot_step = step
                log.info("job %r: snapshot of step %d written at shutdown to %s", job.name, step, path)
            except OSError as exc:
                log.error("job %r: the shutdown snapshot failed: %s", job.name, exc)


def _loopback(endpoint: str) -> bool:
    """Whether a tcp endpoint listens on the loopback interface only."""
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")


def _saved(request_id: int, step: int, path: str) -> m.Message:
    return m.Saved(id=request_id, step=step, path=path)


def _warm_up_optimizer() -> None:
    """Build and step one tiny fused AdamW, so the first job's stages do not wait for the imports."""
    w = torch.zeros(16)
    w.grad = torch.zeros(16)
    torch.optim.AdamW([w], fused=True).step()
