"""`EngineConfig`: the decoding engine's sizes, validated (data only: no JAX).

Its defaults are the only engine defaults: the main job's `rl.engine` table (`configs/fields.py`) takes
them from here, and `inference.Engine` uses them when given no config."""

from __future__ import annotations

import dataclasses

import ml_collections

SCHEDULERS = ("continuous", "static")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes of the engine; every shape the jitted steps see is derived from these."""

    max_batch: int = 32  # decode slots (rows of the decode step)
    max_seq_len: int = 1024  # prompt + completion tokens of one sequence
    page_size: int = 16
    num_pages: int = 0  # 0: room for max_batch full sequences plus the prefix cache
    prefix_cache_pages: int = -1  # device pages the prefix cache keeps (0: off); -1: max_batch * M / 2
    host_cache_pages: int = 0  # host-tier pages for cold prefix blocks (0: off)
    prefill_chunk: int = 64  # longest prefill call; longer contexts are prefilled in chunks
    prefill_batch: int = 4  # rows per prefill call (bucketed to powers of two)
    # Fewest rows of a prefill call: a call with fewer is padded up to it, so only the row buckets from here
    # to prefill_batch are compiled (e.g. = prefill_batch when every round prefills that many prompts).
    min_prefill_batch: int = 1
    min_bucket: int = 16  # shortest prefill / score length bucket
    num_draft: int = 4  # k: tokens proposed per speculative step
    scheduler: str = "continuous"
    cache_dtype: str = ""  # "": the model's compute dtype
    score_batch: int = 8  # rows per scoring call
    # Record the experts each MoE layer chose for every token the target fed (Completion.expert_indices, for
    # routing replay) in routing pages beside the K/V: L_moe * k bytes per pool slot with at most 127
    # experts (int8), else 2 * L_moe * k (int16); e.g. 58 MoE layers, top-8 of 256 experts: 928 B per token
    # (K/V: 2 * L * K * H * dtype bytes). The host tier moves the record with the K/V.
    record_routing: bool = False
    # Plain decoding: tokens per device call (a `lax.while_loop` of decode steps with on-device sampling and
    # stop / length checks; the host admits and retires sequences between calls, so a row that finishes
    # idles at most decode_steps - 1 steps). 1: one step per call. With a ModelDrafter: speculative steps per
    # call (`steps.speculative_model_many`); the other drafters take 1 (their proposals come from the host).
    decode_steps: int = 1
    # With decode_steps > 1: the most stop tokens one request may give (the device checks a fixed-width row).
    max_stop_tokens: int = 8

    def __post_init__(self) -> None:
        for name in (
            "max_batch",
            "max_seq_len",
            "page_size",
            "prefill_chunk",
            "prefill_batch",
            "min_prefill_batch",
            "min_bucket",
            "num_draft",
            "score_batch",
            "decode_steps",
            "max_stop_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"engine.{name}={getattr(self, name)} must be >= 1.")
        for name, low in (("num_pages", 0), ("host_cache_pages", 0), ("prefix_cache_pages", -1)):
            if getattr(self, name) < low:
                raise ValueError(f"engine.{name}={getattr(self, name)} must be >= {low}.")
        for name in ("prefill_chunk", "prefill_batch", "min_prefill_batch", "min_bucket", "score_batch"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"engine.{name}={value} must be a power of two (it is a bucket size).")
        if self.min_bucket > self.prefill_chunk:
            raise ValueError(
                f"engine.min_bucket={self.min_bucket} must be <= prefill_chunk={self.prefill_chunk}."
            )
        if self.min_prefill_batch > self.prefill_batch:
            raise ValueError(
                f"engine.min_prefill_batch={self.min_prefill_batch} must be <= "
                f"prefill_batch={self.prefill_batch}."
            )
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"engine.scheduler={self.scheduler!r} is unknown; choose one of {SCHEDULERS}.")
        if self.num_pages and self.num_pages < self.pages_per_seq + 1:
            raise ValueError(
                f"engine.num_pages={self.num_pages} cannot hold one sequence of "
                f"max_seq_len={self.max_seq_len} ({self.pages_per_seq} pages + the null page); "
                "raise num_pages or use 0 (automatic)."
            )

    @classmethod
    def from_config(cls, c: ml_collections.ConfigDict | dict) -> EngineConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(dict(c)) - fields
        if unknown:
            raise ValueError(f"engine config has unknown fields {sorted(unknown)}; known: {sorted(fields)}.")
        return cls(**dict(c))

    @property
    def pages_per_seq(self) -> int:
        """Page-table width M: max_seq_len plus the k + 1 speculative positions."""
        return -(-(self.max_seq_len + self.num_draft + 1) // self.page_size)

    @property
    def prefix_pages(self) -> int:
        if self.prefix_cache_pages >= 0:
            return self.prefix_cache_pages
        return self.max_batch * self.pages_per_seq // 2

    @property
    def pool_pages(self) -> int:
        return self.num_pages or 1 + self.max_batch * self.pages_per_seq + self.prefix_pages
