"""The stage modules of Hugging Face causal LMs: embeddings, runs of decoder blocks, heads, and the
family (GPT-2, Llama) that says which ``transformers`` modules each one holds and where.

Apart from :mod:`wstream.client.hf` (configs, checkpoints, creating and exporting jobs) because
these are what a worker runs: the real ``transformers`` blocks, wrapped so that a stage's
parameter names are the checkpoint's (NOTE [Stage parameters carry their checkpoint names] in
``hf.py``) and only hidden states and the padding mask flow between stages.

# NOTE [What flows between stages]
# A stage's inputs are ``(hidden, [attention_mask])``: the hidden states and, when the caller
# gave one, the (batch, seq) padding mask, carried along unchanged. Everything else a block needs
# is computed inside the stage from these: position ids (0..seq-1, as the model computes them
# without a cache), the causal mask (``create_causal_mask``, as the model does) and Llama's rotary
# cos/sin. Recomputing them per stage costs little and keeps the boundary small and batch-major,
# so micro-batches split it. The rotary embedding module is held outside the stage's module tree:
# its ``inv_freq`` is a constant of the config, not a streamed parameter (and a buffer would be
# refused by ``spec_of``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from transformers import PretrainedConfig
from transformers.masking_utils import create_causal_mask

# ---- stage modules -------------------------------------------------------------------------------
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


def _boundary(hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> Any:
    """What a stage hands on (NOTE [What flows between stages])."""
    return hidden if attention_mask is None else (hidden, attention_mask)


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    """The position ids the model computes for a sequence without a cache: (1, seq)."""
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


_MASK_PARAMETERS = inspect.signature(create_causal_mask).parameters
_MASK_WANTS_CACHE_POSITION = "cache_position" in _MASK_PARAMETERS
"""transformers 5.2 and 5.3 require ``cache_position``; later versions dropped it."""
_MASK_CACHE_ARG = "cache" if "cache" in _MASK_PARAMETERS else "past_key_values"
"""The name of the (empty) cache argument: ``past_key_values`` until transformers 5.2x renamed it
``cache`` (the old name then warns that it is deprecated)."""


def _causal_mask(config: PretrainedConfig, hidden: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor) -> Any:
    """The mask the model's forward builds for its blocks (None where sdpa's is_causal does)."""
    extra: dict[str, Any] = {_MASK_CACHE_ARG: None}
    if _MASK_WANTS_CACHE_POSITION:
        extra["cache_position"] = position_ids[0]
    return create_causal_mask(
        config=config,
        inputs_embeds=hidden,
        attention_mask=attention_mask,
        position_ids=position_ids,
        **extra,
    )


class GPT2Embedding(nn.Module):
    """GPT-2's token and position embeddings (and embedding dropout)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        _attach(self, "transformer.wte", nn.Embedding(config.vocab_size, config.hidden_size))
        _attach(self, "transformer.wpe", nn.Embedding(config.max_position_embeddings, config.hidden_size))
        self.drop = nn.Dropout(config.embd_pdrop)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Any:
        t = self.transformer
        hidden = self.drop(t.wte(input_ids) + t.wpe(_positions(input_ids)))
        return _boundary(hidden, attention_mask)


class LlamaEmbedding(nn.Module):
    """Llama's token embedding."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        embed = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        _attach(self, "model.embed_tokens", embed)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Any:
        return _boundary(self.model.embed_tokens(input_ids), attention_mask)


class Blocks(nn.Module):
    """Consecutive decoder blocks of one family (and the final norm in the last such stage)."""

    def __init__(self, family: Family, config: PretrainedConfig, layers: range, *, final_norm: bool) -> None:
        super().__init__()
        self.config = config
        self._paths = [f"{family.layers}.{i}" for i in layers]
        for path, i in zip(self._paths, layers):
            _attach(self, path, family.layer(config, i))
        self._norm = family.norm if final_norm else None
        if self._norm is not None:
            _attach(self, self._norm, family.final_norm(config))
        rotary = None
        if family.rotary is not None:
            with torch.device("cpu"):  # a constant of the config, built for real even on meta
                rotary = family.rotary(config)
        object.__setattr__(self, "_rotary", rotary)  # not a submodule (NOTE [What flows between stages])

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Any:
        position_ids = _positions(hidden)
        mask = _causal_mask(self.config, hidden, attention_mask, position_ids)
        side: dict[str, Any] = {}
        if self._rotary is not None:
            side["position_embeddings"] = self._rotary(hidden, position_ids)
        for path in self._paths:
            out = self.get_submodule(path)(hidden, attention_mask=mask, position_ids=position_ids, **side)
            hidden = out[0] if isinstance(out, tuple) else out
        if self._norm is not None:
            hidden = self.get_submodule(self._norm)(hidden)
        return _boundary(hidden, attention_mask)


class Head(nn.Module):
    """The LM head of an untied model: logits = hidden @ lm_head.weight^T."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        _attach(self, "lm_head", nn.Linear(config.hidden_size, config.vocab_size, bias=False))

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(hidden)


class TiedHead(nn.Module):
    """The LM head of a tied model: logits from the token embedding matrix, whose one parameter
    is named as in the embedding stage (a :class:`Tied` position on it)."""

    def __init__(self, config: PretrainedConfig, embed: str) -> None:
        super().__init__()
        self._embed = embed
        _attach(self, embed, nn.Embedding(config.vocab_size, config.hidden_size))

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(hidden, self.get_submodule(self._embed).weight)


# ---- families ------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Family:
    """Where one model family keeps its modules (checkpoint paths) and how to build them."""

    embedding: Callable[[PretrainedConfig], nn.Module]
    embed: str
    """Path of the token embedding (a tied head reuses its ``.weight``)."""
    layers: str
    """Path of the list of decoder blocks."""
    layer: Callable[[PretrainedConfig, int], nn.Module]
    norm: str
    """Path of the final norm."""
    final_norm: Callable[[PretrainedConfig], nn.Module]
    rotary: Callable[[PretrainedConfig], nn.Module] | None = None


def _gpt2() -> Family:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    return Family(
        embedding=GPT2Embedding,
        embed="transformer.wte",
        layers="transformer.h",
        layer=lambda config, i: GPT2Block(config, layer_idx=i),
        norm="transformer.ln_f",
        final_norm=lambda config: nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon),
    )


def _llama() -> Family:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

    return Family(
        embedding=LlamaEmbedding,
        embed="model.embed_tokens",
        layers="model.layers",
        layer=lambda config, i: LlamaDecoderLayer(config, i),
        norm="model.norm",
        final_norm=lambda config: LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps),
        rotary=LlamaRotaryEmbedding,
    )


FAMILIES: dict[str, Callable[[], Family]] = {"gpt2": _gpt2, "llama": _llama}
"""``config.model_type`` -> its family (built on first use: each imports its modeling file)."""


def family_of(config: PretrainedConfig) -> Family:
    make = FAMILIES.get(config.model_type)
    if make is None:
        raise ValueError(
            f"model type {config.model_type!r} is not supported; wstream.client.hf knows {sorted(FAMILIES)}"
        )
    if getattr(config, "add_cross_attention", False) or getattr(config, "is_encoder_decoder", False):
        raise ValueError("only decoder-only causal LMs are supported (this config has cross-attention)")
    return make()
