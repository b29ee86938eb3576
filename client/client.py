"""The public client: connect to a server, create or attach jobs (a :class:`~wstream.client.job_handle.Job`
handle each: trainers, weights). Uploading a chain is in ``creation.py``; the operations on a server
and on jobs by name (status, drop, save, export, shutdown) in ``server_ops.py``."""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import msgspec
import torch
import zmq
from torch import nn

from wstream.protocol import AuthError, JobExistsError, LayoutError, ServerUnavailable, StageSpec, WstreamError
from wstream.protocol import messages as m
from wstream.protocol.auth import SessionSigner, base_proof, create_proof, secret_key, session_key
from wstream.protocol.curve import ClientKeys, KeySource, uses_curve
from wstream.protocol.layout import describe_mismatch, without_groups

from .chain import check_before_upload, layout_on, to_skeletons, walk_chain
from .channel import Channel, Keyring, SharedChannel, Signer, attach_session, challenge, client_nonce, curve_keys
from .creation import ChainUpload, chain_numel, trained_numel, unit_size
from .endpoint import Closeable, WorkerEndpoint
from .env import check_new_token, job_token, server_address
from .groups import GroupAssigner, ParamGroup
from .job_handle import Job
from .job_options import job_options, options_difference
from .server_ops import ServerOperations
from .stages import Tied
from .units import chain_layout

log = logging.getLogger(__name__)


ENV_ADMIN_SECRET_FILE = "WSTREAM_ADMIN_SECRET_FILE"
"""A file holding the server's admin secret, for clients given none (``Client``, ``wstream``)."""


def read_secret_file(path: str | os.PathLike[str], what: str) -> str:
    """The secret in file ``path`` (its one line, stripped); ValueError naming ``what`` otherwise."""
    try:
        with open(path) as f:
            secret = f.read().strip()
    except OSError as exc:
        raise ValueError(f"cannot read {what} from {os.fspath(path)}: {exc.strerror or exc}") from None
    if not secret:
        raise ValueError(f"{what} file {os.fspath(path)} is empty")
    return secret


def admin_secret_from_env() -> str | None:
    """The admin secret in the file ``$WSTREAM_ADMIN_SECRET_FILE`` names, or None when it is unset."""
    path = os.environ.get(ENV_ADMIN_SECRET_FILE)
    return read_secret_file(path, f"the admin secret (${ENV_ADMIN_SECRET_FILE})") if path else None


class Client(ServerOperations):
    """A connection to a ``wstream-server``.

    ``address``: the server's ZeroMQ endpoint; default ``$WSTREAM_SERVER``, else
    ``tcp://127.0.0.1:5555``. The job's ``token`` of :meth:`create_job`, :meth:`attach_job` and
    the job operations likewise defaults to ``$WSTREAM_TOKEN``. An argument given wins.
    ``timeout`` bounds ordinary requests; ``wait_timeout`` bounds waits that depend on other workers
    (their gradients of a step, the weights of the next step), which can legitimately take longer;
    such a wait is logged every ``wait_report`` seconds with what the job waits for (e.g. "waiting
    for 1 of 2 workers to join"), and ends with :class:`WaitTimeoutError` naming it.
    ``admin_secret``: the server's admin secret (``--admin-secret-file``), for :meth:`create_job`
    on a server that has one (it refuses creation without), :meth:`drop_job`, :meth:`save_job` and
    :meth:`shutdown`; it is never sent, only proven. Default: the file ``$WSTREAM_ADMIN_SECRET_FILE``
    names, if set; ``False``: none, whatever the environment says.
    ``server_public_key``: for a server with CURVE encryption (``--curve-secret-key``), its public
    certificate file (``NAME.key``) or z85 public key; default ``$WSTREAM_SERVER_KEY``, else no
    encryption. ``client_secret_key``: this client's secret certificate file, for a server that
    authorizes clients by key (``--curve-authorized-keys``); default ``$WSTREAM_CLIENT_KEY``, else a
    temporary keypair. Keys apply to ``tcp://`` addresses; for ``ipc://``, which is never encrypted,
    they are not read.

    A client and its :class:`Job` handles may be used from several threads (their requests go
    one at a time); a trainer serves one thread (a second call while one runs is refused).
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        admin_secret: str | Literal[False] | None = None,
        timeout: float = 60.0,
        wait_timeout: float = 600.0,
        wait_report: float = 30.0,
        server_public_key: KeySource | None = None,
        client_secret_key: str | os.PathLike[str] | None = None,
    ) -> None:
        address = server_address(address)
        if "://" not in address:
            raise ValueError(f"{address!r} is not a ZeroMQ endpoint like tcp://127.0.0.1:5555 or ipc:///path")
        # the server reads its secret file stripped: one given with its file's newline would never match
        self._given_admin_secret = admin_secret.strip() if isinstance(admin_secret, str) else None
        # read from the environment when first needed; False: never (a token given instead wins)
        self._env_admin_secret: tuple[str | None] | None = (None,) if admin_secret is False else None
        self.address = address
        self.timeout_s = timeout
        self.wait_timeout_s = wait_timeout
        self.wait_report_s = wait_report
        self.curve: ClientKeys | None = (
            curve_keys(server_public_key, client_secret_key) if uses_curve(address) else None
        )
        """This client's CURVE keys (every socket it and its trainers open uses them), or None."""
        self.ctx: zmq.Context[Any] = zmq.Context()
        self._keys = Keyring()
        try:  # shared by this client's methods and its Job handles, from any thread
            self._chan: Channel = SharedChannel(self.ctx, address, timeout_s=timeout, signer=self._keys, curve=self.curve)
        except BaseException:  # an address ZeroMQ cannot use ("foo://x"): no context left behind
            self.ctx.term()
            raise
        self._admin: SessionSigner | None = None
        self._token_jobs: dict[tuple[str, str], Job] = {}  # (name, token) -> the handle the job operations use
        self._token_jobs_lock = threading.Lock()
        self._trainers: weakref.WeakSet[Closeable] = weakref.WeakSet()
        self._closed = False

    def _admin_secret(self) -> str | None:
        """The admin secret given, else the one ``$WSTREAM_ADMIN_SECRET_FILE`` names (read when first
        needed, so that a client that never needs it never reads it), else None."""
        if self._given_admin_secret is not None:
            return self._given_admin_secret
        if self._env_admin_secret is None:
            self._env_admin_secret = (admin_secret_from_env(),)
        return self._env_admin_secret[0]

    def channel(self, timeout_s: float | None = None, signer: Signer | None = None) -> Channel:
        """A new channel to the server (its own socket, with this client's CURVE keys), for one
        thread; ``timeout_s`` defaults to the client's ``timeout``."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        return Channel(self.ctx, self.address, timeout_s=limit, signer=signer, curve=self.curve)

    def create_job(
        self,
        name: str,
        stages: Iterable[nn.Module | Tied],
        *,
        token: str | None = None,
        options: m.JobOptions | None = None,
        base_token: str | None = None,
        exist_ok: bool = False,
        progress: bool | None = None,
        param_groups: Sequence[ParamGroup] = (),
        unit_bytes: int | str | None = "auto",
        **option_fields: Any,
    ) -> Job:
        """Create job ``name`` from ``stages``, consumed one module at a time.

        Each module is a stage: its parameters are stored on the server. A :class:`Tied` item is
        a chain position that reuses an earlier stage's parameters (a tied LM head), uploads
        nothing, and adds its gradient to that stage's. A parameter without ``requires_grad`` is
        stored, streamed and exported but never trained (no gradient, no optimizer state).

        ``param_groups``: :class:`~wstream.client.ParamGroup` items (``no_decay()`` is the GPT
        recipe's), each a set of parameters trained with a weight decay or learning-rate scale of
        its own; a parameter goes to the first group that picks it, the others keep the
        optimizer's settings. A group that gets no parameter is refused (``ValueError``, and no
        job is left on the server). Their settings go into ``JobOptions.param_groups``.

        How the job trains is a :class:`~wstream.protocol.JobOptions` (optimizer, dtype,
        double_buffer, delayed_update, delay_after, frozen, base; each field documented there):
        give ``options=JobOptions(...)``, or its fields as keywords
        (``optimizer=AdamW(lr=1e-3), dtype="bfloat16"``), not both. With ``base`` give
        ``base_token`` too (the base's token): stage i trains its parameters that have
        ``requires_grad`` and reads the others, by name, from stage i of the frozen base.

        ``unit_bytes``: coalesce runs of consecutive small stages into transfer units of at
        least this many bytes (in the compute dtype), each stored, fetched, pushed and updated by
        the server as one stage, while checkpoint plans still run over every stage (NOTE
        [Transfer units] in ``client/units.py``): for deep chains of small stages, where the cost
        per server stage dominates. ``"auto"`` (default): 1 MiB units, except that a frozen base
        (``frozen=True``) and a job on one (``base``) are never cut. None: one server stage per
        stage, which is what a program that talks the raw protocol to stage ``k`` wants. A size
        (bytes, or a string such as ``"64MiB"``) is refused with ``base``. Units change no result, only what moves per message.

        ``exist_ok=True``: when a job of this name exists (a restarted rank, a rerun script),
        attach to it instead, without uploading anything, if ``token`` opens it and its layout and
        options are the ones given here; otherwise ``LayoutError`` names the first difference.

        On a server with an admin secret, creating needs it: give the client ``admin_secret`` (or
        ``$WSTREAM_ADMIN_SECRET_FILE``), else ``AuthError``; ``exist_ok`` attaches without it.

        Each module's parameters are uploaded and the module is then moved to the meta device in
        place (its memory is freed; it stays usable as the job's skeleton), so a model larger than
        this process's memory can be created stage by stage from a generator.
        ``progress``: a progress bar of the upload on stderr (None: only when stderr is a terminal).
        ``token``: the job's secret (workers attach with it); default ``$WSTREAM_TOKEN``.
        """
        token = job_token(token)
        check_new_token(token)
        options = job_options(options, option_fields)
        groups = GroupAssigner(param_groups)
        if options.param_groups and options.param_groups != groups.specs:
            raise ValueError(
                "JobOptions.param_groups is filled in from create_job(param_groups=[ParamGroup(...)]), which also "
                "say which parameters each group takes: give those instead"
            )
        options = msgspec.structs.replace(options, param_groups=groups.specs)
        base = options.base
        if (base is None) != (base_token is None):
            raise ValueError("base= and base_token= go together")
        unit_size_ = unit_size(unit_bytes, options)
        published = getattr(torch, options.dtype)  # what workers read the weights and buffers in
        total = trained = None
        if isinstance(stages, Sequence):  # known up front: check it, and let the server refuse, before uploading
            check_before_upload(stages, groups, on_base=base is not None, published=published)
            total, trained = chain_numel(stages, on_base=base is not None), trained_numel(stages)
        nonce, mine = challenge(self._chan), client_nonce()
        proof = base_proof(secret_key(base_token), base, nonce, mine) if base and base_token else None
        secret = self._admin_secret()
        admin = None if secret is None else create_proof(secret_key(secret), name, nonce, mine)
        request = m.CreateJob(
            name=name, token=token, nonce=nonce, client_nonce=mine, options=options, total_numel=total, trained_numel=trained,
            base_proof=proof, admin_proof=admin,
        )
        try:
            created, _ = self._chan.request(request, m.Attached)
        except JobExistsError as exc:
            if exc.being_created:  # nothing to attach to yet, with exist_ok or without
                raise
            if not exist_ok:
                exc.add_note("create_job(..., exist_ok=True) attaches to it when it is this job; attach_job(name) attaches")
                raise
            return self._attach_same(name, stages, token, options, param_groups)
        signer = SessionSigner(created.session, session_key(secret_key(token), nonce, mine))
        self._keys.add(signer)
        upload = ChainUpload(
            self._chan, name, created, groups=groups, published=published, unit_bytes=unit_size_, total=total, progress=progress
        )
        sealed, chain = upload.run(stages, self.wait_timeout_s)
        return Job(self, sealed, token, chain, signer)

    def _attach_same(
        self,
        name: str,
        stages: Iterable[nn.Module | Tied],
        token: str,
        options: m.JobOptions,
        param_groups: Sequence[ParamGroup],
    ) -> Job:
        """``create_job(exist_ok=True)`` found the job: attach if it is the job asked for."""
        job = self.attach_job(name, token=token, stages=stages, param_groups=param_groups, expect_options=options)
        log.info("job %r exists with this layout and these options: attached to it", name)
        return job

    def attach_job(
        self,
        name: str,
        *,
        token: str | None = None,
        stages: Iterable[nn.Module | Tied] | None = None,
        param_groups: Sequence[ParamGroup] | None = None,
        expect_options: m.JobOptions | None = None,
    ) -> Job:
        """Attach to an existing job. ``stages`` (modules, best built on the meta device, and the
        same :class:`Tied` positions the creator gave) are needed to train; they must have the
        job's layout exactly (names, shapes, and which parameters are frozen).

        A worker trains with the job's parameter groups whatever it is given, so
        ``param_groups`` is optional: without it the layouts are compared ignoring the groups;
        with it (the creator's list) the groups' settings and each parameter's group must be the
        job's too. ``token``: default ``$WSTREAM_TOKEN``. ``expect_options``: the options the job
        must have (``create_job(exist_ok=True)``). A refusal leaves ``stages`` as they were: they
        are moved to the meta device only once they match."""
        token = job_token(token)
        try:
            attached, signer = attach_session(self._chan, name, token)
        except AuthError as exc:
            if token != token.strip():
                exc.add_note("the token given has whitespace around it (a newline read from a file?)")
            raise
        self._keys.add(signer)
        groups = None if param_groups is None else GroupAssigner(param_groups)
        if groups is not None and groups.specs != attached.options.param_groups:
            raise LayoutError(
                f"the given param_groups are not job {name!r}'s: it has {attached.options.param_groups}, "
                f"given {groups.specs}"
            )
        if expect_options is not None:  # create_job(exist_ok=True): before the stages are touched
            difference = options_difference(attached.options, expect_options)
            if difference is not None:
                raise LayoutError(f"job {name!r} exists with other options: {difference}")
        chain = None
        if stages is not None:
            on_base = attached.options.base is not None
            base_stages = list(attached.base_stages) if on_base else None
            # compared before any module is moved to the meta device: a refusal leaves the caller's model as it was
            specs, chain = walk_chain(stages, lambda i, mod: layout_on(base_stages, i, mod, groups), base_stages, skeletons=False)
            theirs = chain_layout(attached.stages, attached.options.units)  # with units: stage by stage
            theirs = theirs if groups is not None else [without_groups(s) for s in theirs]
            mismatch = describe_mismatch(theirs, specs)
            if mismatch is not None:
                raise LayoutError(f"the given stages do not match job {name!r}: {mismatch}")
            chain = to_skeletons(chain)
        return Job(self, attached, token, chain, signer)

    def worker_endpoint(
        self, *, job: str, token: str, stages: tuple[StageSpec, ...], units: tuple[int, ...] | None,
        base_stages: tuple[StageSpec, ...],
    ) -> WorkerEndpoint:
        """How a trainer of ``job`` reaches it: this client's context, address, keys and bounds;
        the trainer registers with this client, which closes it when it closes."""
        return WorkerEndpoint(
            ctx=self.ctx, address=self.address, curve=self.curve, timeout_s=self.timeout_s,
            wait_timeout_s=self.wait_timeout_s, wait_report_s=self.wait_report_s, job=job, token=token,
            stages=stages, units=units, base_stages=base_stages,
            register=self._trainers.add, unregister=self._trainers.discard,
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            for trainer in list(self._trainers):
                trainer.close()
        finally:
            self._chan.close("this Client is closed: make a new one")  # a thread's request in it ends now
            try:
                self._leave_sessions()
            finally:
                self.ctx.destroy(linger=0)  # closes any socket still open instead of waiting on it

    LEAVE_BUDGET_S = 0.5
    """How long a closing Client spends leaving its sessions, at most (a server that does not
    answer costs this much; one that answers, a round trip per session)."""

    def _leave_sessions(self) -> None:
        """End this client's sessions on the server (its job handles' and its admin session), which
        would otherwise stay open until evicted, counted as open in ``status`` and the metrics.
        Best effort, on a channel of its own (the shared one is closed first, so no other thread's
        request waits for this or sees its session end), within :attr:`LEAVE_BUDGET_S`: a session
        the server ended already is refused, which is fine; a server that does not answer in time
        ends the attempt."""
        sessions = self._keys.sessions()
        if not sessions:
            return
        deadline = time.monotonic() + self.LEAVE_BUDGET_S
        chan = Channel(self.ctx, self.address, timeout_s=self.LEAVE_BUDGET_S, signer=self._keys, curve=self.curve)
        try:
            for sid in sessions:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                try:
                    chan.request(m.Leave(session=sid), m.Ok, timeout_s=left)
                except ServerUnavailable:
                    return
                except WstreamError:
                    continue
        finally:
            chan.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
