"""Data-parallel ranks launched by ``torchrun``: attach every rank to one job.

Two ways to combine the ranks' gradients (``job.trainer(reduce=...)``):

* ``"server"``: every rank is a worker of the job and pushes its own gradient; the server
  averages them (``world_size`` = the number of ranks). No process group is needed.
* ``"allreduce"``: the ranks average each stage's gradient over ``torch.distributed`` first
  (gloo on CPU, NCCL on GPUs) and only rank 0 pushes it; the other ranks join as *readers*
  (they fetch weights, never push). One gradient per stage reaches the server whatever the
  number of ranks, which is what ranks on other hosts want (one push over the network instead of
  one per rank). docs/distributed.md compares the two.

Safety of ``"allreduce"`` with in-place (single-slot) publication: the update of (i, t) starts
when rank 0 pushes, which is after the all-reduce of stage i, which every rank enters only after
its own last use of w_i(t) (its BACKWARD of stage i). So the server's rule 2 (NOTE [Versions and
who may read what]) still holds for the readers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from wstream.protocol import StageSpec
from wstream.protocol.layout import push_layout
from wstream.protocol.messages import ParamSpec

from .scatter import scatter_grads


@dataclass(frozen=True, slots=True)
class Launch:
    """Where this process sits in a ``torchrun`` launch."""

    rank: int
    local_rank: int
    world_size: int

    @property
    def device(self) -> torch.device:
        """This rank's device: ``cuda:<local rank>`` when there are GPUs, else the CPU."""
        return torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")


def from_torchrun(*, init_process_group: bool = True, backend: str | None = None) -> Launch:
    """Read ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` (set by ``torchrun``), and start the default
    process group (gloo on CPU, NCCL with GPUs) unless it is running or not wanted, also for a
    single rank under ``torchrun``. Outside ``torchrun`` this is rank 0 of 1, with no group."""
    launch = Launch(
        rank=int(os.environ.get("RANK", "0")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
    )
    if torch.cuda.is_available():  # NCCL and device-less CUDA calls use the current device: this
        torch.cuda.set_device(launch.local_rank)  # rank's, else every rank also creates a context on cuda:0
    dist = torch.distributed
    # under torchrun (TORCHELASTIC_RUN_ID) even one rank gets its group: reduce='allreduce' needs one
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if init_process_group and (launch.world_size > 1 or under_torchrun) and not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"))
    return launch


def flat_spec(spec: StageSpec) -> StageSpec:
    """``spec``'s push seen as one flat parameter (``push_layout(spec).numel`` elements: its
    gradient, in which frozen parameters have none, then its buffers): the layout of an already
    flat push, to send it."""
    numel = push_layout(spec).numel
    return StageSpec(name=spec.name, numel=numel, params=[ParamSpec("flat", (numel,), 0)])


class AllReduceGradients:
    """Averages a stage's gradient over the ranks of a process group, into one flat buffer; its
    buffers' values (BatchNorm's running statistics) too, so that the job keeps their mean over
    the ranks, as it does over workers with ``reduce="server"`` (DESIGN.md, "Buffers")."""

    def __init__(self, max_numel: int, group: torch.distributed.ProcessGroup | None = None) -> None:
        dist = torch.distributed
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "reduce='allreduce' needs torch.distributed initialized (launch with torchrun and call "
                "wstream.client.distributed.from_torchrun() first), or use reduce='server'"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._max_numel = max_numel
        self._flat: torch.Tensor | None = None

    def same_micro_batches(self, k: int, device: torch.device) -> None:
        """Refuse the step on every rank unless every rank splits it into ``k`` micro-batches: the
        ranks agree on each micro-batch's loss (:meth:`all_finite`), so different counts would pair
        one rank's agreement with another's stage all-reduce (gloo aborts, NCCL may hang)."""
        counts = torch.tensor([float(k), -float(k)], device=device)
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX, group=self.group)
        most, fewest = int(counts[0].item()), int(-counts[1].item())
        if most != fewest:
            raise ValueError(
                f"micro_batches={k} on this rank, but the ranks use {fewest} to {most}: with reduce='allreduce' every "
                "rank must split its batch into as many micro-batches (they all-reduce in lockstep); give every rank "
                "the same micro_batches, or use reduce='server'"
            )

    def all_finite(self, finite: bool, device: torch.device) -> bool:
        """Whether every rank's value is finite, ``finite`` being this rank's: a one-number
        all-reduce, so that the ranks refuse a step together, at the same point of their
        all-reduces (one rank alone raising would leave the others waiting in the next one)."""
        flag = torch.tensor([1.0 if finite else 0.0], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return bool(flag.item() == 1.0)

    def mean(self, spec: StageSpec, grads: list[torch.Tensor | None], device: torch.device) -> torch.Tensor:
        """The mean over the ranks of this stage's push, flat fp32 (``push_layout(spec).numel``
        elements); a view of a buffer reused by the next call."""
        if self._flat is None or self._flat.device != device:
            self._flat = torch.empty(self._max_numel, dtype=torch.float32, device=device)
        flat = self._flat[: push_layout(spec).numel]
        scatter_grads(flat, spec, grads)
        torch.distributed.all_reduce(flat, group=self.group)
        return flat.div_(self.size)
