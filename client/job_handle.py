"""A handle on one job of a server (:class:`Job`, made by ``Client.create_job`` and
``Client.attach_job``): trainers for it, its weights pulled or exported, its schedule, snapshots
and drop. Kept apart from :mod:`wstream.client.client`, which connects, authenticates and
creates jobs."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import msgspec
import torch
from torch import nn

from wstream.protocol import AuthError, LayoutError, StageSpec, StateError
from wstream.protocol import messages as m
from wstream.protocol.auth import SessionSigner
from wstream.protocol.frames import copy_frames_into
from wstream.protocol.layout import numel_of
from wstream.protocol.lr_schedules import Schedule

from .chain import Chain, progress_bar
from .channel import Channel
from .endpoint import WorkerEndpoint
from .groups import export_metadata
from .options import Checkpointing, Parallelism, Precision, Transport, trainer_options
from .stages import DTYPE_OF_BUFFER, StageRunner, frozen_params
from .trainer import Trainer
from .units import Units

log = logging.getLogger(__name__)


class JobClient(Protocol):
    """What a :class:`Job` needs of the ``Client`` that made it (``wstream.client.client``, which
    imports this module: a Protocol keeps the import one-way): its channel, its wait bound, and
    the endpoint its trainers connect by."""

    wait_timeout_s: float
    _chan: Channel

    def worker_endpoint(
        self, *, job: str, token: str, stages: tuple[StageSpec, ...], units: tuple[int, ...] | None,
        base_stages: tuple[StageSpec, ...],
    ) -> WorkerEndpoint: ...


class Job:
    """A handle on one job: make trainers, read its weights, drop it."""

    def __init__(
        self,
        client: JobClient,
        attached: m.Attached,
        token: str,
        chain: Chain | None,
        signer: SessionSigner,
    ) -> None:
        self.client = client
        self.name = attached.job
        self.session = attached.session
        self._signer = signer  # keeps the session's key in the client's keyring
        self.options: m.JobOptions = attached.options
        """How the job trains (optimizer, dtype, delayed update, base...), as the server holds it."""
        self.units: Units | None = None if attached.options.units is None else Units(tuple(attached.options.units))
        """Coalesced stages (NOTE [Transfer units] in ``client/units.py``): which server stage holds
        each stage; None when each stage is a server stage of its own."""
        self.unit_specs: list[StageSpec] = list(attached.stages)
        """The server's stages: the units' layouts (the stages' own without units)."""
        self.specs: list[StageSpec] = list(self.unit_specs) if self.units is None else self.units.chain_specs(self.unit_specs)
        """Each stage's layout (with units: its own part of its unit's, names without the prefix)."""
        self.base_stages: list[StageSpec] = list(attached.base_stages)
        self._token = token
        self._chain = chain

    @property
    def num_stages(self) -> int:
        """Weight stages: the modules given to ``create_job`` (their parameters' owners). The
        server stores, updates and streams them one by one, or ``len(unit_specs)`` units of them."""
        return len(self.specs)

    @property
    def positions(self) -> list[int] | None:
        """The weight stage each chain position runs on (``[0, 1, ..., n-1]`` without ties);
        None for a job attached without its stages."""
        return None if self._chain is None else [stage for stage, _ in self._chain]

    def _runner(self, stage: int, skeleton: nn.Module) -> StageRunner:
        """The runner of a position on weight stage ``stage``: on its own server stage, on its
        frozen base's, or on its unit (a view of its part, NOTE [Transfer units])."""
        if self.units is not None:
            unit = self.units.unit_of[stage]
            return StageRunner(unit, skeleton, self.unit_specs[unit], prefix=f"{stage}.")
        return StageRunner(
            stage,
            skeleton,
            self.specs[stage],
            base_spec=self.base_stages[stage] if self.base_stages else None,
            frozen=frozen_params(stage, skeleton, self.base_stages[stage]) if self.base_stages else (),
        )

    @property
    def num_params(self) -> int:
        return sum(numel_of(p.shape) for s in self.specs for p in s.params)

    def trainer(
        self,
        device: str | torch.device = "cpu",
        *,
        checkpointing: Checkpointing | None = None,
        transport: Transport | None = None,
        precision: Precision | None = None,
        parallelism: Parallelism | None = None,
        **options: Any,
    ) -> Trainer:
        """Join the job as a data-parallel worker computing on ``device``.

        The options come in four groups, each a dataclass of ``wstream.client.options`` whose
        fields say what they do: :class:`Checkpointing` (``schedule``, ``slots``,
        ``memory_budget``, ``preserve_rng``, ``early_stop``), :class:`Transport` (``prefetch``, ``weight_budget``,
        ``shm``, ``zero_copy``, ``grad_slots``, ``step_ring``, ``reconnect_s``, ``cpu_threads``), :class:`Precision`
        (``loss_scale``) and :class:`Parallelism` (``world_size``, ``reduce``). Each field may
        also be given as a flat keyword (``job.trainer(schedule="dnc", prefetch=1)``), but not
        together with its group's dataclass.
        """
        if self._chain is None:
            raise StateError(
                f"job {self.name!r} was attached without its stages: pass stages= to attach_job "
                "(modules built under torch.device('meta') are enough)"
            )
        place = worker_device(device)
        groups = {"checkpointing": checkpointing, "transport": transport, "precision": precision, "parallelism": parallelism}
        chosen = trainer_options(groups, options)
        runners = [self._runner(stage, skeleton) for stage, skeleton in self._chain]
        if not any(r.trains for r in runners):
            raise LayoutError(
                f"job {self.name!r}: no chain position trains a parameter (every stage is frozen whole): "
                "there is nothing to train (give some parameter requires_grad)"
            )
        endpoint = self.client.worker_endpoint(
            job=self.name, token=self._token, stages=tuple(self.unit_specs),
            units=None if self.units is None else self.units.counts, base_stages=tuple(self.base_stages),
        )
        return Trainer(endpoint, runners, device=place, options=chosen)

    def state_dict(self, *, progress: bool | None = None) -> dict[str, torch.Tensor]:
        """The job's current fp32 weights (and buffers: :func:`stage_tensors`) as
        ``{"<stage>.<param>": tensor}`` (pulled from the server).

        ``progress``: a progress bar on stderr (None: only when stderr is a terminal)."""
        with progress_bar(progress, self.num_params, f"pulling {self.name}") as bar:
            _, stages = pull_consistent(
                self._pull_versioned, len(self.unit_specs), self.name,
                pulled=lambda j: bar.update(sum(numel_of(p.shape) for p in self.unit_specs[j].params)),
            )
        return named_state(stages, units=self.units is not None)

    def pull_stage(self, stage: int) -> dict[str, torch.Tensor]:
        """Stage ``stage``'s current fp32 weights, ``{param: tensor}``: one stage in memory at a
        time, for exports of models larger than this process's memory. With units, its unit is
        pulled whole and cut (``state_dict`` pulls each unit once). Stages pulled one by one while
        the job trains may be of different steps: :meth:`pull_stage_versioned` says which."""
        return self.pull_stage_versioned(stage)[1]

    def pull_stage_versioned(self, stage: int) -> tuple[int, dict[str, torch.Tensor]]:
        """``(step, weights)``: :meth:`pull_stage`'s weights and the step they are of (the number
        of updates applied to the stage), so that a reader can make sure all it read is of one
        step (:func:`read_in_one_step`)."""
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < self.num_stages:
            raise IndexError(f"job {self.name!r} has stages 0..{self.num_stages - 1}, not {stage!r}")
        if self.units is None:
            return self._pull_versioned(stage)
        prefix = f"{stage}."
        version, tensors = self._pull_versioned(self.units.unit_of[stage])
        return version, {name[len(prefix) :]: t for name, t in tensors.items() if name.startswith(prefix)}

    def _pull_versioned(self, server_stage: int) -> tuple[int, dict[str, torch.Tensor]]:
        spec = self.unit_specs[server_stage]
        reply, data = self.client._chan.request(m.Pull(session=self.session, stage=server_stage), m.Master)
        return reply.version, stage_tensors(spec, data)

    def wait_step(self, step: int, timeout: float | None = None) -> int:
        """Wait until every stage holds the weights after ``step`` steps (the updates of the steps
        before it applied; ``await_step``, which moves no weights); returns the job's step then.
        ``timeout``: seconds for the whole wait (default: the client's ``wait_timeout``)."""

        def reached(t: int, left: float) -> int:
            reply, _ = self.client._chan.request(m.AwaitStep(session=self.session, step=t), m.StepReached, timeout_s=left, held=True)
            return reply.step

        return wait_for_step(reached, step, timeout or self.client.wait_timeout_s)

    def save(self, timeout: float | None = None) -> tuple[int, str]:
        """Snapshot the job on the server's store; returns (step, directory) once it is durable.

        The snapshot is of the job's next consistent step (at once when no step is under way). A
        server with an admin secret refuses this from a job session: use ``Client.save_job`` with
        ``admin_secret``."""
        with self._admin_hint("save_job"):
            reply, _ = self.client._chan.request(
                m.Save(session=self.session), m.Saved, timeout_s=timeout or self.client.wait_timeout_s, held=True
            )
        return reply.step, reply.path

    def set_schedule(self, schedule: Schedule | None = None, *, lr: float | None = None) -> None:
        """Change the job's base ``lr`` and/or learning-rate ``schedule`` (e.g.
        ``WarmupCosine(...)``), from the next step to commit on; the step index the schedule is
        evaluated at stays the job's. On a server with a store the change is on disk when this
        returns (a server killed afterwards comes back with it, and the steps it trains again run
        under the schedule they first ran under). A server with an admin secret refuses this from
        a job session: use ``Client.set_schedule`` with ``admin_secret``."""
        with self._admin_hint("set_schedule"):
            self.client._chan.request(m.SetSchedule(session=self.session, lr=lr, schedule=schedule), m.Ok)
        opt = self.options.optimizer
        opt = msgspec.structs.replace(opt, lr=opt.lr if lr is None else lr, schedule=schedule or opt.schedule)
        self.options = msgspec.structs.replace(self.options, optimizer=opt)

    def export(self, path: str | os.PathLike[str], *, progress: bool | None = None) -> None:
        """Write the job's current fp32 weights to a plain safetensors file (names as
        :meth:`state_dict`), for use outside wstream. ``progress`` as for :meth:`state_dict`."""
        from safetensors.torch import save_file

        metadata = export_metadata(self.name, self.specs, self.options.param_groups)
        save_file(self.state_dict(progress=progress), os.fspath(path), metadata=metadata)

    def drop(self) -> None:
        """Delete the job from the server, freeing its memory, **and its snapshots** in the
        server's store (workers get errors afterwards; a restart does not bring it back).

        A server with an admin secret refuses this from a job session (``AuthError``): use
        ``Client.drop_job`` with ``admin_secret``. (Not routed there by itself: the admin
        session acts by name, and a handle kept past a drop would then act on a new job of its
        name; this handle's session belongs to its own job only.)"""
        with self._admin_hint("drop_job"):
            self.client._chan.request(m.DropJob(session=self.session), m.Ok)

    @contextlib.contextmanager
    def _admin_hint(self, method: str) -> Iterator[None]:
        """An ``AuthError`` of a job-session request on a server with an admin secret says which
        client method does it with the secret."""
        try:
            yield
        except AuthError as exc:
            exc.add_note(f"with the server's admin secret: Client(address, admin_secret=...).{method}({self.name!r}, ...)")
            raise


_TOLD_OF_CUDA = False


def worker_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device, refused by name when this torch cannot use it (a CUDA device
    without CUDA: torch's own message is a bare assertion); a CPU worker on a host whose GPU
    goes unused is told so, once per process. ``"cuda"`` is given the index of this thread's
    current device (``from_torchrun`` sets the rank's): the trainer's helper threads start on
    device 0, and a device guard without an index would leave them there, making a context on
    GPU 0 for every rank."""
    global _TOLD_OF_CUDA
    place = torch.device(device)
    if place.type == "cuda" and not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise ValueError(f"device {str(device)!r}: {why} (torch {torch.__version__}); train on 'cpu', or install a CUDA torch")
    if place.type == "cuda" and place.index is None:
        place = torch.device("cuda", torch.cuda.current_device())
    if place.type == "cpu" and not _TOLD_OF_CUDA and torch.cuda.is_available():
        _TOLD_OF_CUDA = True
        log.warning("this trainer computes on the CPU while a CUDA device is visible: job.trainer('cuda') uses the GPU")
    return place


CONSISTENT_PULL_ROUNDS = 10
T = TypeVar("T")


def pull_consistent(
    pull: Callable[[int], tuple[int, dict[str, torch.Tensor]]],
    stages: int,
    job: str,
    *,
    pulled: Callable[[int], object] = lambda j: None,
) -> tuple[int, list[dict[str, torch.Tensor]]]:
    """The step every stage was read at, and each stage's tensors of it: ``pull(j)`` gives stage
    j's (version, tensors), and a stage pulled at an older version than another is pulled again
    (its update was still to come; a pull waits for an update under way), until all agree. A job
    that keeps training faster than it is read is refused after a few rounds, rather than mixing
    steps. ``pulled(j)`` follows stage j's first pull only (a progress bar's count)."""
    got = []
    for j in range(stages):
        got.append(pull(j))
        pulled(j)
    for _ in range(CONSISTENT_PULL_ROUNDS):
        newest = max(v for v, _ in got)
        stale = [j for j, (v, _) in enumerate(got) if v != newest]
        if not stale:
            return newest, [tensors for _, tensors in got]
        for j in stale:
            got[j] = pull(j)
    versions = sorted({v for v, _ in got})
    raise StateError(
        f"job {job!r} kept training while its weights were read (its stages were at steps {versions} after "
        f"{CONSISTENT_PULL_ROUNDS} rounds): read them between steps (after the trainer's step returns and "
        "wait_updates()), or save() a snapshot, which is of one step"
    )


RESTARTS = 3
"""How often :func:`read_in_one_step` starts again when the job moves on under it."""


def read_in_one_step(
    pull: Callable[[int], tuple[Any, T]],
    stages: Sequence[int],
    job: str,
    use: Callable[[int, T], None],
    start_over: Callable[[], None],
) -> Any:
    """Read ``stages`` in order and hand each to ``use`` as it comes (a streaming export holds one
    at a time), all of one step; returns that step. ``pull(j)`` gives stage j's (version, value).
    A stage at an older step than those before it is pulled again (its update was still to come;
    a pull waits for an update under way); one at a newer step means the job moved on under the
    reader: ``start_over`` discards what was used, and the read begins again, at most
    :data:`RESTARTS` times (:func:`pull_consistent` can re-read what it holds instead)."""
    for _ in range(1 + RESTARTS):
        step: Any = None
        for j in stages:
            for _ in range(CONSISTENT_PULL_ROUNDS):
                version, value = pull(j)
                if step is None or not version < step:
                    break
            if step is None:
                step = version
            if version != step:
                break
            use(j, value)
        else:
            return step
        start_over()
    raise StateError(
        f"job {job!r} kept training while its weights were read (read again {RESTARTS} times): read them "
        "between steps (after the trainer's step returns and wait_updates()), or save() a snapshot, which is of one step"
    )


def named_state(stages: list[dict[str, torch.Tensor]], *, units: bool) -> dict[str, torch.Tensor]:
    """Server stages' tensors as one ``{"<stage>.<param>": tensor}`` dict; with ``units`` each
    unit's are named so already."""
    out: dict[str, torch.Tensor] = {}
    for j, tensors in enumerate(stages):
        out.update(tensors if units else {f"{j}.{name}": t for name, t in tensors.items()})
    return out


def stage_tensors(spec: StageSpec, data: list[Any]) -> dict[str, torch.Tensor]:
    """A stage's parameters and buffers, ``{name: tensor}``, from the data frames of a ``master``
    reply: fp32 (the master), but an integer or boolean buffer in its own dtype (BatchNorm's
    ``num_batches_tracked`` is an int64 again), so that ``load_state_dict`` takes them as they are."""
    flat = torch.empty(spec.numel, dtype=torch.float32)
    copy_frames_into(flat, data)
    out = {}
    for p in spec.params:
        t = flat[p.offset : p.offset + numel_of(p.shape)].view(p.shape).clone()
        dtype = DTYPE_OF_BUFFER[p.buffer] if p.buffer else torch.float32
        out[p.name] = t if dtype.is_floating_point else t.to(dtype)
    return out


def wait_for_step(reached: Callable[[int, float], int], step: int, timeout: float) -> int:
    """Wait for a job's step ``step`` with ``reached(t, seconds)`` (one ``await_step``: the job's
    step once it is at ``t`` or beyond), a step at a time: the server lets a request wait for at
    most the step after the one its job gathers. Returns the job's step; ``timeout``: seconds
    for the whole wait."""
    deadline = time.monotonic() + timeout
    now = reached(0, timeout)  # the job's step now
    while now < step:
        now = reached(min(step, now + 1), max(deadline - time.monotonic(), 1e-3))
    return now
