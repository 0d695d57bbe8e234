"""Config validation: every error names the field and says how to fix it."""

from __future__ import annotations

import ml_collections

from configs import schema
from configs.fields import MODEL
from configs.schema import ConfigError  # one error type for every config check
from model import sharding
from model.attention import ATTENTION_IMPLS

__all__ = ["ConfigError", "layer_counts", "validate", "validate_model"]


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _divides(field: str, value: int, by_field: str, by: int, fix: str) -> None:
    _check(value % by == 0, f"{field}={value} is not divisible by {by_field}={by}; {fix}")


def validate_model(m: ml_collections.ConfigDict) -> None:
    """Every field against `configs.base.MODEL` (type, range, choices, no unknown names), then the rules
    that tie fields together."""
    schema.check(m, MODEL, "model")
    _check(
        m.attention_impl in ATTENTION_IMPLS,
        f"model.attention_impl={m.attention_impl!r} is unknown; choose one of {sorted(ATTENTION_IMPLS)} "
        "(or register one: model.attention.register_attention_impl)",
    )
    _divides(
        "model.num_heads",
        m.num_heads,
        "model.num_kv_heads",
        m.num_kv_heads,
        "set num_heads to a multiple of num_kv_heads (GQA shares each kv head among a group)",
    )
    if m.attention_kind == "gqa":
        _check(m.head_dim % 2 == 0, f"model.head_dim={m.head_dim} must be even for RoPE; use an even size")
    if m.attention_kind == "mla":
        _check(
            m.mla.qk_rope_head_dim % 2 == 0,
            f"model.mla.qk_rope_head_dim={m.mla.qk_rope_head_dim} must be even for RoPE; use an even size",
        )
        qk = m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim
        _check(
            m.mla.v_head_dim <= qk,
            f"model.mla.v_head_dim={m.mla.v_head_dim} must be at most qk_nope_head_dim + qk_rope_head_dim="
            f"{qk} (the attention kernels take one head width; values are zero-padded to it)",
        )
        _check(not m.qk_norm, "model.qk_norm applies to gqa attention; mla normalises its latents instead")
        _check(
            not m.attention_bias, "model.attention_bias is not supported with attention_kind='mla'; set False"
        )
    r = m.rope
    if r.scaling == "llama3":
        _check(
            r.high_freq_factor > r.low_freq_factor,
            f"model.rope.high_freq_factor={r.high_freq_factor} must exceed "
            f"model.rope.low_freq_factor={r.low_freq_factor}",
        )
    e = m.moe
    if e.num_experts:
        _check(
            e.top_k <= e.num_experts,
            f"model.moe.top_k={e.top_k} must be between 1 and model.moe.num_experts={e.num_experts}",
        )
        _divides(
            "model.moe.num_experts",
            e.num_experts,
            "model.moe.n_group",
            e.n_group,
            "make the expert count a multiple of the number of expert groups",
        )
        per_group = e.num_experts // e.n_group
        if e.n_group > 1:
            _check(
                per_group >= 2,
                f"model.moe.n_group={e.n_group} leaves {per_group} expert per group; a group's score is the "
                "sum of its top two experts, so use at most num_experts / 2 groups",
            )
        _check(
            e.topk_group <= e.n_group,
            f"model.moe.topk_group={e.topk_group} must be between 1 and model.moe.n_group={e.n_group}",
        )
        _check(
            e.top_k <= e.topk_group * per_group,
            f"model.moe.top_k={e.top_k} exceeds the {e.topk_group * per_group} experts of topk_group="
            f"{e.topk_group} groups; raise topk_group",
        )
        _check(
            e.first_dense_layers <= m.num_layers,
            f"model.moe.first_dense_layers={e.first_dense_layers} must be between 0 and "
            f"model.num_layers={m.num_layers}",
        )


def layer_counts(m: ml_collections.ConfigDict) -> tuple[int, int]:
    """(dense layers, MoE layers): the first `moe.first_dense_layers` are dense, or all without experts."""
    num_dense = m.num_layers if not m.moe.num_experts else m.moe.first_dense_layers
    return num_dense, m.num_layers - num_dense


def validate(cfg: ml_collections.ConfigDict, num_devices: int | None = None) -> dict[str, int]:
    """Checks `cfg` (and its mesh against `num_devices` when given); returns the resolved mesh shape."""
    m = cfg.model
    validate_model(m)
    if num_devices is None:
        shape = {a: int(cfg.mesh.shape.get(a, 1)) for a in sharding.MESH_AXES}
        if -1 in shape.values():
            return shape
    else:
        try:
            shape = sharding.resolve_mesh_shape(dict(cfg.mesh.shape), num_devices)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    expert, tensor = shape["expert"], shape["tensor"]
    if m.moe.num_experts:
        _divides(
            "model.moe.num_experts",
            m.moe.num_experts,
            "mesh.shape.expert",
            expert,
            "make the expert count a multiple of the expert axis (or shrink the expert axis)",
        )
    if tensor > 1:
        fix = "shrink mesh.shape.tensor or change the size"
        _divides("model.num_heads", m.num_heads, "mesh.shape.tensor", tensor, fix)
        _divides("model.num_kv_heads", m.num_kv_heads, "mesh.shape.tensor", tensor, fix)
        _divides("model.vocab_size", m.vocab_size, "mesh.shape.tensor", tensor, fix)
        if not m.moe.num_experts or m.moe.first_dense_layers:
            _divides("model.d_ff", m.d_ff, "mesh.shape.tensor", tensor, fix)
        if m.moe.num_experts:
            _divides("model.moe.d_ff", m.moe.d_ff, "mesh.shape.tensor", tensor, fix)
            if m.moe.num_shared_experts:
                shared = m.moe.shared_d_ff * m.moe.num_shared_experts
                _divides(
                    "model.moe.shared_d_ff * num_shared_experts",
                    shared,
                    "mesh.shape.tensor",
                    tensor,
                    fix,
                )
    if shape["fsdp"] > 1:
        _divides(
            "model.d_model",
            m.d_model,
            "mesh.shape.fsdp",
            shape["fsdp"],
            "shrink mesh.shape.fsdp or change d_model",
        )
    return shape
