"""The stage modules of Hugging Face causal LMs (embedding, runs of decoder blocks, head) and the
structural rule that finds, in the model ``transformers`` builds for a config, the modules each
stage holds.

Apart from :mod:`wstream.client.hf` (configs, checkpoints, creating and exporting jobs) because
these are what a worker runs: the real ``transformers`` modules, wrapped so that a stage's
parameter names are the checkpoint's (NOTE [Stage parameters carry their checkpoint names] in
``hf.py``) and only hidden states, position ids and the mask flow between stages.

# NOTE [The structural rule]
# One rule splits every supported family; nothing is written per family but what the modules
# cannot show. The model is built for the config on the meta device (no memory) and read:
#   1. The token embedding is ``get_input_embeddings()`` (an ``nn.Embedding``, or a scaled one
#      that says its factor in ``scalar_embed_scale``: Gemma's sqrt(hidden)); the head is
#      ``get_output_embeddings()``, tied when its weight *is* the embedding's.
#   2. The blocks are the one ``nn.ModuleList`` of ``num_hidden_layers`` modules; its parent is
#      the *body* (``transformer``, ``model``, ``gpt_neox``, ``model.decoder``).
#   3. Every other child of the body has one role, by its kind: another embedding holds learned
#      positions (its ``offset`` added to the ids: OPT's 2); an ``nn.Dropout`` drops the embedding
#      stage's output; a ``*RotaryEmbedding`` gives the blocks cos/sin; ``project_in`` and
#      ``project_out`` are linears around the blocks (OPT); what holds parameters besides is the
#      final norm, of which there is at most one.
#   4. No other module holds parameters. A model that breaks a rule is refused, naming what was
#      found there (:class:`UnsupportedModel`).
# The chain is then [embedding (tokens, x scale, project_in, + positions, dropout), block stages
# (the last with the final norm and project_out), head (logits soft-capped where the config has
# ``final_logit_softcapping``) or a tied head on stage 0]. Blocks are called alike,
# ``block(hidden, attention_mask=mask, position_ids=positions[, position_embeddings=cos_sin])``,
# with each block's mask built by the function its model uses: ``create_causal_mask``, or
# ``create_sliding_window_causal_mask`` for a block that ``config.layer_types`` says is
# "sliding_attention" (Qwen2, Gemma2), or for all blocks when ``config.sliding_window`` is set
# without ``layer_types`` (Mistral, Phi-3). What the modules do not show is a :class:`Family`
# entry: OPT's positions counted from the padding mask and its mask built without position ids,
# GPT-NeoX's head saved as ``embed_out``. A model type without an entry is refused, because its
# forward was not read against this rule.
#
# NOTE [What flows between stages]
# A stage's inputs are ``hidden``, ``(hidden, position_ids)`` or ``(hidden, position_ids,
# attention_mask)``: the first stage takes ``input_ids``, ``(input_ids, attention_mask)`` or
# ``(input_ids, attention_mask, position_ids)`` (either may be None) and, when the caller gave
# either, hands on the position ids (batch, seq), as the model computes them when none were given,
# and the mask as bool: a 2D padding mask, or a 4D (batch, 1, seq, seq) one, True where a query
# may attend a key (packed documents: NOTE [Packed sequences]). The arity says what is there, so
# no None crosses a boundary. Everything else a block needs is computed inside each block stage
# from these, as the model's forward computes it: the causal (or sliding-window) masks and the
# rotary cos/sin. Recomputing them per stage costs little and keeps the boundary small and
# batch-major, so micro-batches split it. The rotary module is held outside the stage's module
# tree: its ``inv_freq`` is a constant of the config, not a streamed parameter (and a buffer
# would be refused by ``spec_of``).
#
# NOTE [Packed sequences]
# Several documents in one row, positions restarting at each, train as if each were alone when
# every block sees them apart. Two inputs say so, as ``transformers`` reads them:
#   1. ``position_ids`` alone (no mask): the mask builder finds where positions restart and makes
#      the causal mask block-diagonal (what flash-attention's varlen path does with them). OPT's
#      model builds its mask without position ids, so there this does not separate documents.
#   2. A 4D boolean mask (``block_causal_mask(position_ids)`` makes one), with the position ids:
#      used as it is by every family. For eager attention it is turned into the additive mask
#      eager attention adds (0 where True, the dtype's minimum elsewhere), as ``transformers``'
#      own eager masks are; sdpa takes it as it is. A float 4D mask is refused: it is ambiguous
#      (additive, or 0/1?) and would travel as a floating tensor, which wants a gradient.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoModelForCausalLM, PretrainedConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

FULL, SLIDING = "full_attention", "sliding_attention"


class UnsupportedModel(ValueError):
    """A config whose model wstream cannot split into stages (NOTE [The structural rule])."""


# ---- families ------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Family:
    """What one family does that its modules do not show (NOTE [The structural rule])."""

    positions_from_mask: bool = False
    """Without position ids, positions count the padding mask's ones (``cumsum(mask) - 1``), as
    OPT's decoder does, rather than 0..seq-1."""
    mask_sees_positions: bool = True
    """The model hands its position ids to the mask builder, which then finds packed documents in
    them (NOTE [Packed sequences], 1). OPT's does not."""
    saved_as: tuple[tuple[str, str], ...] = ()
    """(model prefix, checkpoint prefix): parameters ``save_pretrained`` writes under another name
    (GPT-NeoX's ``lm_head.weight`` is ``embed_out.weight`` in its checkpoints). The stage uses the
    checkpoint's name (NOTE [Stage parameters carry their checkpoint names] in ``hf.py``)."""

    def saved_name(self, name: str) -> str:
        """The checkpoint's name of model parameter ``name``."""
        for model, saved in self.saved_as:
            if name.startswith(model):
                return saved + name[len(model) :]
        return name

    def model_name(self, name: str) -> str:
        """The model's name of checkpoint tensor ``name`` (the inverse of :meth:`saved_name`)."""
        for model, saved in self.saved_as:
            if name.startswith(saved):
                return model + name[len(saved) :]
        return name


FAMILIES: dict[str, Family] = {
    "gpt2": Family(),
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(),
    "phi3": Family(),
    "gemma": Family(),
    "gemma2": Family(),
    "gpt_neox": Family(saved_as=(("lm_head.", "embed_out."),)),
    "opt": Family(positions_from_mask=True, mask_sees_positions=False),
}
"""``config.model_type`` -> what its modules do not show. Each one's forward was read against
NOTE [The structural rule] in the installed ``transformers``, and tests/test_hf.py checks it
against the model's own logits and training."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """Where one model keeps the parts of the structural rule: paths in the model, whose meta
    modules the stages take (NOTE [The structural rule])."""

    model: nn.Module
    """The whole model on the meta device; each stage takes its modules from it."""
    family: Family
    embed: str
    """The token embedding."""
    embed_scale: float | None
    """Its output is multiplied by this (Gemma: sqrt(hidden)), or not at all."""
    positions: str | None
    """A learned position embedding (GPT-2's ``wpe``, OPT's ``embed_positions``)."""
    position_offset: int
    """Added to the position ids before that embedding (OPT: 2)."""
    project_in: str | None
    dropout: str | None
    """A dropout on the embedding stage's output (GPT-2's ``drop``, GPT-NeoX's ``emb_dropout``)."""
    layers: str
    """The ``nn.ModuleList`` of decoder blocks."""
    norm: str | None
    project_out: str | None
    head: str
    tied: bool
    rotary: type[nn.Module] | None
    """The class of the model's rotary embedding, rebuilt for real per block stage."""
    kinds: tuple[str, ...]
    """Each block's attention: "full_attention" or "sliding_attention"."""

    @property
    def config(self) -> PretrainedConfig:
        config: PretrainedConfig = self.model.config
        return config


def default_attn_implementation(config: PretrainedConfig) -> str:
    """"sdpa" where the model supports it, else "eager" (Gemma2, whose attention soft-capping
    sdpa cannot do): fixed by the model class, not by what is installed."""
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return "sdpa" if model_class is None or getattr(model_class, "_supports_sdpa", False) else "eager"


def layout_of(config: PretrainedConfig) -> Layout:
    """The layout of ``config``'s causal LM (NOTE [The structural rule]), or
    :class:`UnsupportedModel` naming what breaks it. ``config._attn_implementation`` is the one
    the blocks run with (``hf.load_config`` sets it)."""
    if getattr(config, "add_cross_attention", False) or getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel("only decoder-only causal LMs are supported (this config has cross-attention)")
    family = FAMILIES.get(config.model_type)
    if family is None:
        raise UnsupportedModel(
            f"model type {config.model_type!r} is not supported; wstream.client.hf runs {sorted(FAMILIES)}. "
            "Another decoder-only family is a FAMILIES entry in client/hf_stages.py, once its model's forward "
            f"is checked against NOTE [The structural rule] there. {_describe(config)}"
        )
    if getattr(config, "layerdrop", 0.0):
        raise UnsupportedModel(
            f"{config.model_type} with layerdrop={config.layerdrop}: blocks skipped at random in training are not "
            "streamed; set config.layerdrop = 0"
        )
    attn = config._attn_implementation
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
        except ValueError as exc:
            if attn == "sdpa" and "scaled_dot_product_attention" in str(exc):
                raise UnsupportedModel(
                    f"{config.model_type} does not run with attn_implementation='sdpa' in transformers; "
                    "pass 'eager' (or leave it out: each model gets sdpa where it supports it, else eager)"
                ) from exc
            raise
    return _read(model, family)


def _describe(config: PretrainedConfig) -> str:
    """What the model of an unsupported type holds, for its error message."""
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        _read(model, Family())
    except UnsupportedModel as exc:
        return f"Its model would not split anyway: {exc}"
    except Exception as exc:  # noqa: BLE001 - only a description for an error message
        return f"(Its model could not be built to look at it: {type(exc).__name__}: {exc})"
    return "Its structure fits the rule; its position and mask handling were not checked."


def _read(model: nn.Module, family: Family) -> Layout:
    """Apply NOTE [The structural rule] to ``model`` (on meta)."""
    config = model.config
    name = type(model).__name__
    paths = {id(m): path for path, m in model.named_modules()}
    n = config.num_hidden_layers
    lists = [(path, m) for path, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    blocks = [path for path, m in lists if len(m) == n]
    if len(blocks) != 1:
        found = ", ".join(f"{p} ({len(m)} x {type(m[0]).__name__ if len(m) else '-'})" for p, m in lists) or "none"
        raise UnsupportedModel(
            f"{name}: wstream needs one ModuleList of the config's {n} decoder blocks; found {found}"
        )
    layers = blocks[0]
    body_path = layers.rpartition(".")[0]
    body = model.get_submodule(body_path)

    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if not isinstance(embedding, nn.Embedding) or id(embedding) not in paths:
        raise UnsupportedModel(f"{name}: its input embeddings are a {type(embedding).__name__}, not an nn.Embedding")
    scale = getattr(embedding, "scalar_embed_scale", None)
    if type(embedding) is not nn.Embedding and scale is None:
        raise UnsupportedModel(
            f"{name}: its token embedding is a {type(embedding).__name__} with its own forward (only nn.Embedding "
            "and scaled embeddings that say their scalar_embed_scale are known)"
        )
    if not isinstance(head, nn.Linear) or id(head) not in paths:
        raise UnsupportedModel(f"{name}: its output embeddings are a {type(head).__name__}, not an nn.Linear head")
    tied = head.weight is embedding.weight
    if tied and head.bias is not None:
        raise UnsupportedModel(f"{name}: a tied head with a bias")

    roles: dict[str, str | None] = {"positions": None, "dropout": None, "norm": None, "project_in": None, "project_out": None}
    rotary: type[nn.Module] | None = None
    others: list[str] = []
    norms: list[str] = []  # what else holds parameters: the final norm, if it is the only one
    for child_name, child in body.named_children():
        path = f"{body_path}.{child_name}"
        if child is embedding or path == layers:
            continue
        if isinstance(child, nn.Embedding) and roles["positions"] is None:
            roles["positions"] = path
        elif isinstance(child, nn.Dropout) and roles["dropout"] is None:
            roles["dropout"] = path
        elif type(child).__name__.endswith("RotaryEmbedding") and rotary is None and not list(child.parameters()):
            rotary = type(child)
        elif child_name in ("project_in", "project_out") and isinstance(child, nn.Linear):
            roles[child_name] = path
        elif not list(child.parameters()):
            others.append(f"{path} ({type(child).__name__}, no parameters)")
        else:
            norms.append(path)
    if len(norms) == 1 and "norm" in type(model.get_submodule(norms[0])).__name__.lower():
        roles["norm"] = norms[0]
    elif norms:
        others += [f"{p} ({type(model.get_submodule(p)).__name__})" for p in norms]
    if others:
        raise UnsupportedModel(
            f"{name}: around the blocks in {body_path} wstream knows a token embedding, learned positions, a dropout, "
            f"a rotary embedding, project_in/out and one final norm; it found {', '.join(others)} besides"
        )
    known = {paths[id(embedding)], paths[id(head)], layers, *(p for p in roles.values() if p is not None)}
    stray = [
        p for p, m in model.named_modules()
        if list(m.parameters(recurse=False)) and not any(p == k or p.startswith(k + ".") for k in known)
    ]
    if stray:
        raise UnsupportedModel(f"{name}: parameters outside the embeddings, blocks, final norm and head: {stray[:5]}")
    buffers = [b for b, _ in model.named_buffers() if not _is_rotary_or_scale(model, b, paths[id(embedding)])]
    if buffers:
        raise UnsupportedModel(f"{name}: buffers {buffers[:5]} (stages stream parameters only)")
    positions = roles["positions"]
    return Layout(
        model=model,
        family=family,
        embed=paths[id(embedding)],
        embed_scale=None if scale is None else float(scale),
        positions=positions,
        position_offset=int(getattr(model.get_submodule(positions), "offset", 0)) if positions else 0,
        project_in=roles["project_in"],
        dropout=roles["dropout"],
        layers=layers,
        norm=roles["norm"],
        project_out=roles["project_out"],
        head=paths[id(head)],
        tied=tied,
        rotary=rotary,
        kinds=_layer_kinds(config),
    )


def _is_rotary_or_scale(model: nn.Module, buffer: str, embed: str) -> bool:
    """Buffers the stages recompute: a rotary embedding's and a scaled embedding's factor."""
    owner = model.get_submodule(buffer.rpartition(".")[0])
    return type(owner).__name__.endswith("RotaryEmbedding") or buffer == f"{embed}.embed_scale"


def _layer_kinds(config: PretrainedConfig) -> tuple[str, ...]:
    """Each block's attention, as its model picks the mask (NOTE [The structural rule])."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types is not None:
        kinds = tuple(types[:n])
    elif getattr(config, "sliding_window", None) is not None:
        kinds = (SLIDING,) * n
    else:
        kinds = (FULL,) * n
    unknown = sorted(set(kinds) - {FULL, SLIDING})
    if unknown:
        raise UnsupportedModel(f"{config.model_type}: layer types {unknown} (wstream builds full and sliding-window masks)")
    return kinds


# ---- side inputs -----------------------------------------------------------------------------------
def _cache_arguments(fn: Callable[..., Any]) -> tuple[str, bool]:
    """The name of a mask builder's (empty) cache argument (``past_key_values`` until transformers
    5.2x renamed it ``cache``), and whether it wants ``cache_position`` (5.2 and 5.3)."""
    parameters = inspect.signature(fn).parameters
    return ("cache" if "cache" in parameters else "past_key_values"), "cache_position" in parameters


_MASK_FUNCTIONS = {FULL: create_causal_mask, SLIDING: create_sliding_window_causal_mask}
_MASK_CACHE = {kind: _cache_arguments(fn) for kind, fn in _MASK_FUNCTIONS.items()}


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    """The position ids a model computes for a sequence without a cache: (1, seq)."""
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def _mask(
    kind: str,
    config: PretrainedConfig,
    hidden: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> Any:
    """The mask a block of ``kind`` gets from the model's forward (None where sdpa's is_causal does)."""
    if attention_mask is not None and attention_mask.dim() == 4:  # used as it is (NOTE [Packed sequences], 2)
        if config._attn_implementation == "eager":
            zero = torch.zeros((), device=attention_mask.device, dtype=hidden.dtype)
            return torch.where(attention_mask, zero, torch.finfo(hidden.dtype).min)
        return attention_mask
    cache_arg, wants_cache_position = _MASK_CACHE[kind]
    extra: dict[str, Any] = {cache_arg: None}
    if wants_cache_position:
        extra["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
    if position_ids is not None:
        extra["position_ids"] = position_ids
    return _MASK_FUNCTIONS[kind](config=config, inputs_embeds=hidden, attention_mask=attention_mask, **extra)


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """The 4D boolean mask of packed documents: (batch, 1, seq, seq), True where query i may
    attend key j, that is j <= i in the same document, a document starting wherever the position
    ids do not go up by one (NOTE [Packed sequences]). ``position_ids``: (batch, seq)."""
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be (batch, seq), got shape {tuple(position_ids.shape)}")
    start = torch.ones_like(position_ids, dtype=torch.bool)
    start[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    document = start.cumsum(-1)
    seq = position_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=position_ids.device).tril()
    same = document[:, :, None] == document[:, None, :]
    return (same & causal)[:, None]


def _as_bool_mask(attention_mask: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The caller's mask as it crosses stages (NOTE [What flows between stages]): bool, 2D or 4D."""
    batch, seq = hidden.shape[:2]
    if attention_mask.dim() == 2:
        if tuple(attention_mask.shape) != (batch, seq):
            raise ValueError(f"attention_mask of shape {tuple(attention_mask.shape)} for input_ids of {(batch, seq)}")
        return attention_mask.bool()
    if attention_mask.dim() == 4:
        if attention_mask.shape[0] != batch or tuple(attention_mask.shape[2:]) != (seq, seq):
            raise ValueError(
                f"a 4D attention_mask must be (batch, 1, seq, seq) = {(batch, 1, seq, seq)}, got {tuple(attention_mask.shape)}"
            )
        if attention_mask.is_floating_point():
            raise ValueError(
                "a 4D attention_mask must be boolean (True where a query may attend a key; "
                "block_causal_mask(position_ids) makes one); an additive float mask m is `m == 0`"
            )
        return attention_mask.bool()
    raise ValueError(f"attention_mask must be (batch, seq) or (batch, 1, seq, seq), got shape {tuple(attention_mask.shape)}")


def _boundary(hidden: torch.Tensor, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> Any:
    """What a stage hands on (NOTE [What flows between stages])."""
    if position_ids is None:
        return hidden
    return (hidden, position_ids) if attention_mask is None else (hidden, position_ids, attention_mask)


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
        mask = None if attention_mask is None else _as_bool_mask(attention_mask, hidden)
        return _boundary(hidden, position_ids.expand(hidden.shape[0], -1), mask)

    def _default_positions(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The position ids the model computes when given none."""
        if not self._from_mask or attention_mask is None:
            return _positions(hidden)
        if attention_mask.dim() != 2:
            raise ValueError(
                "this family counts positions from a 2D padding mask; with a 4D attention_mask pass position_ids too"
            )
        return (torch.cumsum(attention_mask, dim=1) * attention_mask - 1).long()


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
        positions = _positions(hidden) if position_ids is None else position_ids
        seen = positions if self._mask_positions else None
        masks = {kind: _mask(kind, self.config, hidden, attention_mask, seen) for kind in dict.fromkeys(self._kinds)}
        side: dict[str, Any] = {}
        if self._rotary is not None:
            side["position_embeddings"] = self._rotary(hidden, positions)
        for path, kind in zip(self._paths, self._kinds):
            out = self.get_submodule(path)(hidden, attention_mask=masks[kind], position_ids=positions, **side)
            hidden = out[0] if isinstance(out, tuple) else out
        for path in self._after:
            hidden = self.get_submodule(path)(hidden)
        return _boundary(hidden, position_ids, attention_mask)


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


__all__ = [
    "FAMILIES",
    "Blocks",
    "Embedding",
    "Family",
    "Head",
    "Layout",
    "TiedHead",
    "UnsupportedModel",
    "block_causal_mask",
    "default_attn_implementation",
    "layout_of",
]
