"""Running a meta-device skeleton on given tensors: ``torch.func.functional_call`` with the
module walk done once.

# NOTE [Binding]
# ``functional_call(module, tensors, args)`` walks the module on every call: it maps tied names
# (``named_parameters(remove_duplicate=False)``), resolves each dotted name to its submodule and
# builds swap dictionaries, about 25 us for a two-parameter stage here, more than a small stage's
# own compute. A stage runs thousands of times per step in a deep chain, on a skeleton whose
# structure never changes, so a :class:`Binding` resolves, once, every dotted name to the dict
# (``_parameters`` or ``_buffers`` of its submodule) that holds it and to every alias of a tied
# tensor, and each call then only
#   1. writes each given tensor into its slots (what ``functional_call``'s swap does: the entry in
#      ``_parameters``/``_buffers``, so a module reads it as it reads its own),
#   2. runs the module (its hooks included, as ``functional_call`` does), and
#   3. puts the skeleton's own (meta) tensors back, also when the run raises; a tensor the run
#      replaced (``self.x = ...`` rather than an in-place update) is written back into the
#      caller's dict first, as ``functional_call`` does.
# A name the skeleton does not hold goes to ``functional_call`` (whose rules then apply).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

Slot = tuple[dict[str, Any], str]
"""Where a module keeps a tensor: its ``_parameters`` or ``_buffers`` dict and the key in it."""


class Binding:
    """Runs ``module`` with the given tensors in place of its parameters and buffers (by dotted
    name, as ``functional_call`` takes them; a tied tensor's every alias gets the value)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._slots: dict[str, list[Slot]] = {}
        aliases: dict[int, list[Slot]] = {}
        for kind, named in (("_parameters", module.named_parameters), ("_buffers", module.named_buffers)):
            for name, tensor in named(remove_duplicate=False):
                owner, _, attr = name.rpartition(".")
                holder = getattr(module.get_submodule(owner), kind)
                slots = aliases.setdefault(id(tensor), [])
                slots.append((holder, attr))
                self._slots[name] = slots  # every alias of a tied tensor shares one list
        # every slot with the skeleton's own tensor in it, which each run puts back
        self._owns = [(holder, attr, holder[attr]) for slots in aliases.values() for holder, attr in slots]

    def __call__(self, tensors: dict[str, torch.Tensor], inputs: tuple[Any, ...]) -> Any:
        slots = self._slots
        if any(name not in slots for name in tensors):
            return torch.func.functional_call(self.module, tensors, inputs)
        saved: list[tuple[dict[str, Any], str, Any]] = []
        try:
            for name, tensor in tensors.items():
                for holder, attr in slots[name]:
                    saved.append((holder, attr, holder[attr]))
                    holder[attr] = tensor
            out = self.module(*inputs)
            for name, tensor in tensors.items():
                holder, attr = slots[name][0]
                if holder[attr] is not tensor:  # the run replaced it: the caller gets the new one
                    tensors[name] = holder[attr]
            return out
        finally:
            for holder, attr, own in reversed(saved):
                holder[attr] = own

    def run_own(self, tensors: dict[str, torch.Tensor], inputs: tuple[Any, ...]) -> Any:
        """:meth:`__call__` for ``tensors`` named by the skeleton's own names whose caller does not
        want a replaced tensor back (a stage's kept leaves, NOTE [Kept leaves] in stages.py: the
        next run binds them again): no dict is copied, no replacement looked for, and the
        skeleton's own tensors are put back from the list made once (step 3 of the NOTE, without
        the write-back). A deep chain makes millions of these runs per step."""
        slots = self._slots
        try:
            for name, tensor in tensors.items():
                for holder, attr in slots[name]:
                    holder[attr] = tensor
            return self.module(*inputs)
        finally:
            for holder, attr, own in self._owns:
                holder[attr] = own
