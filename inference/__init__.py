"""JAX decoding engine: paged KV cache, continuous batching, prefix reuse, exact speculative decoding."""

from configs.engine import EngineConfig
from inference.completion import Completion
from inference.drafters import GroupDrafter, ModelDrafter, MTPDrafter, NgramDrafter
from inference.engine import Engine
from inference.sampling import SamplingParams

__all__ = [
    "Completion",
    "Engine",
    "EngineConfig",
    "GroupDrafter",
    "ModelDrafter",
    "MTPDrafter",
    "NgramDrafter",
    "SamplingParams",
]
