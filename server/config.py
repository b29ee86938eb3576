"""Server configuration: one dataclass, validated on construction; the CLI maps onto it.

A setting that cannot be used raises :class:`ConfigError`, which knows the setting it is about:
the Python API names it as ``ServerConfig.<field>``, ``wstream-server`` as its flag and config key
(``server/cli.py`` renders it; the messages are written once, here)."""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import math
import os
import re
import stat
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from wstream.protocol.curve import curve_available, load_secret_certificate, public_keys_in, uses_curve
from wstream.protocol.shm import SHM_DIR

from .memory import usable_memory


def default_memory_limit() -> int:
    """80% of physical memory, or of a container's memory limit where that is less (room for the OS
    and the workers on the same host), and no more than the size of /dev/shm, where the weights and
    gradient rings live: the default never draws the start-up warning of
    :func:`~wstream.server.memory.memory_limit_warnings`."""
    limit = int(usable_memory() * 0.8)
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return limit
    return min(limit, st.f_blocks * st.f_frsize) or limit


PATH_FIELDS = ("store", "admin_secret_file", "curve_secret_key_file", "curve_authorized_keys_dir")
"""Fields that name a file or directory: an ``os.PathLike`` is taken as its string."""


@functools.cache
def _field_types() -> dict[str, Any]:
    """ServerConfig's fields and their annotated types (resolved once)."""
    hints = typing.get_type_hints(ServerConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(ServerConfig)}


class ConfigError(ValueError):
    """A setting of :class:`ServerConfig` that cannot be used. ``problem`` follows the setting's
    name (a leading ``:`` or a space included) and may name other settings as ``{field}``;
    :meth:`render` writes each name as its caller names settings."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        self.problem = problem
        super().__init__(self.render(lambda k: f"ServerConfig.{k}", lambda k: k))

    def render(self, name: Callable[[str], str], mention: Callable[[str], str] | None = None) -> str:
        """The message with its setting named ``name(field)`` and the others it mentions
        ``mention(field)`` (default: as the setting)."""
        fields = ServerConfig.__dataclass_fields__
        other = name if mention is None else mention
        problem = re.sub(r"\{(\w+)\}", lambda found: other(found[1]) if found[1] in fields else found[0], self.problem)
        return f"{name(self.key)}{problem}"


LOCAL_TRANSPORTS = ("ipc://", "inproc://")


def is_loopback(endpoint: str) -> bool:
    """Whether ``endpoint`` can be reached from this host only: ipc, inproc, or tcp on a loopback
    address (127.0.0.0/8, ::1, localhost). ``*``, an interface name or another host name is not."""
    if endpoint.startswith(LOCAL_TRANSPORTS):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rpartition(":")[0].removeprefix("[").removesuffix("]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(kw_only=True, slots=True)
class ServerConfig:
    bind: list[str] = field(default_factory=lambda: ["tcp://127.0.0.1:5555"])
    """ZeroMQ endpoints to listen on (``tcp://host:port``, ``ipc:///path``); at least one."""

    memory_limit: int = field(default_factory=default_memory_limit)
    """Bytes all jobs together may hold (weights, optimizer state, gradient rings)."""

    store: str | None = None
    """Directory for snapshots and exports; created if missing. None: nothing is written to disk."""

    snapshot_every: int = 0
    """With a store: snapshot every job once it is this many steps past its last snapshot, at
    its next consistent step (0: only at creation, on ``wstream save`` and at shutdown)."""

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
    """torch intra-op threads of the updates. None: in a ``wstream-server`` process half the cores
    (at least one), and co-located workers keep to the rest (NOTE [Threads of a co-located
    server] in ``server/threads.py``); an in-process server leaves its process's setting alone."""

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
    sessions are bounded by the same number, and so are a job's readers (a reader past it is
    refused at ``join``: a reader holds no gradient ring for the memory account to count)."""

    admin_secret_file: str | None = None
    """File holding the admin secret (one line). With it, creating a job needs the admin secret
    (``create_job`` carries a proof of it), deleting or saving a ready job needs an admin session
    (``admin_attach``), and ``shutdown`` is possible; without it, anyone who reaches the server may
    create jobs, a job's own session may drop or save its job and nobody can shut the server down
    over the wire. The file must not be readable by group or others."""

    insecure: bool = False
    """Listen on an endpoint beyond this host (tcp on anything but a loopback address) without an
    admin secret, where anyone who reaches it may create jobs until memory is full. Without it, such
    a server refuses to start (as Jupyter does): give ``admin_secret_file`` instead."""

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
        self._check_types()
        if self.huge_pages not in ("auto", "on", "off"):
            raise ConfigError("huge_pages", f" must be auto, on or off, got {self.huge_pages!r}")
        if not self.bind:
            raise ConfigError("bind", ": give at least one endpoint to listen on")
        for k, addr in enumerate(self.bind):
            if "://" not in addr:
                raise ConfigError("bind", f": {addr!r} is not a ZeroMQ endpoint like tcp://127.0.0.1:5555")
            if not addr.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError("bind", f": {addr!r}: the server listens on tcp://HOST:PORT or ipc:///PATH")
            if addr in self.bind[:k]:
                raise ConfigError("bind", f": {addr!r} is listed twice")
            _check_tcp_port(addr)
        if self.memory_limit <= 0:
            raise ConfigError("memory_limit", f" must be > 0 bytes, got {self.memory_limit}")
        _positive_seconds("lease_s", self.lease_s)
        _positive_seconds("creation_timeout_s", self.creation_timeout_s)
        _at_least("optimizer_workers", self.optimizer_workers, 1)
        if self.torch_threads is not None:
            _at_least("torch_threads", self.torch_threads, 1)
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError("metrics_port", f" must be a TCP port in [0, 65535], got {self.metrics_port}")
        if not self.metrics_addr:
            raise ConfigError("metrics_addr", ": give an address to listen on, e.g. 127.0.0.1")
        _at_least("metrics_stage_limit", self.metrics_stage_limit, 0)
        if self.snapshot_every < 0:
            raise ConfigError("snapshot_every", f" must be >= 0 steps, got {self.snapshot_every}")
        _at_least("keep_snapshots", self.keep_snapshots, 1)
        _at_least("snapshot_buffer", self.snapshot_buffer, 0)
        if self.store is not None:
            if not self.store.strip():
                raise ConfigError("store", ": is empty; give a directory (or leave it out: no snapshots)")
            self.store = os.path.abspath(self.store)  # paths the server reports mean something to whoever reads them
        if self.snapshot_every and self.store is None:
            raise ConfigError("snapshot_every", " needs a store to write to: give {store} (a directory)")
        _positive_seconds("nonce_ttl_s", self.nonce_ttl_s)
        _at_least("max_pending_nonces", self.max_pending_nonces, 1)
        _at_least("max_sessions_per_job", self.max_sessions_per_job, 1)
        if self.admin_secret_file is not None:
            try:
                read_admin_secret(self.admin_secret_file)
            except ValueError as exc:
                raise ConfigError("admin_secret_file", f": {exc}") from None
        self._check_open()
        self._check_curve()

    def _check_types(self) -> None:
        """Each field of its annotated type (the Python API's values are not a flag's or a file's,
        which are read by type already); a path may be given as a ``Path``."""
        for name, hint in _field_types().items():
            value = getattr(self, name)
            if name in PATH_FIELDS and isinstance(value, os.PathLike):
                value = os.fspath(value)
                setattr(self, name, value)
            try:
                msgspec.convert(value, hint)
            except msgspec.ValidationError as exc:
                raise ConfigError(name, f": {exc} (got {value!r})") from None

    def _check_open(self) -> None:
        """Refuse to listen beyond this host without an admin secret, unless told to."""
        if self.admin_secret_file is not None or self.insecure:
            return
        for addr in self.bind:
            if not is_loopback(addr):
                raise ConfigError(
                    "bind",
                    f": {addr} is not a loopback address, and without an admin secret anyone who reaches it "
                    "may create jobs until the server's memory is full. Give {admin_secret_file} (a file, "
                    "mode 0600, holding the secret; clients then need it to create jobs), or {insecure} to "
                    "listen open anyway",
                )

    def _check_curve(self) -> None:
        if self.curve_authorized_keys_dir is not None and self.curve_secret_key_file is None:
            raise ConfigError(
                "curve_authorized_keys_dir",
                " needs {curve_secret_key_file} (the server's own secret key): authorizing client keys only "
                "means something with CURVE on",
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
        raise ConfigError(
            "bind",
            f": {endpoint!r}: a tcp endpoint's port must be 1-65535 (or * for any free port), as in tcp://127.0.0.1:5555",
        )


def _positive_seconds(key: str, value: float) -> None:
    if not 0 < value < math.inf:  # inf too: a worker heartbeats every lease/3, and waits cannot be that long
        raise ConfigError(key, f" must be a finite number > 0 of seconds, got {value:g}")


def _at_least(key: str, value: int, least: int) -> None:
    if value < least:
        raise ConfigError(key, f" must be >= {least}, got {value}")

