"""Ready-made models expressed as wstream stage chains."""

from .cnn import resnet18_stages, vgg_stages
from .gpt import GPTConfig, gpt_stages, lm_loss

__all__ = ["GPTConfig", "gpt_stages", "lm_loss", "resnet18_stages", "vgg_stages"]
