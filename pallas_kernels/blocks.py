"""`BlockSizes`: how many queries and keys the blocked kernels (chunked, flash) take at once."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Queries and keys per block; each kernel fits them to short sequences (see its module).

    block_q / block_kv: the forward pass; `chunked_attention` uses them for its backward as well.
    *_dkv: flash's dk/dv kernel (query tile looped, key tile on the grid). *_dq: flash's dq kernel (query
    tile on the grid, key tile looped). The defaults are flash's; `chunked_attention.DEFAULT_BLOCK_SIZES`
    are chunked's.
    """

    block_q: int = 128
    block_kv: int = 128
    block_q_dkv: int = 64
    block_kv_dkv: int = 128
    block_q_dq: int = 128
    block_kv_dq: int = 64

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BlockSizes.{field.name}={value!r}: expected a positive int")
