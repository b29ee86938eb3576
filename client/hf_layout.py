"""Which modules of a Hugging Face causal LM each stage holds: the structural rule read off the
model ``transformers`` builds for a config (on the meta device), and the few things per family its
modules do not show (:data:`FAMILIES`). The stage modules built from a :class:`Layout` are in
:mod:`wstream.client.hf_stages`; the inputs that flow between them in
:mod:`wstream.client.hf_masks`.

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoModelForCausalLM, PretrainedConfig

FULL, SLIDING = "full_attention", "sliding_attention"
"""A block's attention, as ``config.layer_types`` names it."""


class UnsupportedModel(ValueError):
    """A config whose model wstream cannot split into stages (NOTE [The structural rule])."""


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
            "Another decoder-only family is a FAMILIES entry in client/hf_layout.py, once its model's forward "
            f"is checked against NOTE [The structural rule] there. {_describe(config)}"
        )
    if getattr(config, "layerdrop", 0.0):
        raise UnsupportedModel(
            f"{config.model_type} with layerdrop={config.layerdrop}: blocks skipped at random in training are not "
            "streamed; set config.layerdrop = 0"
        )
    attn = config._attn_implementation
    with torch.device("meta"):
        try:  # fp32 modules whatever dtype the config names (transformers builds in it): a job's master is fp32
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
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
