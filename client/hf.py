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

Families: GPT-2, Llama, Mistral, Qwen2, Phi-3, Gemma, Gemma2, GPT-NeoX (Pythia) and OPT
(``FAMILIES`` in ``hf_layout.py``), split by one structural rule (NOTE [The structural rule]
there). The chain is [embedding, decoder blocks (one per stage, or ``blocks_per_stage``), the
final norm folded into the last block stage, head]. The blocks are the real ``transformers``
modules (``GPT2Block``, ``LlamaDecoderLayer``, ...), run with an explicit attention implementation
("sdpa" or "eager"; by default sdpa where the model supports it). Inputs may carry a padding
mask, position ids and 4D masks of packed documents (NOTE [Packed sequences] there).

# NOTE [Stage parameters carry their checkpoint names]
# Each stage registers its modules at their paths in the ``transformers`` model (empty container
# modules on the way), so the stage's parameter names *are* the checkpoint's tensor names:
# ``transformer.h.3.attn.c_attn.weight`` in the stage holding block 3. Loading reads exactly those
# names from the safetensors files, export writes the server's stages under the same names, and
# nothing maps names in between (a name ``save_pretrained`` writes differently from the model,
# GPT-NeoX's ``embed_out.weight`` for ``lm_head.weight``, is used as written: ``Family.saved_as``).
# A tied head (``tie_word_embeddings``) is a :class:`Tied`
# position on stage 0 whose only parameter is named like the token embedding, so the matrix is
# one parameter on the server, trained with the sum of both uses' gradients, and exported once
# (as ``save_pretrained`` writes tied weights).
#
# NOTE [The structural rule], [What flows between stages] and [Packed sequences] are in
# ``hf_layout.py``, with the structural rule.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional as F

try:
    from transformers import PretrainedConfig
except ImportError as exc:  # an optional extra
    raise ImportError(
        "wstream.client.hf needs transformers: pip install -e '.[hf]' in a checkout of wstream (the hf extra)"
    ) from exc

from safetensors import safe_open

from wstream.protocol import LayoutError

from .client import Client
from .hf_export import PulledStages, export_pretrained  # noqa: F401 - re-exported for users
from .hf_layout import Layout, layout_of
from .hf_layout import UnsupportedModel  # noqa: F401 - re-exported for users
from .hf_masks import block_causal_mask  # noqa: F401 - re-exported for users
from .hf_source import ATTN_IMPLEMENTATIONS, INDEX_FILE, SINGLE_FILE, Source, load_config, local_folder  # noqa: F401 - re-exported
from .hf_stages import Blocks, Embedding, Head, TiedHead
from .job_handle import Job
from .stages import Tied

log = logging.getLogger(__name__)

IGNORE_INDEX = -100


def _block_ranges(config: PretrainedConfig, blocks_per_stage: int) -> list[range]:
    if blocks_per_stage < 1:
        raise ValueError(f"blocks_per_stage must be >= 1, got {blocks_per_stage}")
    n = config.num_hidden_layers
    return [range(a, min(a + blocks_per_stage, n)) for a in range(0, n, blocks_per_stage)]


def _skeletons(layout: Layout, blocks_per_stage: int) -> Iterator[nn.Module | Tied]:
    """The chain on the meta device (NOTE [The structural rule] in ``hf_layout.py``): embedding,
    block stages, then the head (or a position tied to stage 0). Generated one at a time."""
    ranges = _block_ranges(layout.config, blocks_per_stage)
    yield _on_meta(lambda: Embedding(layout))
    for k, layers in enumerate(ranges):
        yield _on_meta(lambda: Blocks(layout, layers, final=k == len(ranges) - 1))
    if layout.tied:
        yield Tied(0, _on_meta(lambda: TiedHead(layout)))
    else:
        yield _on_meta(lambda: Head(layout))


def _on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` with parameters on the meta device. (Never yield inside the device context: the
    consumer's code would run in it.)"""
    with torch.device("meta"):
        return build()


def stages_from_pretrained(
    source: Source,
    *,
    blocks_per_stage: int = 1,
    attn_implementation: str | None = None,
    weights: bool | Literal["init"] | None = None,
    seed: int | None = None,
) -> Iterator[nn.Module | Tied]:
    """The stages of the causal LM in ``source``, one at a time, for ``Client.create_job`` (or,
    without weights, ``Client.attach_job``).

    ``source``: a ``save_pretrained`` folder or a config (without weights, also a hub repo id).
    ``weights`` (default: when ``source`` is a folder): each stage is built on the meta device,
    then materialized on the CPU and filled from the folder's safetensors files, reading only its
    own tensors, so one stage is in memory at a time (``create_job`` moves it to meta after
    uploading it). ``"init"``: a new model, to train from scratch: each stage materialized and
    initialized as the model's ``from_config`` initializes it (its ``_init_weights``: normal of the
    config's ``initializer_range``, norms at one, biases at zero), one at a time, from the RNG
    seeded with ``seed`` (None: as it stands); the draws differ from ``from_config``'s, which
    initializes the whole model at once. Without (False), the modules stay on the meta device: the
    layout a worker passes to ``attach_job``. ``blocks_per_stage``: decoder blocks per stage
    (fewer, larger transfers).
    ``attn_implementation``: "sdpa", "eager", or None for the model's default (:func:`load_config`).

    The folder, the config and the model's structure are checked when this is called (a missing
    folder, or a model that does not split, is named at once); the stages are built as they are
    iterated.
    """
    if weights is None:
        weights = not isinstance(source, PretrainedConfig)
    if weights == "init":
        layout = layout_of(load_config(source, attn_implementation=attn_implementation))
        return _initialized(layout, blocks_per_stage, seed)
    if weights is not True and weights is not False:
        raise ValueError(f"weights must be True, False, 'init' or None, got {weights!r}")
    if not weights:
        layout = layout_of(load_config(source, attn_implementation=attn_implementation))
        return _skeletons(layout, blocks_per_stage)
    if isinstance(source, PretrainedConfig):
        raise ValueError("weights=True needs a folder with safetensors weights, not a config")
    folder = local_folder(source)
    layout = layout_of(load_config(folder, attn_implementation=attn_implementation))
    return _filled(layout, blocks_per_stage, Checkpoint(folder, model_name=layout.family.model_name))


def _initialized(layout: Layout, blocks_per_stage: int, seed: int | None) -> Iterator[nn.Module | Tied]:
    """The chain's stages materialized on the CPU and initialized by the model's own
    ``_init_weights``, one at a time, from the RNG seeded with ``seed`` when the first is built."""
    if seed is not None:
        torch.manual_seed(seed)
    yield from _materialized(layout, blocks_per_stage, lambda stage: _init_weights(layout, stage))


def _init_weights(layout: Layout, stage: nn.Module) -> None:
    """``stage``'s tensors by the model's ``_init_weights``. A tensor it leaves untouched
    (NaN-filled first) is refused by name rather than trained from whatever memory held."""
    with torch.no_grad():
        for t in (*stage.parameters(), *stage.buffers()):
            if t.is_floating_point():
                t.fill_(float("nan"))
        stage.apply(layout.model._init_weights)
    left = [n for n, t in (*stage.named_parameters(), *stage.named_buffers()) if t.is_floating_point() and t.isnan().any()]
    if left:
        raise UnsupportedModel(
            f"{type(layout.model).__name__}._init_weights left {left[:3]} uninitialized: save the model with "
            "save_pretrained and create the job from that folder"
        )


def _filled(layout: Layout, blocks_per_stage: int, checkpoint: Checkpoint) -> Iterator[nn.Module | Tied]:
    """The chain's stages materialized on the CPU and filled from ``checkpoint``, one at a time."""
    return _materialized(layout, blocks_per_stage, checkpoint.fill)


def _materialized(layout: Layout, blocks_per_stage: int, fill: Callable[[nn.Module], object]) -> Iterator[nn.Module | Tied]:
    """The chain's stages, each materialized on the CPU (uninitialized fp32) and ``fill``-ed, one
    at a time; a :class:`Tied` position as it is."""
    for item in _skeletons(layout, blocks_per_stage):
        if not isinstance(item, Tied):
            item.to_empty(device="cpu")
            fill(item)
        yield item


# ---- reading checkpoints ---------------------------------------------------------------------------
class Checkpoint:
    """The safetensors weights of a ``save_pretrained`` folder: ``model.safetensors``, or the
    shards ``model.safetensors.index.json`` names. Only the tensors asked for are read.
    ``model_name``: a stage name as the model says it, for checkpoints that use the model's names
    where ``save_pretrained`` writes others (``Family.model_name``)."""

    def __init__(self, folder: Path, *, model_name: Callable[[str], str] = str) -> None:
        self.folder = folder
        self._model_name = model_name
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
        for name in dict.fromkeys((param, self._model_name(param))):
            if name in self.files:
                return name
            bare = name.split(".", 1)[1] if "." in name else name
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
    folder: str | os.PathLike[str] | PretrainedConfig,
    *,
    token: str | None = None,
    blocks_per_stage: int = 1,
    attn_implementation: str | None = None,
    seed: int | None = None,
    **options: Any,
) -> Job:
    """Create job ``name`` from the model in ``folder``, uploading one stage at a time (see
    :func:`stages_from_pretrained`). Given a config instead of a folder: a new model, initialized
    stage by stage (``weights="init"``, from ``seed``), to train from scratch. ``options`` go to
    ``Client.create_job`` (``optimizer``, ``dtype``, ``progress``, ...); ``token`` too (default
    ``$WSTREAM_TOKEN``)."""
    new = isinstance(folder, PretrainedConfig)
    stages = stages_from_pretrained(
        folder, blocks_per_stage=blocks_per_stage, attn_implementation=attn_implementation,
        weights="init" if new else True, seed=seed,
    )
    job = client.create_job(name, stages, token=token, **options)
    source = f"a new {folder.model_type} model" if new else folder
    log.info("job %r created from %s: %d stages, %d positions", name, source, job.num_stages, len(job.positions or ()))
    return job


def attach_job_from_pretrained(
    client: Client,
    name: str,
    source: Source,
    *,
    token: str | None = None,
    blocks_per_stage: int = 1,
    attn_implementation: str | None = None,
) -> Job:
    """Attach another worker to a job made by :func:`create_job_from_pretrained` (same
    ``blocks_per_stage``); only the config is read, no weights. ``token``: default ``$WSTREAM_TOKEN``."""
    stages = stages_from_pretrained(
        source, blocks_per_stage=blocks_per_stage, attn_implementation=attn_implementation, weights=False
    )
    return client.attach_job(name, token=token, stages=stages)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss ``transformers`` computes for ``model(input_ids, labels=labels)``: position t
    predicts label t + 1, labels of -100 are ignored, the mean over the rest (per micro-batch)."""
    logits = logits[..., :-1, :].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[..., 1:].reshape(-1), ignore_index=IGNORE_INDEX)
