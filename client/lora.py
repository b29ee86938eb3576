"""LoRA adapters trained on a shared frozen base, and their two exports (peft's adapter layout, or
merged into the base's weights in ``save_pretrained`` layout).

```python
from wstream.client.hf import create_job_from_pretrained, stages_from_pretrained
from wstream.client.lora import Lora, add_lora, export_adapter, export_merged

base = create_job_from_pretrained(client, "llama", folder, token="b", frozen=True)   # held once
lora = Lora(targets=r"q_proj|v_proj", rank=8, alpha=16)
job = client.create_job("llama-lora", add_lora(stages_from_pretrained(folder, weights=False), lora),
                        token="t", base="llama", base_token="b", optimizer=AdamW(lr=1e-4))
...train job...
export_adapter(job, "out/adapter", lora, base_model=folder)   # PeftModel.from_pretrained loads it
export_merged(job, base, "out/merged", folder, lora)          # AutoModelForCausalLM.from_pretrained
```

# NOTE [LoRA parameters under peft's names]
# 1. ``add_lora`` replaces each target ``nn.Linear`` (or GPT-2's ``Conv1D``) of a stage by a
#    :class:`LoraLinear` that keeps the layer's own ``weight`` and ``bias`` under their names and
#    adds ``lora_A.default.weight`` (rank x in) and ``lora_B.default.weight`` (out x rank), as peft
#    names them under ``base_layer`` (peft: ``q_proj.base_layer.weight``, ``q_proj.lora_A.default.weight``).
#    Keeping ``q_proj.weight`` at its own name is what lets a job on a frozen base read it, by
#    name, from the base's stage (DESIGN.md "Shared frozen bases"): nothing maps names there.
# 2. Every other parameter of the stage loses ``requires_grad``, so on a base the adapter job's
#    stage i holds only its ``lora_A``/``lora_B`` (their optimizer state too), and a stage without
#    targets (embedding, head) holds nothing of its own: it is read whole from the base.
# 3. The forward is peft's: ``base(x) + lora_B(lora_A(dropout(x))) * alpha / rank``; ``lora_A`` is
#    initialised as ``nn.Linear`` is (kaiming uniform, a = sqrt(5)) and ``lora_B`` to zero, so the
#    adapted model starts equal to the base. Dropout is replayed in recomputation like any other.
# 4. The adapter export writes ``base_model.model.<path>.lora_A.weight`` (peft drops the adapter
#    name ``default`` when saving) and an ``adapter_config.json`` whose ``target_modules`` lists the
#    wrapped modules by full path, so peft wraps exactly those whatever pattern chose them.
# 5. The merged export is ``W + (B @ A) * alpha / rank`` per wrapped layer (transposed for
#    ``Conv1D``, whose weight is in x out), written by ``export_pretrained`` one stage at a time:
#    the base's stage and the adapter's stage are pulled together, merged, written, dropped.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from wstream.protocol import LayoutError, StageSpec

from .job_handle import Job, pull_consistent
from .stages import Tied

ADAPTER = "default"
"""The adapter's name in parameter paths, as peft names its first adapter."""
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""peft's prefix of the wrapped model's paths in a saved adapter."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Lora:
    """Which linear layers get a LoRA adapter, and its shape."""

    targets: str | Sequence[str]
    """A regular expression that must match a module's whole path (``model.layers.0.self_attn.q_proj``)
    or its last name (``q_proj``; peft's string rule is the whole path only, so a pattern may pick
    more here); or a list of names, each matching a module whose path is it or ends in ``.`` + it
    (peft's ``target_modules`` rule for a list), kept as a tuple."""
    rank: int = 8
    """The adapter's rank r: ``lora_A`` is r x in, ``lora_B`` out x r."""
    alpha: float = 16.0
    """The update is scaled by alpha / rank (peft's ``lora_alpha``)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (peft's ``lora_dropout``); replayed in recomputation."""
    seed: int | None = None
    """Seed of ``lora_A``'s initialisation (None: torch's global generator)."""
    _pattern: re.Pattern[str] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"Lora rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"Lora dropout must be in [0, 1), got {self.dropout}")
        if isinstance(self.targets, str):
            object.__setattr__(self, "_pattern", re.compile(self.targets))
            return
        object.__setattr__(self, "targets", tuple(self.targets))  # frozen: hashable, not shared
        if not self.targets:
            raise ValueError("Lora targets is empty: give a pattern or module names")

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike[str]) -> Lora:
        """The settings of a ``peft`` LoRA adapter folder (its ``adapter_config.json``), to train
        it further: ``add_lora(stages, Lora.from_pretrained(folder), weights=folder)``. Variants
        this module does not compute (rsLoRA, DoRA, trained biases, per-layer ranks, extra
        trained modules) are refused, naming the setting."""
        config = json.loads((Path(folder) / CONFIG_FILE).read_text())
        if config.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{folder}: a {config['peft_type']} adapter, not LoRA")
        for key in ("use_rslora", "use_dora", "bias", "modules_to_save", "rank_pattern", "alpha_pattern",
                    "layers_to_transform", "trainable_token_indices", "exclude_modules", "lora_bias"):
            if config.get(key) not in (None, False, "none", {}, []):
                raise ValueError(f"{folder}: {key}={config[key]!r} is not supported (plain LoRA only)")
        if config.get("init_lora_weights", True) not in (True, False, "gaussian"):  # PiSSA, OLoRA, LoftQ... change the base too
            raise ValueError(f"{folder}: init_lora_weights={config['init_lora_weights']!r} is not supported (plain LoRA only)")
        targets = config["target_modules"]
        return cls(targets=targets if isinstance(targets, str) else sorted(targets), rank=config["r"],
                   alpha=config["lora_alpha"], dropout=config.get("lora_dropout", 0.0))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def picks(self, path: str) -> bool:
        """Whether the module at ``path`` is a target."""
        if self._pattern is not None:
            return bool(self._pattern.fullmatch(path) or self._pattern.fullmatch(path.rpartition(".")[2]))
        return bool(self.named_by(path))

    def named_by(self, path: str) -> list[str]:
        """The names of a list of targets that pick the module at ``path`` (none for a pattern)."""
        if self._pattern is not None:
            return []
        return [t for t in self.targets if path == t or path.endswith("." + t)]


def _is_conv1d(module: nn.Module) -> bool:
    """GPT-2's ``Conv1D`` (a linear layer whose weight is in x out), without importing transformers."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


class LoraLinear(nn.Module):
    """A linear layer (``nn.Linear``, or ``Conv1D`` with ``fan_in_fan_out``) with a LoRA adapter:
    ``layer(x) + lora_B(lora_A(dropout(x))) * scaling`` (NOTE [LoRA parameters under peft's names]).
    The layer's ``weight`` and ``bias`` are kept, frozen, under their own names."""

    def __init__(self, layer: nn.Module, lora: Lora, generator: torch.Generator | None) -> None:
        super().__init__()
        self.fan_in_fan_out = _is_conv1d(layer)
        weight: nn.Parameter = layer.weight  # type: ignore[assignment]
        in_features, out_features = weight.shape if self.fan_in_fan_out else weight.shape[::-1]
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.weight = weight.requires_grad_(False)
        bias: nn.Parameter | None = layer.bias  # type: ignore[assignment]
        self.register_parameter("bias", bias.requires_grad_(False) if bias is not None else None)
        self.scaling = lora.scaling
        self.lora_dropout = nn.ModuleDict({ADAPTER: nn.Dropout(lora.dropout) if lora.dropout else nn.Identity()})
        a = torch.empty(lora.rank, self.in_features, dtype=torch.float32)
        bound = 1 / math.sqrt(self.in_features)  # kaiming_uniform_(a=sqrt(5)), nn.Linear's and peft's
        a.uniform_(-bound, bound, generator=generator)
        self.lora_A = nn.ModuleDict({ADAPTER: _weight_only(a)})
        self.lora_B = nn.ModuleDict({ADAPTER: _weight_only(torch.zeros(self.out_features, lora.rank))})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fan_in_fan_out:  # Conv1D's own computation
            flat = x.reshape(-1, x.shape[-1])
            base = torch.addmm(self.bias, flat, self.weight) if self.bias is not None else flat @ self.weight
            out = base.view(*x.shape[:-1], self.out_features)
        else:
            out = F.linear(x, self.weight, self.bias)
        a, b = self.lora_A[ADAPTER], self.lora_B[ADAPTER]
        return out + b(a(self.lora_dropout[ADAPTER](x))) * self.scaling


def _weight_only(weight: torch.Tensor) -> nn.Linear:
    """An ``nn.Linear`` without bias holding ``weight`` (out x in): peft's ``lora_A``/``lora_B``."""
    with torch.device("meta"):
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight = nn.Parameter(weight)
    return layer


def add_lora(
    stages: Iterable[nn.Module | Tied],
    lora: Lora | None = None,
    *,
    weights: str | os.PathLike[str] | None = None,
    **fields: Any,
) -> Iterator[nn.Module | Tied]:
    """The chain ``stages`` with a LoRA adapter on every target linear layer, one stage at a time,
    for ``Client.create_job(..., base=...)`` (or ``attach_job``). ``lora``: a :class:`Lora`, or
    its fields as keywords (``targets=r"q_proj|v_proj", rank=8, alpha=16, dropout=0.0``).

    Every parameter other than the adapters' loses ``requires_grad``: on a frozen base, the job
    holds and trains the adapters only and reads the rest from the base (NOTE [LoRA parameters
    under peft's names]). ``stages`` may be on the meta device (``stages_from_pretrained(...,
    weights=False)``): the adapters are made on the CPU. A target that is not a linear layer, or
    no target in the whole chain, is refused (``ValueError``).

    ``weights``: a ``peft`` adapter folder (``adapter_model.safetensors``, as :func:`export_adapter`
    or ``PeftModel.save_pretrained`` write it) whose adapters replace the initial ones; every
    adapter of the chain must be in it and every tensor in it must be used (``LayoutError``)."""
    if lora is None:
        lora = Lora(**fields)
    elif fields:
        raise ValueError("give a Lora or its fields as keywords, not both")
    generator = torch.Generator().manual_seed(lora.seed) if lora.seed is not None else None
    saved = _AdapterFile(Path(weights)) if weights is not None else None
    wrapped = 0
    named: set[str] = set()
    for i, item in enumerate(stages):
        module = item.module if isinstance(item, Tied) else item
        module.requires_grad_(False)
        if not isinstance(item, Tied):
            wrapped += _wrap(i, module, lora, generator, named)
            if saved is not None:
                saved.fill(i, module)
        yield item
    if not wrapped:
        raise ValueError(f"Lora targets {lora.targets!r} picked no module of the chain")
    missed = [] if isinstance(lora.targets, str) else [t for t in lora.targets if t not in named]
    if missed:  # peft would skip them silently: a misspelt name, or one the chain spells otherwise
        raise ValueError(
            f"Lora targets {missed!r} picked no module of the chain (its modules carry their checkpoint's "
            "names: GPT-NeoX's head, for one, is 'embed_out', not 'lm_head')"
        )
    if saved is not None:
        saved.check_all_used()


class _AdapterFile:
    """The tensors of a peft adapter folder, read by the chain's adapter names (:func:`peft_name`)."""

    def __init__(self, folder: Path) -> None:
        from safetensors.torch import load_file

        self.path = folder / WEIGHTS_FILE
        if not self.path.is_file():
            raise FileNotFoundError(f"{folder}: no {WEIGHTS_FILE} (a peft adapter folder was expected)")
        self.tensors = load_file(self.path)
        self.used: set[str] = set()

    def fill(self, index: int, stage: nn.Module) -> None:
        for name, p in stage.named_parameters():
            if ".lora_" not in name:
                continue
            key = peft_name(name)
            if key not in self.tensors:
                raise LayoutError(f"stage {index}: adapter {name!r} is not in {self.path} (as {key!r})")
            saved = self.tensors[key]
            if tuple(saved.shape) != tuple(p.shape):
                raise LayoutError(f"{key} has shape {tuple(saved.shape)} in {self.path}, the chain's {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(saved)
            self.used.add(key)

    def check_all_used(self) -> None:
        unused = sorted(set(self.tensors) - self.used)
        if unused:
            raise LayoutError(f"{len(unused)} tensors of {self.path} are no adapter of the chain, e.g. {unused[:3]}")


def _wrap(index: int, stage: nn.Module, lora: Lora, generator: torch.Generator | None, named: set[str]) -> int:
    """Replace the targets of ``stage`` by :class:`LoraLinear`; how many there were. The names of
    a list of targets that picked one are added to ``named``."""
    picked = [(path, mod) for path, mod in stage.named_modules() if path and lora.picks(path)]
    for path, _ in picked:
        named.update(lora.named_by(path))
    for path, mod in picked:
        if not (isinstance(mod, nn.Linear) or _is_conv1d(mod)):
            raise ValueError(f"stage {index}: Lora target {path!r} is a {type(mod).__name__}, not a linear layer")
        stage.set_submodule(path, LoraLinear(mod, lora, generator))
    return len(picked)


# ---- exports -------------------------------------------------------------------------------------
def adapter_modules(job: Job, rename: Callable[[str], str] = lambda name: name) -> list[str]:
    """The paths of the layers the job adapts (its ``lora_A`` parameters' modules), in chain order;
    ``rename`` maps each parameter's name first (the chain's checkpoint name to the model's)."""
    suffix = f".lora_A.{ADAPTER}.weight"
    return [rename(p.name).removesuffix(suffix) for s in job.specs for p in s.params if p.name.endswith(suffix)]


def is_adapter(name: str) -> bool:
    """Whether a chain parameter's name is one of a :class:`LoraLinear`'s adapters."""
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def peft_name(name: str) -> str:
    """The name peft saves an adapter parameter under: prefixed, the adapter's name dropped."""
    return PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")


def export_adapter(
    job: Job,
    folder: str | os.PathLike[str],
    lora: Lora,
    *,
    base_model: str | os.PathLike[str] | None = None,
    fan_in_fan_out: bool | None = None,
) -> Path:
    """Write the job's adapters in the layout ``peft`` loads (``PeftModel.from_pretrained(model,
    folder)``): ``adapter_config.json`` and ``adapter_model.safetensors``, fp32.
    ``base_model``: the base's ``save_pretrained`` folder (or a hub id), recorded as
    ``base_model_name_or_path``; ``fan_in_fan_out``: whether the adapted layers are ``Conv1D``
    (GPT-2), as peft records it; None: read from ``base_model``'s config (False without one)."""
    from safetensors.torch import save_file

    base_config = None if base_model is None else _load_config(base_model)
    # the chain's names are the checkpoint's; peft names the model's modules (GPT-NeoX's embed_out is its lm_head)
    model_name = _model_names(base_config)
    modules = adapter_modules(job, model_name)
    if not modules:
        raise ValueError(f"job {job.name!r} holds no LoRA adapter (no parameter named *.lora_A.{ADAPTER}.weight)")
    if fan_in_fan_out is None:
        fan_in_fan_out = base_config is not None and _conv1d_family(base_config)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    adapted = [stage for stage in range(job.num_stages) if any(is_adapter(p.name) for p in job.specs[stage].params)]

    def adapters_of(k: int) -> tuple[int, dict[str, torch.Tensor]]:
        # only the adapters are kept: a job made without ``base=`` holds its frozen weights too
        step, weights = job.pull_stage_versioned(adapted[k])
        return step, {name: t for name, t in weights.items() if is_adapter(name)}

    _, pulled = pull_consistent(adapters_of, len(adapted), job.name)  # of one step
    tensors: dict[str, torch.Tensor] = {}
    for stage_tensors in pulled:
        tensors.update((peft_name(model_name(name)), t.contiguous()) for name, t in stage_tensors.items())
    save_file(tensors, out / WEIGHTS_FILE, metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": os.fspath(base_model) if base_model is not None else None,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": fan_in_fan_out,
        "inference_mode": True,
        "use_rslora": False,
        "init_lora_weights": True,
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


class MergedStages:
    """The base's stages with the adapters of ``job`` merged in, pulled one stage at a time: what
    ``export_pretrained`` reads (``name``, ``specs``, ``num_stages``, ``num_params``, ``pull_stage_versioned``)."""

    def __init__(self, job: Job, base: Job, lora: Lora, *, fan_in_fan_out: bool) -> None:
        if job.num_stages != base.num_stages:
            raise ValueError(f"job {job.name!r} has {job.num_stages} stages, {base.name!r} {base.num_stages}")
        self.name = f"{job.name} merged into {base.name}"
        self.specs: list[StageSpec] = base.specs
        self.num_stages = base.num_stages
        self.num_params = base.num_params
        self._job, self._base, self._scaling, self._transpose = job, base, lora.scaling, fan_in_fan_out

    def pull_stage_versioned(self, stage: int) -> tuple[tuple[int, int], dict[str, torch.Tensor]]:
        """The merged weights of ``stage`` and the steps they are of: (the adapters', the base's)."""
        base_step, weights = self._base.pull_stage_versioned(stage)
        step, adapters = self._job.pull_stage_versioned(stage)  # (a stage without adapters has a step too)
        for name, a in adapters.items():
            if not name.endswith(f".lora_A.{ADAPTER}.weight"):
                continue
            path = name.removesuffix(f".lora_A.{ADAPTER}.weight")
            delta = (adapters[f"{path}.lora_B.{ADAPTER}.weight"] @ a) * self._scaling  # out x in
            weights[f"{path}.weight"] += delta.T if self._transpose else delta  # Conv1D's weight is in x out
        return (step, base_step), weights


def export_merged(
    job: Job,
    base: Job,
    folder: str | os.PathLike[str],
    config: Any,
    lora: Lora,
    *,
    fan_in_fan_out: bool | None = None,
    **options: Any,
) -> Path:
    """Write the base's weights with ``job``'s adapters merged in (``W + B A alpha / rank``) as a
    ``save_pretrained`` folder ``AutoModelForCausalLM.from_pretrained`` loads. ``base``: the frozen
    base job (``client.attach_job(name, token=...)``); ``config`` and ``options`` as for
    :func:`~wstream.client.hf.export_pretrained`; ``fan_in_fan_out`` (``Conv1D`` layers, whose
    weight is in x out): None reads it from ``config`` (GPT-2)."""
    from .hf_export import export_pretrained

    if fan_in_fan_out is None:
        fan_in_fan_out = _conv1d_family(config)
    return export_pretrained(MergedStages(job, base, lora, fan_in_fan_out=fan_in_fan_out), folder, config, **options)


CONV1D_FAMILIES = ("gpt2",)
"""Model types whose linear layers are ``Conv1D`` (weight in x out): peft's ``fan_in_fan_out``."""


def _load_config(source: Any) -> Any:
    from .hf_source import load_config

    return load_config(source)


def _model_names(config: Any) -> Callable[[str], str]:
    """Chain (checkpoint) name -> the model's, for ``config``'s family (as is without one)."""
    if config is None:
        return lambda name: name
    from .hf_layout import FAMILIES, Family

    return FAMILIES.get(config.model_type, Family()).model_name


def _conv1d_family(config: Any) -> bool:
    return _load_config(config).model_type in CONV1D_FAMILIES
