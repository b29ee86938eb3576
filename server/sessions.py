"""Sessions: who may send signed requests, for which job, and until when.

A session is opened by ``create_job``, ``attach`` or ``admin_attach`` (each consuming a nonce of
:class:`~wstream.server.auth.NonceStore`), signs every request with its key, and has a
:class:`~wstream.server.auth.ReplayWindow`. A worker's session ends when its lease runs out; the
table says which have, and the handlers detach the worker (:mod:`wstream.server.handlers`).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

from wstream.protocol import PROTOCOL_VERSION, AuthError, SessionExpiredError, StateError
from wstream.protocol import messages as m
from wstream.protocol.auth import mac_matches, secret_key, verifier

from .auth import NonceStore, ReplayWindow
from .config import ServerConfig, read_admin_secret
from .job import Job
from .job_key import Verifier


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


class SessionTable:
    """Every open session by id, when each was last heard of, the nonces issued, the admin secret's
    verifier."""

    def __init__(self, config: ServerConfig) -> None:
        self.max_per_job = config.max_sessions_per_job
        self.all: dict[bytes, Session] = {}
        self._last_seen: dict[bytes, float] = {}
        self.nonces = NonceStore(config.nonce_ttl_s, config.max_pending_nonces)
        self.admin = (  # the admin secret's verifier (NOTE [Signed requests] in protocol/auth.py)
            Verifier(verifier(secret_key(read_admin_secret(config.admin_secret_file))))
            if config.admin_secret_file is not None
            else None
        )

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self.all.values()))

    def open(self, job: Job | None, key: bytes) -> bytes:
        """A session of ``job`` (None: an admin session) whose requests are signed with ``key``; the
        session of the job that is not a worker's and was heard of longest ago is closed when there
        are too many (not the oldest made: a handle in use all along must outlive idle ones)."""
        sid = secrets.token_bytes(16)
        self.all[sid] = Session(sid, job, key)
        self._last_seen[sid] = time.monotonic()
        plain = [s for s in self.all.values() if s.job is job and s.worker is None]
        if len(plain) > self.max_per_job:
            self.end(min(plain, key=lambda s: self._last_seen[s.id]).id)  # evicted: too many sessions
        return sid

    def known(self, sid: bytes) -> Session:
        s = self.all.get(sid)
        if s is None:
            raise SessionExpiredError(
                "unknown or expired session (its lease ended, the job was dropped, or the server restarted): "
                "attach to the job again"
            )
        return s

    def job_session(self, sid: bytes) -> tuple[Session, Job]:
        """The job session ``sid`` and its job (admin sessions have none)."""
        s = self.known(sid)
        if s.job is None:
            raise StateError("an admin session has no job: attach to the job to use it")
        return s, s.job

    def authenticate(self, msg: m.SessionMessage) -> None:
        """Check a signed request's mac, then its seq (a forged message must not use up seqs); the
        session was heard of now."""
        s = self.known(msg.session)
        if not msg.mac:
            raise AuthError(f"{m.op_of(type(msg))!r} is not signed: protocol {PROTOCOL_VERSION} needs 'seq' and 'mac'")
        if not mac_matches(s.key, msg):
            raise AuthError(
                f"bad mac on {m.op_of(type(msg))!r}: not signed with this session's key (altered on the way, "
                "or signed for another session)"
            )
        s.replay.check(msg.seq)
        now = self._last_seen[msg.session] = time.monotonic()
        if s.worker is not None and s.job is not None and s.worker in s.job.worker_table.all:
            s.job.worker_table.all[s.worker].last_seen = now  # status's idle_s

    def end(self, sid: bytes) -> Session | None:
        """Forget session ``sid``; returns it (if it was open) so its worker can be detached."""
        self._last_seen.pop(sid, None)
        return self.all.pop(sid, None)

    def end_all_of(self, job: Job) -> None:
        for sid in [sid for sid, s in self.all.items() if s.job is job]:
            self.end(sid)

    def silent_workers(self, now: float, lease_s: float) -> list[bytes]:
        """The worker sessions not heard of for more than ``lease_s`` seconds."""
        return [
            sid for sid, s in self.all.items() if s.worker is not None and now - self._last_seen.get(sid, now) > lease_s
        ]
