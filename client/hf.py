"""Hugging Face ``transformers`` causal LMs as wstream jobs: create from a ``save_pretrained``
folder without materializing the model, train, export back to a folder ``from_pretrained`` loads.

```python
from wstream.client import Client, AdamW
from wstream.client.hf import causal_lm_loss, create_job_from_pretrained, export_pretrained

job = create_job_from_pretrained(client, "ft", "path/to/model", token="secret", optimizer=AdamW(lr=1e-5))
with job.trainer() as trainer:
    for input_ids in batches:
        trainer.step(input_ids, input_ids, causal_lm_loss)   # labels = inputs, as model(..., labels=)
export_pretrained(job, "path/to/out", "path/to/model")
```

Families: GPT-2 (``gpt2``) and Llama (``llama``). The chain is [embedding, decoder blocks (one per
stage, or ``blocks_per_stage``), the final norm folded into the last block stage, head]. The
blocks are the real ``transformers`` modules (``GPT2Block``, ``LlamaDecoderLayer``), run with an
explicit attention implementation ("sdpa" or "eager").

# NOTE [Stage parameters carry their checkpoint names]
# Each stage registers its modules at their paths in the ``transformers`` model (empty container
# modules on the way), so the stage's parameter names *are* the checkpoint's tensor names:
# ``transformer.h.3.attn.c_attn.weight`` in the stage holding block 3. Loading reads exactly those
# names from the safetensors files, export writes the server's stages under the same names, and
# nothing maps names in between. A tied head (``tie_word_embeddings``) is a :class:`Tied`
# position on stage 0 whose only parameter is named like the token embedding, so the matrix is
# one parameter on the server, trained with the sum of both uses' gradients, and exported once
# (as ``save_pretrained`` writes tied weights).
#
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

import copy
import inspect
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch
from torch import nn
from torch.nn import functional as F

try:
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
    from transformers.masking_utils import create_causal_mask
except ImportError as exc:  # an optional extra
    raise ImportError("wstream.client.hf needs transformers: pip install 'wstream[hf]'") from exc

from safetensors import safe_open
from safetensors.torch import save_file

from wstream.protocol import LayoutError, parse_size
from wstream.protocol.layout import numel_of

from .chain import progress_bar
from .client import Client, Job
from .stages import Tied

log = logging.getLogger(__name__)

Source = Union[str, "os.PathLike[str]", PretrainedConfig]
"""A ``save_pretrained`` folder (``config.json`` and safetensors weights) or a config."""

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
IGNORE_INDEX = -100


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


def _family(config: PretrainedConfig) -> Family:
    make = FAMILIES.get(config.model_type)
    if make is None:
        raise ValueError(
            f"model type {config.model_type!r} is not supported; wstream.client.hf knows {sorted(FAMILIES)}"
        )
    if getattr(config, "add_cross_attention", False) or getattr(config, "is_encoder_decoder", False):
        raise ValueError("only decoder-only causal LMs are supported (this config has cross-attention)")
    return make()


# ---- configs and the chain -----------------------------------------------------------------------
def load_config(source: Source, *, attn_implementation: str = "sdpa") -> PretrainedConfig:
    """A copy of ``source``'s config (read from ``config.json`` for a folder) that runs with
    ``attn_implementation`` ("sdpa" or "eager", explicit so results do not depend on what is
    installed)."""
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {attn_implementation!r}")
    if isinstance(source, PretrainedConfig):
        config = copy.deepcopy(source)
    else:
        config = AutoConfig.from_pretrained(os.fspath(source))
    config._attn_implementation = attn_implementation
    return config


def _tied(config: PretrainedConfig) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False))


def _block_ranges(config: PretrainedConfig, blocks_per_stage: int) -> list[range]:
    if blocks_per_stage < 1:
        raise ValueError(f"blocks_per_stage must be >= 1, got {blocks_per_stage}")
    n = config.num_hidden_layers
    return [range(a, min(a + blocks_per_stage, n)) for a in range(0, n, blocks_per_stage)]


def _skeletons(config: PretrainedConfig, blocks_per_stage: int) -> Iterator[nn.Module | Tied]:
    """The chain on the meta device: embedding, block stages, then the head (or a position tied
    to stage 0). Generated one at a time."""
    family = _family(config)
    ranges = _block_ranges(config, blocks_per_stage)
    yield _on_meta(lambda: family.embedding(config))
    for k, layers in enumerate(ranges):
        yield _on_meta(lambda: Blocks(family, config, layers, final_norm=k == len(ranges) - 1))
    if _tied(config):
        yield Tied(0, _on_meta(lambda: TiedHead(config, family.embed)))
    else:
        yield _on_meta(lambda: Head(config))


def _on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` with parameters on the meta device. (Never yield inside the device context: the
    consumer's code would run in it.)"""
    with torch.device("meta"):
        return build()


def stages_from_pretrained(
    source: Source,
    *,
    blocks_per_stage: int = 1,
    attn_implementation: str = "sdpa",
    weights: bool | None = None,
) -> Iterator[nn.Module | Tied]:
    """The stages of the causal LM in ``source``, one at a time, for ``Client.create_job`` (or,
    without weights, ``Client.attach_job``).

    ``source``: a ``save_pretrained`` folder or a config. ``weights`` (default: when ``source`` is
    a folder): each stage is built on the meta device, then materialized on the CPU and filled
    from the folder's safetensors files, reading only its own tensors, so one stage is in memory
    at a time (``create_job`` moves it to meta after uploading it). Without, the modules stay on
    the meta device: the layout a worker passes to ``attach_job``.
    ``blocks_per_stage``: decoder blocks per stage (fewer, larger transfers).
    """
    config = load_config(source, attn_implementation=attn_implementation)
    if weights is None:
        weights = not isinstance(source, PretrainedConfig)
    if not weights:
        yield from _skeletons(config, blocks_per_stage)
        return
    if isinstance(source, PretrainedConfig):
        raise ValueError("weights=True needs a folder with safetensors weights, not a config")
    checkpoint = Checkpoint(Path(source))
    for item in _skeletons(config, blocks_per_stage):
        if isinstance(item, Tied):
            yield item
            continue
        item.to_empty(device="cpu")  # uninitialized fp32: every tensor is filled next
        checkpoint.fill(item)
        yield item


# ---- reading checkpoints ---------------------------------------------------------------------------
class Checkpoint:
    """The safetensors weights of a ``save_pretrained`` folder: ``model.safetensors``, or the
    shards ``model.safetensors.index.json`` names. Only the tensors asked for are read."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        index = folder / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: folder / file for name, file in weight_map.items()}
        elif (folder / SINGLE_FILE).exists():
            with safe_open(folder / SINGLE_FILE, framework="pt") as f:
                self.files = {name: folder / SINGLE_FILE for name in f.keys()}
        else:
            raise FileNotFoundError(
                f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}; only safetensors checkpoints are read "
                "(load a .bin checkpoint with transformers once and save_pretrained it)"
            )

    def name_of(self, param: str) -> str:
        """The checkpoint's name for stage parameter ``param``: the same, or without the base
        model's prefix (checkpoints of a bare ``GPT2Model`` say ``h.0...`` for ``transformer.h.0...``)."""
        if param in self.files:
            return param
        bare = param.split(".", 1)[1] if "." in param else param
        if bare in self.files:
            return bare
        raise LayoutError(f"tensor {param!r} is not in the checkpoint in {self.folder}")

    def fill(self, module: nn.Module) -> None:
        """Copy every parameter of ``module`` (materialized) from the checkpoint, file by file."""
        by_file: dict[Path, list[tuple[str, nn.Parameter]]] = {}
        for name, param in module.named_parameters():
            key = self.name_of(name)
            by_file.setdefault(self.files[key], []).append((key, param))
        for path, wanted in by_file.items():
            with safe_open(path, framework="pt", device="cpu") as f:
                for key, param in wanted:
                    tensor = f.get_tensor(key)
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise LayoutError(
                            f"{key} has shape {tuple(tensor.shape)} in {path.name}, the config makes it {tuple(param.shape)}"
                        )
                    with torch.no_grad():
                        param.copy_(tensor)


# ---- jobs ----------------------------------------------------------------------------------------
def create_job_from_pretrained(
    client: Client,
    name: str,
    folder: str | os.PathLike[str],
    *,
    token: str,
    blocks_per_stage: int = 1,
    attn_implementation: str = "sdpa",
    **options: Any,
) -> Job:
    """Create job ``name`` from the model in ``folder``, uploading one stage at a time (see
    :func:`stages_from_pretrained`). ``options`` go to ``Client.create_job`` (``optimizer``,
    ``dtype``, ``progress``, ...)."""
    stages = stages_from_pretrained(folder, blocks_per_stage=blocks_per_stage, attn_implementation=attn_implementation)
    job = client.create_job(name, stages, token=token, **options)
    log.info("job %r created from %s: %d stages, %d positions", name, folder, job.num_stages, len(job.positions or ()))
    return job


def attach_job_from_pretrained(
    client: Client,
    name: str,
    source: Source,
    *,
    token: str,
    blocks_per_stage: int = 1,
    attn_implementation: str = "sdpa",
) -> Job:
    """Attach another worker to a job made by :func:`create_job_from_pretrained` (same
    ``blocks_per_stage``); only the config is read, no weights."""
    stages = stages_from_pretrained(
        source, blocks_per_stage=blocks_per_stage, attn_implementation=attn_implementation, weights=False
    )
    return client.attach_job(name, token=token, stages=stages)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss ``transformers`` computes for ``model(input_ids, labels=labels)``: position t
    predicts label t + 1, labels of -100 are ignored, the mean over the rest (per micro-batch)."""
    logits = logits[..., :-1, :].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[..., 1:].reshape(-1), ignore_index=IGNORE_INDEX)


# ---- export --------------------------------------------------------------------------------------
def export_pretrained(
    job: Job,
    folder: str | os.PathLike[str],
    config: Source,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype = torch.float32,
    progress: bool | None = None,
) -> Path:
    """Write the job's current weights as a ``save_pretrained`` folder that
    ``AutoModelForCausalLM.from_pretrained(folder)`` loads: ``config.json`` and
    ``model.safetensors`` (or shards of at most ``max_shard_size`` and their index).

    ``config``: the model's config, or the folder the job was created from (then its tokenizer
    and generation files are copied too). Stages are pulled one at a time and each shard is
    written once complete, so memory holds about a shard and a stage. Tied weights are written
    once, as ``save_pretrained`` does. ``dtype``: of the written tensors (the master is fp32).
    """
    out = Path(folder)
    stale = sorted(p.name for p in out.glob("model*.safetensors*"))
    if stale:
        raise FileExistsError(f"{out} already holds weights ({', '.join(stale[:3])}); export into an empty folder")
    cfg = copy.deepcopy(config) if isinstance(config, PretrainedConfig) else load_config(config)
    architecture = _check_names(job, cfg)
    out.mkdir(parents=True, exist_ok=True)
    shards = _plan_shards(job, parse_size(max_shard_size), dtype.itemsize)
    files = _shard_files(len(shards))
    with progress_bar(progress, job.num_params, f"exporting {job.name}") as bar:
        pending: dict[str, torch.Tensor] = {}
        shard = 0
        for stage in range(job.num_stages):
            pending.update((name, t.to(dtype)) for name, t in job.pull_stage(stage).items())
            bar.update(job.specs[stage].numel)
            while shard < len(shards) and shards[shard].keys() <= pending.keys():
                save_file({k: pending.pop(k).contiguous() for k in shards[shard]}, out / files[shard], metadata={"format": "pt"})
                shard += 1
    if len(shards) > 1:
        weight_map = {name: files[k] for k, names in enumerate(shards) for name in names}
        total = sum(numel_of(p.shape) for s in job.specs for p in s.params) * dtype.itemsize
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    if dtype != torch.float32:
        cfg.dtype = dtype
    if not getattr(cfg, "architectures", None):  # as save_pretrained records the model class
        cfg.architectures = [architecture]
    cfg.save_pretrained(out)
    if not isinstance(config, PretrainedConfig):
        _copy_extras(Path(config), out)
    log.info("exported job %r to %s (%d file%s)", job.name, out, len(shards), "" if len(shards) == 1 else "s")
    return out


def _check_names(job: Job, config: PretrainedConfig) -> str:
    """Refuse a job whose parameter names are not the model's (each once; a tied alias absent).
    Returns the model's class name."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    want = {name for name, _ in model.named_parameters()}  # tied aliases are left out
    got = [p.name for s in job.specs for p in s.params]
    extra, missing = sorted(set(got) - want), sorted(want - set(got))
    if extra or missing or len(got) != len(set(got)):
        raise LayoutError(
            f"job {job.name!r} does not hold a {config.model_type} model of this config: "
            f"{len(missing)} missing (e.g. {missing[:3]}), {len(extra)} unknown (e.g. {extra[:3]})"
        )
    return type(model).__name__


def _plan_shards(job: Job, max_bytes: int, itemsize: int) -> list[dict[str, None]]:
    """Tensor names per file, in stage order, each file at most ``max_bytes`` (unless one tensor
    alone is larger), as ``save_pretrained`` cuts them."""
    shards: list[dict[str, None]] = [{}]
    size = 0
    for spec in job.specs:
        for p in spec.params:
            nbytes = numel_of(p.shape) * itemsize
            if shards[-1] and size + nbytes > max_bytes:
                shards.append({})
                size = 0
            shards[-1][p.name] = None
            size += nbytes
    return shards


def _shard_files(n: int) -> list[str]:
    if n == 1:
        return [SINGLE_FILE]
    return [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


def _copy_extras(source: Path, out: Path) -> None:
    """Copy the source folder's other files (tokenizer, generation config, ...), not its weights."""
    for path in source.iterdir():
        name = path.name
        if not path.is_file() or name == "config.json" or name.endswith(WEIGHT_SUFFIXES) or ".index.json" in name:
            continue
        if (out / name).exists():
            continue
        shutil.copy2(path, out / name)
