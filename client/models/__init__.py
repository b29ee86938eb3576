"""Ready-made models expressed as wstream stage chains."""

from .gpt import GPTConfig, gpt_stages, lm_loss

__all__ = ["GPTConfig", "gpt_stages", "lm_loss"]
