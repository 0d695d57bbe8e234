"""Config validation: every error names the field and says how to fix it."""

from __future__ import annotations

import ml_collections

from model import sharding

DTYPES = ("float32", "bfloat16", "float16")
REMAT = ("none", "full", "dots_saveable")
ROPE_SCALING = ("none", "linear", "llama3", "yarn")
MOE_IMPLS = ("ragged", "capacity")
ROUTERS = ("softmax", "sigmoid")


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field and the fix."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _divides(field: str, value: int, by_field: str, by: int, fix: str) -> None:
    _check(value % by == 0, f"{field}={value} is not divisible by {by_field}={by}; {fix}")


def validate_model(m: ml_collections.ConfigDict) -> None:
    from model.attention import ATTENTION_IMPLS  # late: attention imports this module's users

    for f in (
        "vocab_size",
        "d_model",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "d_ff",
    ):
        _check(int(m[f]) > 0, f"model.{f}={m[f]} must be positive")
    _divides(
        "model.num_heads",
        m.num_heads,
        "model.num_kv_heads",
        m.num_kv_heads,
        "set num_heads to a multiple of num_kv_heads (GQA shares each kv head among a group)",
    )
    _check(m.head_dim % 2 == 0, f"model.head_dim={m.head_dim} must be even for RoPE; use an even size")
    _check(
        m.attention_impl in ATTENTION_IMPLS,
        f"model.attention_impl={m.attention_impl!r} is unknown; choose one of {sorted(ATTENTION_IMPLS)}",
    )
    _check(m.remat in REMAT, f"model.remat={m.remat!r} is unknown; choose one of {REMAT}")
    for f in ("param_dtype", "compute_dtype"):
        _check(m[f] in DTYPES, f"model.{f}={m[f]!r} is unknown; choose one of {DTYPES}")
    r = m.rope
    _check(r.scaling in ROPE_SCALING, f"model.rope.scaling={r.scaling!r}; choose one of {ROPE_SCALING}")
    _check(r.theta > 0, f"model.rope.theta={r.theta} must be positive")
    if r.scaling != "none":
        _check(r.factor >= 1.0, f"model.rope.factor={r.factor} must be >= 1 when scaling is on")
    if r.scaling == "llama3":
        _check(
            r.high_freq_factor > r.low_freq_factor,
            f"model.rope.high_freq_factor={r.high_freq_factor} must exceed "
            f"model.rope.low_freq_factor={r.low_freq_factor}",
        )
    e = m.moe
    if e.num_experts:
        _check(e.num_experts > 0, f"model.moe.num_experts={e.num_experts} must be >= 0")
        _check(
            1 <= e.top_k <= e.num_experts,
            f"model.moe.top_k={e.top_k} must be between 1 and model.moe.num_experts={e.num_experts}",
        )
        _check(e.impl in MOE_IMPLS, f"model.moe.impl={e.impl!r} is unknown; choose one of {MOE_IMPLS}")
        _check(
            e.router in ROUTERS,
            f"model.moe.router={e.router!r} is unknown; choose one of {ROUTERS}",
        )
        _check(e.d_ff > 0, f"model.moe.d_ff={e.d_ff} must be positive")
        _check(
            e.capacity_factor > 0,
            f"model.moe.capacity_factor={e.capacity_factor} must be positive (1.0-2.0 is typical)",
        )
        _check(
            0 <= e.first_dense_layers <= m.num_layers,
            f"model.moe.first_dense_layers={e.first_dense_layers} must be between 0 and "
            f"model.num_layers={m.num_layers}",
        )
        if e.num_shared_experts:
            _check(e.shared_d_ff > 0, f"model.moe.shared_d_ff={e.shared_d_ff} must be positive")


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
