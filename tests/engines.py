"""The tiny model and the small engine sizes the engine tests share (tests/inference, tests/rl).

`small_engine`: 4 rows, 8-token pages, 2-row prefills from a 16-token bucket up, 96-token sequences over 96
pages, prefilled in 32-token chunks.

A test passes only the sizes it changes. Tests on the same sizes and model share compiled steps (page pool,
table width, buckets) through the persistent compile cache, so a test keeps every size it has no reason to
change.
"""

from flax import nnx

import model
from configs import tiny
from inference.engine import EngineConfig

SMALL = {
    "max_batch": 4,
    "max_seq_len": 96,
    "page_size": 8,
    "num_pages": 96,
    "prefill_chunk": 32,
    "prefill_batch": 2,
    "min_bucket": 16,
}


def small_engine(**fields) -> EngineConfig:
    """An `EngineConfig` of the shared small sizes (`SMALL`) with `fields` replaced or added."""
    return EngineConfig(**{**SMALL, **fields})


def tiny_target(seed: int = 0):
    """(config, model, params) of tiny.py's MoE model with weights from `seed`."""
    cfg = tiny.get_config()
    m = model.build(cfg, seed=seed)
    return cfg, m, nnx.state(m, nnx.Param)
