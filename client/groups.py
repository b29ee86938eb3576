"""Parameter groups on the client: which optimizer settings each parameter of a job is trained with.

A :class:`ParamGroup` says *which* parameters (a predicate, a regular expression or a list of
names, over each parameter's name within its stage module) and *what* they get (a weight decay,
a learning-rate scale). ``create_job(param_groups=[...])`` sends the groups' settings once, in
``JobOptions.param_groups`` (as :class:`~wstream.protocol.GroupSpec` records), and gives each
parameter's ``ParamSpec.group`` the index of the first group that takes it (0: none, the
optimizer's own settings). The server runs each group as a ``torch.optim`` param group.
"""

from __future__ import annotations

import json

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from wstream.protocol import messages as m

Predicate = Callable[[str, nn.Parameter, nn.Module], bool]
"""``where(name, parameter, owner)``: the parameter's name within its stage module, the parameter,
and the module that directly owns it."""


@dataclass(frozen=True, slots=True)
class ParamGroup:
    """A group of a job's parameters trained with settings of their own.

    ``where`` picks the parameters: a callable ``where(name, parameter, owner)`` (the name within
    its stage module, the parameter, the module that directly owns it), a string (a regular
    expression that must match the whole name, ``re.fullmatch``), or a sequence of exact names.
    Each parameter goes to the first group of a job's list that picks it.
    ``weight_decay``: the group's (None: the optimizer's). ``lr_scale``: the group's learning rate
    is the optimizer's times this."""

    name: str
    where: Predicate | str | Sequence[str]
    weight_decay: float | None = None
    lr_scale: float = 1.0

    def __post_init__(self) -> None:
        self.spec()  # the wire record's checks: a name, finite non-negative numbers
        if isinstance(self.where, str):
            try:
                re.compile(self.where)
            except re.error as exc:
                raise ValueError(f"parameter group {self.name!r}: where={self.where!r} is not a regular expression: {exc}") from None
        elif not callable(self.where) and not (
            isinstance(self.where, Sequence) and all(isinstance(n, str) for n in self.where)
        ):
            raise TypeError(
                f"parameter group {self.name!r}: where= takes a callable (name, parameter, owner) -> bool, a regular "
                f"expression or a sequence of names, got {type(self.where).__name__}"
            )

    def spec(self) -> m.GroupSpec:
        """The group's settings as the job's options carry them."""
        return m.GroupSpec(name=self.name, weight_decay=self.weight_decay, lr_scale=self.lr_scale)


def no_decay(name: str = "no_decay") -> ParamGroup:
    """The GPT recipe's group without weight decay: biases and norm weights (every parameter with
    fewer than 2 dimensions) and embeddings (parameters of an ``nn.Embedding``)."""
    return ParamGroup(name, where=_no_decay, weight_decay=0.0)


def _no_decay(name: str, param: nn.Parameter, owner: nn.Module) -> bool:
    return param.ndim < 2 or isinstance(owner, nn.Embedding)


class GroupAssigner:
    """Gives each parameter of a job its group index (the first group that picks it wins; 0 when
    none does) and remembers what each group got, so that a group that got nothing is refused."""

    def __init__(self, groups: Sequence[ParamGroup]) -> None:
        for g in groups:
            if not isinstance(g, ParamGroup):
                raise TypeError(f"param_groups takes ParamGroup items, got {type(g).__name__}")
        self.specs = m.JobOptions(param_groups=[g.spec() for g in groups]).param_groups  # names unique, bounded
        self._match: list[Callable[[str, nn.Parameter, nn.Module], bool]] = [_matcher(g.where) for g in groups]
        self._names = [g.name for g in groups]
        self._got = [0] * len(groups)  # parameters each group took
        self._matched = [0] * len(groups)  # parameters each group's ``where`` picked, taken or not

    def index(self, name: str, param: nn.Parameter, owner: nn.Module) -> int:
        """The group index (``ParamSpec.group``) of a trained parameter."""
        chosen = 0
        for k, match in enumerate(self._match):
            if match(name, param, owner):
                self._matched[k] += 1
                if not chosen:
                    chosen = k + 1
                    self._got[k] += 1
        return chosen

    def check_all_used(self) -> None:
        """Raise ``ValueError`` naming the first group that took no parameter."""
        for name, got, matched in zip(self._names, self._got, self._matched):
            if got:
                continue
            if matched:
                raise ValueError(
                    f"parameter group {name!r} gets no parameter: the {matched} it matches are taken by earlier groups "
                    "(a parameter goes to the first group that matches it)"
                )
            raise ValueError(f"parameter group {name!r} matches no trained parameter of the job")


def _matcher(where: Predicate | str | Sequence[str]) -> Callable[[str, nn.Parameter, nn.Module], bool]:
    if isinstance(where, str):
        pattern = re.compile(where)
        return lambda name, _p, _o: pattern.fullmatch(name) is not None
    if callable(where):
        return lambda name, p, o: bool(where(name, p, o))
    names = frozenset(where)
    return lambda name, _p, _o: name in names


def export_metadata(job: str, specs: Sequence[m.StageSpec], groups: Sequence[m.GroupSpec] = ()) -> dict[str, str]:
    """The safetensors metadata of an export (values are strings): the job's name, its parameter
    groups with the tensors in each (``<stage>.<param>`` names, as the file's) and its frozen
    tensors (parameters without ``requires_grad``), so that the optimizer settings travel with the
    weights; a job with buffers also lists them, with their dtypes (``buffers``)."""
    members: dict[int, list[str]] = {}
    frozen: list[str] = []
    buffers: dict[str, str] = {}
    for i, spec in enumerate(specs):
        for p in spec.params:
            if p.buffer:
                buffers[f"{i}.{p.name}"] = p.buffer
            elif p.frozen:
                frozen.append(f"{i}.{p.name}")
            elif p.group:
                members.setdefault(p.group, []).append(f"{i}.{p.name}")
    described = [
        {"name": g.name, "weight_decay": g.weight_decay, "lr_scale": g.lr_scale, "params": members.get(k + 1, [])}
        for k, g in enumerate(groups)
    ]
    out = {"job": job, "param_groups": json.dumps(described), "frozen": json.dumps(frozen)}
    if buffers:
        out["buffers"] = json.dumps(buffers)
    return out
