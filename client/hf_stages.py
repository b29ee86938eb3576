"""The stage modules of Hugging Face causal LMs: the embedding, runs of decoder blocks and the head,
each holding the model's own modules that its :class:`~wstream.client.hf_layout.Layout` names (NOTE
[The structural rule] in ``hf_layout.py``); what flows between them is in ``hf_masks.py`` (NOTE
[What flows between stages]).

Apart from :mod:`wstream.client.hf` (configs, checkpoints, creating and exporting jobs) because
these are what a worker runs: the real ``transformers`` modules, wrapped so that a stage's
parameter names are the checkpoint's (NOTE [Stage parameters carry their checkpoint names] in
``hf.py``) and only hidden states, position ids and the mask flow between stages.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .hf_layout import Layout
from .hf_masks import as_bool_mask, block_mask, boundary, default_positions


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register ``module`` at dotted ``path`` under ``root``, creating empty containers on the way
    (NOTE [Stage parameters carry their checkpoint names])."""
    *parents, leaf = path.split(".")
    node = root
    for part in parents:
        child = node._modules.get(part)
        if child is None:
            child = nn.Module()
            node.add_module(part, child)
        node = child
    node.add_module(leaf, module)


def _plain_embedding(module: nn.Module) -> nn.Embedding:
    """A bare ``nn.Embedding`` of ``module``'s shape and padding index: no subclass forward, no
    buffer (a scale or offset is applied by the stage)."""
    assert isinstance(module, nn.Embedding)
    return nn.Embedding(module.num_embeddings, module.embedding_dim, module.padding_idx)


class Embedding(nn.Module):
    """The first stage: token embedding (x scale), project_in, + learned positions, dropout."""

    def __init__(self, layout: Layout) -> None:
        super().__init__()
        model = layout.model
        self._embed = layout.embed
        _attach(self, layout.embed, _plain_embedding(model.get_submodule(layout.embed)))
        self._positions = layout.positions
        if layout.positions is not None:
            _attach(self, layout.positions, _plain_embedding(model.get_submodule(layout.positions)))
        self._parts = [p for p in (layout.project_in, layout.dropout) if p is not None]
        for path in self._parts:
            _attach(self, path, model.get_submodule(path))
        self._project_in = layout.project_in
        self._dropout = layout.dropout
        self._scale = layout.embed_scale
        self._offset = layout.position_offset
        self._from_mask = layout.family.positions_from_mask

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> Any:
        hidden = self.get_submodule(self._embed)(input_ids)
        if self._scale is not None:  # as the scaled embedding's float32 buffer, cast to the weights' dtype
            hidden = hidden * torch.tensor(self._scale, dtype=torch.float32, device=hidden.device).to(hidden.dtype)
        if self._project_in is not None:
            hidden = self.get_submodule(self._project_in)(hidden)
        extras = attention_mask is not None or position_ids is not None
        if position_ids is not None and position_ids.shape[-1] != input_ids.shape[-1]:
            raise ValueError(
                f"position_ids of shape {tuple(position_ids.shape)} for input_ids of {tuple(input_ids.shape)}: "
                "both are (batch, seq)"
            )
        if position_ids is None and (extras or self._positions is not None):
            position_ids = self._default_positions(hidden, attention_mask)
        if self._positions is not None:
            assert position_ids is not None
            hidden = hidden + self.get_submodule(self._positions)(position_ids + self._offset)
        if self._dropout is not None:
            hidden = self.get_submodule(self._dropout)(hidden)
        if not extras:
            return hidden
        assert position_ids is not None
        mask = None if attention_mask is None else as_bool_mask(attention_mask, hidden)
        return boundary(hidden, position_ids.expand(hidden.shape[0], -1), mask)

    def _default_positions(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The position ids the model computes when given none."""
        if not self._from_mask or attention_mask is None:
            return default_positions(hidden)
        if attention_mask.dim() != 2:
            raise ValueError(
                "this family counts positions from a 2D padding mask; with a 4D attention_mask pass position_ids too"
            )
        ones = attention_mask.bool().long()  # counted in integers: a float mask may arrive in bf16, which skips past 256
        return ones.cumsum(dim=1) * ones - 1


class Blocks(nn.Module):
    """Consecutive decoder blocks (and the final norm and project_out in the last such stage)."""

    def __init__(self, layout: Layout, layers: range, *, final: bool) -> None:
        super().__init__()
        model = layout.model
        self.config = layout.config
        self._paths = [f"{layout.layers}.{i}" for i in layers]
        self._kinds = [layout.kinds[i] for i in layers]
        for path in self._paths:
            _attach(self, path, model.get_submodule(path))
        self._after = [p for p in (layout.norm, layout.project_out) if p is not None] if final else []
        for path in self._after:
            _attach(self, path, model.get_submodule(path))
        self._mask_positions = layout.family.mask_sees_positions
        rotary = None
        if layout.rotary is not None:
            with torch.device("cpu"):  # a constant of the config, built for real even on meta
                rotary = layout.rotary(config=self.config)
        object.__setattr__(self, "_rotary", rotary)  # not a submodule (NOTE [What flows between stages])

    def forward(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> Any:
        positions = default_positions(hidden) if position_ids is None else position_ids
        seen = positions if self._mask_positions else None
        masks = {kind: block_mask(kind, self.config, hidden, attention_mask, seen) for kind in dict.fromkeys(self._kinds)}
        side: dict[str, Any] = {}
        if self._rotary is not None:
            side["position_embeddings"] = self._rotary(hidden, positions)
        for path, kind in zip(self._paths, self._kinds):
            out = self.get_submodule(path)(hidden, attention_mask=masks[kind], position_ids=positions, **side)
            hidden = out[0] if isinstance(out, tuple) else out
        for path in self._after:
            hidden = self.get_submodule(path)(hidden)
        return boundary(hidden, position_ids, attention_mask)


def _softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma2's final logit soft-capping, as its forward computes it."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


class Head(nn.Module):
    """The LM head of an untied model (its own stage)."""

    def __init__(self, layout: Layout) -> None:
        super().__init__()
        self._path = layout.family.saved_name(layout.head + ".weight").rpartition(".")[0]
        _attach(self, self._path, layout.model.get_submodule(layout.head))
        self._cap = getattr(layout.config, "final_logit_softcapping", None)

    def forward(self, hidden: torch.Tensor, *side: torch.Tensor) -> torch.Tensor:
        return _softcap(self.get_submodule(self._path)(hidden), self._cap)


class TiedHead(nn.Module):
    """The LM head of a tied model: logits from the token embedding matrix, whose one parameter
    is named as in the embedding stage (a :class:`Tied` position on it)."""

    def __init__(self, layout: Layout) -> None:
        super().__init__()
        self._embed = layout.embed
        _attach(self, layout.embed, _plain_embedding(layout.model.get_submodule(layout.embed)))
        self._cap = getattr(layout.config, "final_logit_softcapping", None)

    def forward(self, hidden: torch.Tensor, *side: torch.Tensor) -> torch.Tensor:
        weight = self.get_submodule(self._embed).weight
        return _softcap(nn.functional.linear(hidden, weight), self._cap)


__all__ = ["Blocks", "Embedding", "Head", "TiedHead"]
