"""A job's weights written back as a ``save_pretrained`` folder that
``AutoModelForCausalLM.from_pretrained`` loads (:func:`export_pretrained`; re-exported by
:mod:`wstream.client.hf`): the stages' parameter names are the checkpoint's (NOTE [Stage parameters
carry their checkpoint names] in hf.py), so nothing is renamed; tensors of one step, shards cut as
``save_pretrained`` cuts them, the source folder's tokenizer files copied.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, PretrainedConfig

from wstream.protocol import LayoutError, ParamSpec, StageSpec, parse_size
from wstream.protocol.layout import numel_of

from .chain import progress_bar
from .hf_layout import FAMILIES
from .hf_source import INDEX_FILE, SINGLE_FILE, Source, load_config, local_folder
from .job_handle import read_in_one_step
from .stages import DTYPE_OF_BUFFER

log = logging.getLogger(__name__)

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
    dtype: torch.dtype | str = torch.float32,
    progress: bool | None = None,
) -> Path:
    """Write the job's current weights as a ``save_pretrained`` folder that
    ``AutoModelForCausalLM.from_pretrained(folder)`` loads: ``config.json`` and
    ``model.safetensors`` (or shards of at most ``max_shard_size`` and their index).

    ``config``: the model's config, or the folder the job was created from (then its tokenizer
    and generation files are copied too). Stages are pulled one at a time and each shard is
    written once complete, so memory holds about a shard and a stage. Tied weights are written
    once, as ``save_pretrained`` does. ``dtype``: of the written tensors (the master is fp32), a
    floating-point torch dtype or its name ("bfloat16");
    the config records it (``dtype``), replacing the source's, so that ``from_pretrained`` loads
    the tensors as written. Every tensor written is of one step of the job: read while it trains,
    the export starts again when the job moves on (``StateError`` if it keeps moving on).
    """
    dtype = _float_dtype(dtype)
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


def _float_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``dtype`` (a torch dtype or its name, "bfloat16"), refused by name unless floating point."""
    got = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(got, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype: give one, or its name ('float32', 'bfloat16', 'float16')")
    if not got.is_floating_point:
        raise ValueError(f"dtype {dtype!r} is not floating point: the weights are written as float32, bfloat16 or float16")
    return got


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
