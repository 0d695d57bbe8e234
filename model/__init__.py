"""Sharded Flax NNX Mixture-of-Experts transformer."""

from model.config import ConfigError, validate
from model.transformer import Transformer, build, next_token_loss

__all__ = ["ConfigError", "Transformer", "build", "next_token_loss", "validate"]
