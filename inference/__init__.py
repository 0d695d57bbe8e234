"""JAX decoding engine: paged KV cache, continuous batching, prefix reuse, exact speculative decoding."""

from inference.drafters import GroupDrafter, ModelDrafter, MTPDrafter, NgramDrafter
from inference.engine import Engine
from inference.engine_config import Completion, EngineConfig
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
