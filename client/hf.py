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

import copy
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, Protocol, Union

import torch
from torch import nn
from torch.nn import functional as F

try:
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
except ImportError as exc:  # an optional extra
    raise ImportError(
        "wstream.client.hf needs transformers: pip install -e '.[hf]' in a checkout of wstream (the hf extra)"
    ) from exc

from safetensors import safe_open
from safetensors.torch import save_file

from wstream.protocol import LayoutError, ParamSpec, StageSpec, parse_size
from wstream.protocol.layout import numel_of

from .chain import progress_bar
from .client import Client
from .job_handle import Job, read_in_one_step
from .hf_layout import FAMILIES, Layout, default_attn_implementation, layout_of
from .hf_layout import UnsupportedModel  # noqa: F401 - re-exported for users
from .hf_masks import block_causal_mask  # noqa: F401 - re-exported for users
from .hf_stages import Blocks, Embedding, Head, TiedHead
from .stages import DTYPE_OF_BUFFER, Tied

log = logging.getLogger(__name__)

Source = Union[str, "os.PathLike[str]", PretrainedConfig]
"""A ``save_pretrained`` folder (``config.json`` and safetensors weights) or a config."""

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
"""The attention implementations a job may run with; None picks per model
(:func:`~wstream.client.hf_layout.default_attn_implementation`)."""
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
IGNORE_INDEX = -100


# ---- where a model is: a local folder or the hub ---------------------------------------------------
# NOTE [Local folders before the hub]
# ``transformers`` takes a name that is not a folder for a hub repo id and asks the hub, retrying
# for about 25 s without network, so a mistyped folder used to end in a connection error. Here:
#   1. Weights are read from a local folder only (:class:`Checkpoint`), so creating a job, and
#      exporting next to a source folder, check the folder first and name it when it is missing.
#   2. A config alone (``attach_job_from_pretrained``) may come from the hub, but only for a name
#      that can be nothing else: not a path object, not absolute or starting with ``.`` or ``~``,
#      a valid ``namespace/name`` id, and not under a folder that exists here ("models/gtp2"
#      where ./models exists is a typo of a local folder).
#   3. ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as set when called (``huggingface_hub``
#      reads it once, at import): the hub is not asked; a hub id must be in the local cache.

_TRUE = {"1", "ON", "YES", "TRUE"}


def hub_offline() -> bool:
    """Whether ``$HF_HUB_OFFLINE`` or ``$TRANSFORMERS_OFFLINE`` is set now (or was when
    ``huggingface_hub`` was imported)."""
    from huggingface_hub import constants

    now = any(os.environ.get(name, "").strip().upper() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return now or bool(constants.HF_HUB_OFFLINE)


def looks_local(source: str | os.PathLike[str]) -> bool:
    """Whether ``source`` can only mean a folder on this machine, not a hub repo id (NOTE above, 2)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(source, str):
        return True
    if os.path.isabs(source) or source.startswith((".", "~")):
        return True
    head, sep, _ = source.replace(os.sep, "/").partition("/")
    if sep and os.path.isdir(head):
        return True
    try:
        validate_repo_id(source)
    except HFValidationError:
        return True
    return False


def local_folder(source: str | os.PathLike[str]) -> Path:
    """``source`` as a ``save_pretrained`` folder on this machine (``~`` expanded): it must exist
    and hold ``config.json``; ``FileNotFoundError`` names it otherwise, without asking the hub."""
    folder = Path(os.path.expanduser(os.fspath(source)))
    if not folder.is_dir():
        if looks_local(source):
            raise FileNotFoundError(
                f"{os.fspath(source)}: no such folder (a save_pretrained folder, with config.json and safetensors "
                "weights, was expected)"
            )
        raise FileNotFoundError(
            f"{os.fspath(source)}: no such folder; wstream reads a local save_pretrained folder (config.json and "
            f"safetensors weights), not the hub: download the model first "
            f"(huggingface_hub.snapshot_download({os.fspath(source)!r}) returns its folder) and give that folder"
        )
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{os.fspath(source)} is a folder without config.json: not a save_pretrained folder")
    return folder


def _config_location(source: str | os.PathLike[str]) -> tuple[str, bool]:
    """Where :func:`load_config` reads ``source``'s config: a local folder (checked), or a hub id;
    and whether the hub may not be asked (offline: its cache only)."""
    if looks_local(source) or Path(os.path.expanduser(os.fspath(source))).is_dir():
        return os.fspath(local_folder(source)), True
    name = os.fspath(source)
    if not hub_offline():
        return name, False
    from huggingface_hub import constants, try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(name, "config.json"), str):
        raise FileNotFoundError(
            f"{name} is not a local folder and HF_HUB_OFFLINE is set: the hub is not asked, and its cache "
            f"({constants.HF_HUB_CACHE}) holds no config of {name}"
        )
    return name, True


# ---- configs and the chain -----------------------------------------------------------------------
def load_config(source: Source, *, attn_implementation: str | None = None) -> PretrainedConfig:
    """A copy of ``source``'s config (read from ``config.json`` for a folder, or a hub repo id's
    when ``source`` can only be one: NOTE [Local folders before the hub]) that runs with
    ``attn_implementation``: "sdpa" or "eager", explicit so results do not depend on what is
    installed; None: "sdpa" where the model class supports it, else "eager" (Gemma2)."""
    if attn_implementation is not None and attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {attn_implementation!r}")
    if isinstance(source, PretrainedConfig):
        config = copy.deepcopy(source)
    else:
        where, local_only = _config_location(source)
        config = AutoConfig.from_pretrained(where, local_files_only=local_only)
    config._attn_implementation = attn_implementation or default_attn_implementation(config)
    return config


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


# ---- export --------------------------------------------------------------------------------------
class PulledStages(Protocol):
    """What an export reads of a job: a :class:`Job`, or its stages with adapters merged in
    (``wstream.client.lora.MergedStages``)."""

    name: str
    specs: list[StageSpec]

    @property
    def num_stages(self) -> int: ...
    @property
    def num_params(self) -> int: ...
    def pull_stage_versioned(self, stage: int) -> tuple[Any, dict[str, torch.Tensor]]: ...


def export_pretrained(
    job: PulledStages,
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
    once, as ``save_pretrained`` does. ``dtype``: of the written tensors (the master is fp32);
    the config records it (``dtype``), replacing the source's, so that ``from_pretrained`` loads
    the tensors as written. Every tensor written is of one step of the job: read while it trains,
    the export starts again when the job moves on (``StateError`` if it keeps moving on).
    """
    out = Path(folder)
    stale = sorted(p.name for p in out.glob("model*.safetensors*"))
    if stale:
        raise FileExistsError(f"{out} already holds weights ({', '.join(stale[:3])}); export into an empty folder")
    if not isinstance(config, PretrainedConfig):  # its other files are copied: a local folder
        config = local_folder(config)
    cfg = copy.deepcopy(config) if isinstance(config, PretrainedConfig) else load_config(config)
    architecture = _check_names(job, cfg)
    out.mkdir(parents=True, exist_ok=True)
    shards = _plan_shards(job, parse_size(max_shard_size), dtype.itemsize)
    files = _shard_files(len(shards))
    with progress_bar(progress, job.num_params, f"exporting {job.name}") as bar:
        pending: dict[str, torch.Tensor] = {}
        shard = 0

        def use(stage: int, tensors: dict[str, torch.Tensor]) -> None:
            nonlocal shard
            pending.update((name, _written(t, dtype)) for name, t in tensors.items())
            bar.update(job.specs[stage].numel)
            while shard < len(shards) and shards[shard].keys() <= pending.keys():
                save_file({k: pending.pop(k).contiguous() for k in shards[shard]}, out / files[shard], metadata={"format": "pt"})
                shard += 1

        def start_over() -> None:  # the job moved on under the export: nothing of the older step is kept
            nonlocal shard
            for name in files[:shard]:
                (out / name).unlink(missing_ok=True)
            pending.clear()
            shard = 0
            bar.reset()

        try:
            read_in_one_step(job.pull_stage_versioned, range(job.num_stages), job.name, use, start_over)
        except BaseException:
            start_over()  # no weights of a failed export are left to be taken for a whole one
            raise
    if len(shards) > 1:
        weight_map = {name: files[k] for k, names in enumerate(shards) for name in names}
        total = sum(_nbytes(p, dtype.itemsize) for s in job.specs for p in s.params)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    # the dtype of the tensors written, whatever the source said: from_pretrained loads in the
    # config's dtype by default, and fp32 weights under a bfloat16 label would be rounded silently
    cfg.dtype = dtype
    if not getattr(cfg, "architectures", None):  # as save_pretrained records the model class
        cfg.architectures = [architecture]
    cfg.save_pretrained(out)
    if not isinstance(config, PretrainedConfig):
        _copy_extras(Path(config), out)
    log.info("exported job %r to %s (%d file%s)", job.name, out, len(shards), "" if len(shards) == 1 else "s")
    return out


def _check_names(job: PulledStages, config: PretrainedConfig) -> str:
    """Refuse a job whose parameter names are not the model's (each once; a tied alias absent).
    Returns the model's class name."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    family = FAMILIES.get(config.model_type)
    saved = family.saved_name if family is not None else str
    want = {saved(name) for name, _ in model.named_parameters()}  # as saved; tied aliases are left out
    state = model.state_dict()
    want |= {saved(name) for name, _ in model.named_buffers() if name in state}  # persistent buffers
    got = [p.name for s in job.specs for p in s.params]
    extra, missing = sorted(set(got) - want), sorted(want - set(got))
    if extra or missing or len(got) != len(set(got)):
        raise LayoutError(
            f"job {job.name!r} does not hold a {config.model_type} model of this config: "
            f"{len(missing)} missing (e.g. {missing[:3]}), {len(extra)} unknown (e.g. {extra[:3]})"
        )
    return type(model).__name__


def _plan_shards(job: PulledStages, max_bytes: int, itemsize: int) -> list[dict[str, None]]:
    """Tensor names per file, in stage order, each file at most ``max_bytes`` (unless one tensor
    alone is larger), as ``save_pretrained`` cuts them."""
    shards: list[dict[str, None]] = [{}]
    size = 0
    for spec in job.specs:
        for p in spec.params:
            nbytes = _nbytes(p, itemsize)
            if shards[-1] and size + nbytes > max_bytes:
                shards.append({})
                size = 0
            shards[-1][p.name] = None
            size += nbytes
    return shards


def _written(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A pulled tensor as the export writes it: floating point in ``dtype``, an integer buffer as
    it is (``stage_tensors`` gave it its own dtype)."""
    return t.to(dtype) if t.is_floating_point() else t


def _nbytes(p: ParamSpec, itemsize: int) -> int:
    """Bytes the export writes for ``p``: ``itemsize`` per element, an integer buffer's own."""
    if p.buffer:
        dtype = DTYPE_OF_BUFFER[p.buffer]
        if not dtype.is_floating_point:
            return numel_of(p.shape) * dtype.itemsize
    return numel_of(p.shape) * itemsize


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
