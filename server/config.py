"""Server configuration: one dataclass, validated on construction; the CLI maps onto it."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field

import psutil

from wstream.protocol.curve import curve_available, load_secret_certificate, public_keys_in, uses_curve


def default_memory_limit() -> int:
    """80% of physical memory: room for the OS and the workers on the same host."""
    return int(psutil.virtual_memory().total * 0.8)


@dataclass(kw_only=True, slots=True)
class ServerConfig:
    bind: list[str] = field(default_factory=lambda: ["tcp://127.0.0.1:5555"])
    """ZeroMQ endpoints to listen on (``tcp://host:port``, ``ipc:///path``); at least one."""

    memory_limit: int = field(default_factory=default_memory_limit)
    """Bytes all jobs together may hold (weights, optimizer state, gradient rings)."""

    store: str | None = None
    """Directory for snapshots and exports; created if missing. None: nothing is written to disk."""

    snapshot_every: int = 0
    """With a store: snapshot every job each time its step is a multiple of this (0: only at
    creation, on ``wstream save`` and at shutdown)."""

    keep_snapshots: int = 3
    """Snapshots kept per job (newest first); older ones are deleted after a new one is durable."""

    snapshot_buffer: int = 512 * 2**20
    """Bytes of stage copies a snapshot may hold while the disk catches up with training."""

    lease_s: float = 30.0
    """A worker silent for longer than this is detached and its unfinished step discarded."""

    creation_timeout_s: float = 300.0
    """A job still being created (not sealed) that gets no stage for this long is dropped, so
    abandoned creations cannot hold memory forever."""

    optimizer_workers: int = 1
    """Threads that run stage updates. Each update already uses all torch intra-op threads, and the
    update is memory-bound, so one is right unless many jobs update at once."""

    torch_threads: int | None = None
    """torch intra-op threads for updates; None keeps torch's default (the number of cores)."""

    metrics_port: int | None = None
    """Serve Prometheus metrics at ``http://metrics_addr:PORT/metrics`` (0: any free port, logged).
    None: no metrics endpoint."""

    metrics_addr: str = "127.0.0.1"
    """Address the metrics endpoint listens on. The endpoint has no authentication and names the
    jobs: widen it (``0.0.0.0``) only where the network is trusted."""

    metrics_stage_limit: int = 256
    """Jobs with at most this many stages also export per-stage optimizer series (labels job and
    stage); deeper jobs only per-job ones, so a 10,000-stage model does not make 20,000 series."""

    max_sessions_per_job: int = 1024
    """Non-worker sessions beyond this are evicted oldest first (bounds memory per job); admin
    sessions are bounded by the same number."""

    admin_secret_file: str | None = None
    """File holding the admin secret (one line). With it, deleting or saving a ready job needs an
    admin session (``admin_attach``), and ``shutdown`` is possible; without it, a job's own session
    may drop or save its job and nobody can shut the server down over the wire. The file must not
    be readable by group or others."""

    nonce_ttl_s: float = 30.0
    """Seconds a ``hello`` nonce stays usable."""

    max_pending_nonces: int = 4096
    """Outstanding nonces kept at most; beyond this the oldest are dropped (a flood of ``hello``
    cannot grow memory)."""

    curve_secret_key_file: str | None = None
    """The server's secret CURVE certificate (``NAME.key_secret``, as ``wstream keys`` or
    ``zmq.auth.create_certificates`` write it). With it every non-ipc endpoint (``tcp://``) is
    encrypted and clients need the matching public key (``NAME.key``); ``ipc://`` endpoints stay
    plaintext, protected by the socket file's permissions (NOTE [Which endpoints are encrypted] in
    ``wstream.protocol.curve``). The file must not be readable by group or others."""

    curve_authorized_keys_dir: str | None = None
    """Directory of client public certificates (``*.key``), read at start. With it only those
    clients may connect over CURVE; without it any client that has the server's public key may
    (encryption only: jobs still authenticate by HMAC). Needs ``curve_secret_key_file``."""

    huge_pages: str = "auto"
    """Shared memory on huge pages (a hugetlbfs mount such as /dev/hugepages), which GPU workers
    page-lock many times faster: ``auto`` for segments of at least 256 MiB that fit in the free
    huge pages (else /dev/shm, logged), ``on`` for every segment (refused when they run out; the
    server does not start without a mount), ``off`` never. NOTE [Huge pages] in protocol/shm.py."""

    def __post_init__(self) -> None:
        if self.huge_pages not in ("auto", "on", "off"):
            raise ValueError(f"ServerConfig.huge_pages must be auto, on or off, got {self.huge_pages!r}")
        if not self.bind:
            raise ValueError("ServerConfig.bind: give at least one endpoint to listen on")
        for addr in self.bind:
            if "://" not in addr:
                raise ValueError(f"ServerConfig.bind: {addr!r} is not a ZeroMQ endpoint like tcp://127.0.0.1:5555")
            _check_tcp_port(addr)
        if self.memory_limit <= 0:
            raise ValueError(f"ServerConfig.memory_limit must be > 0 bytes, got {self.memory_limit}")
        if not self.lease_s > 0:
            raise ValueError(f"ServerConfig.lease_s must be > 0 seconds, got {self.lease_s}")
        if not self.creation_timeout_s > 0:
            raise ValueError(f"ServerConfig.creation_timeout_s must be > 0 seconds, got {self.creation_timeout_s}")
        if self.optimizer_workers < 1:
            raise ValueError(f"ServerConfig.optimizer_workers must be >= 1, got {self.optimizer_workers}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"ServerConfig.torch_threads must be >= 1, got {self.torch_threads}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"ServerConfig.metrics_port must be a TCP port in [0, 65535], got {self.metrics_port}")
        if not self.metrics_addr:
            raise ValueError("ServerConfig.metrics_addr: give an address to listen on, e.g. 127.0.0.1")
        if self.metrics_stage_limit < 0:
            raise ValueError(f"ServerConfig.metrics_stage_limit must be >= 0, got {self.metrics_stage_limit}")
        if self.snapshot_every < 0:
            raise ValueError(f"ServerConfig.snapshot_every must be >= 0 steps, got {self.snapshot_every}")
        if self.keep_snapshots < 1:
            raise ValueError(f"ServerConfig.keep_snapshots must be >= 1, got {self.keep_snapshots}")
        if self.snapshot_every and self.store is None:
            raise ValueError("ServerConfig.snapshot_every needs a store directory to write to")
        if not self.nonce_ttl_s > 0:
            raise ValueError(f"ServerConfig.nonce_ttl_s must be > 0 seconds, got {self.nonce_ttl_s}")
        if self.max_pending_nonces < 1:
            raise ValueError(f"ServerConfig.max_pending_nonces must be >= 1, got {self.max_pending_nonces}")
        if self.admin_secret_file is not None:
            read_admin_secret(self.admin_secret_file)
        self._check_curve()
        if self.store is not None:
            os.makedirs(self.store, exist_ok=True, mode=0o700)

    def _check_curve(self) -> None:
        if self.curve_authorized_keys_dir is not None and self.curve_secret_key_file is None:
            raise ValueError(
                "ServerConfig.curve_authorized_keys_dir needs curve_secret_key_file (the server's own "
                "secret key): authorizing client keys only means something with CURVE on"
            )
        if self.curve_secret_key_file is None:
            return
        curve_available()
        load_secret_certificate(self.curve_secret_key_file, "server secret key (curve_secret_key_file)")
        if self.curve_authorized_keys_dir is not None:
            public_keys_in(self.curve_authorized_keys_dir)

    @property
    def curve_endpoints(self) -> list[str]:
        """The endpoints that CURVE encrypts (none without a server key)."""
        if self.curve_secret_key_file is None:
            return []
        return [addr for addr in self.bind if uses_curve(addr)]


def read_admin_secret(path: str) -> str:
    """The admin secret in ``path``; ValueError unless the file is private and not empty."""
    try:
        with open(path) as f:
            mode = os.fstat(f.fileno()).st_mode
            secret = f.read().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the admin secret file: {exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(
            f"the admin secret file {path} is readable or writable by group or others (mode "
            f"{stat.S_IMODE(mode):04o}); refusing to start: chmod 600 {path}"
        )
    if not secret:
        raise ValueError(f"the admin secret file {path} is empty")
    return secret


def _check_tcp_port(endpoint: str) -> None:
    """A ``tcp://`` endpoint names a port from 1 to 65535, or ``*`` (ZeroMQ picks a free one):
    ZeroMQ itself takes 99999 and listens on another port (it wraps)."""
    if not endpoint.startswith("tcp://"):
        return
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if port == "*" and sep:
        return
    if not (sep and host and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(
            f"ServerConfig.bind: {endpoint!r}: a tcp endpoint's port must be 1-65535 (or * for any free port), "
            "as in tcp://127.0.0.1:5555"
        )

