"""Where a Hugging Face model is: a ``save_pretrained`` folder on this machine (checked before the
hub is ever asked: NOTE [Local folders before the hub]) or a hub id for a config alone; the names
of its weight files; its config, made to run with an explicit attention implementation. Used by
:mod:`wstream.client.hf` (jobs from checkpoints) and :mod:`wstream.client.hf_export` (back to a
folder), which import it and never each other's internals.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Union

try:
    from transformers import AutoConfig, PretrainedConfig
except ImportError as exc:  # an optional extra
    raise ImportError(
        "wstream.client.hf needs transformers: pip install -e '.[hf]' in a checkout of wstream (the hf extra)"
    ) from exc

from .hf_layout import default_attn_implementation

Source = Union[str, "os.PathLike[str]", PretrainedConfig]
"""A ``save_pretrained`` folder (``config.json`` and safetensors weights) or a config."""

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
"""The attention implementations a job may run with; None picks per model
(:func:`~wstream.client.hf_layout.default_attn_implementation`)."""
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


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
