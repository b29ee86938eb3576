"""What flows between the stages of a Hugging Face causal LM, and what each block stage computes
from it: position ids, the caller's mask as it crosses stages, and each block's causal (or
sliding-window) mask built as the model's forward builds it.

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
from typing import Any

import torch

from transformers import PretrainedConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from .hf_layout import FULL, SLIDING


def _cache_arguments(fn: Callable[..., Any]) -> tuple[str, bool]:
    """The name of a mask builder's (empty) cache argument (``past_key_values`` until transformers
    5.2x renamed it ``cache``), and whether it wants ``cache_position`` (5.2 and 5.3)."""
    parameters = inspect.signature(fn).parameters
    return ("cache" if "cache" in parameters else "past_key_values"), "cache_position" in parameters


_MASK_FUNCTIONS = {FULL: create_causal_mask, SLIDING: create_sliding_window_causal_mask}
_MASK_CACHE = {kind: _cache_arguments(fn) for kind, fn in _MASK_FUNCTIONS.items()}


def default_positions(hidden: torch.Tensor) -> torch.Tensor:
    """The position ids a model computes for a sequence without a cache: (1, seq)."""
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def block_mask(
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


def as_bool_mask(attention_mask: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
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


def boundary(hidden: torch.Tensor, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> Any:
    """What a stage hands on (NOTE [What flows between stages])."""
    if position_ids is None:
        return hidden
    return (hidden, position_ids) if attention_mask is None else (hidden, position_ids, attention_mask)
