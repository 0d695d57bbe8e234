"""The model's plan: parameter counts, matmul FLOPs per token and bytes per device, read from
the abstract model (`nnx.eval_shape`). Nothing of model size is allocated and no device mesh is
built: the mesh is a dict of axis sizes, so a 65536-device plan runs on a laptop in about a second.
`python -m rl.plan` prints it with the main job's parts (rollout, live bytes per device, XLA's figures).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import jax.numpy as jnp
from flax import nnx
from ml_collections import ConfigDict

from configs.schema import ConfigError
from model import config as config_lib
from model import sharding
from model.moe import parallel as moe_parallel
from model.plan_format import format_table  # noqa: F401  (the table of `plan`, used by model.demo)
from model.transformer import Transformer

EMBED_PATH = ("embed", "embedding")
UNEMBED_PATH = ("unembed",)


def abstract_params(cfg: ConfigDict) -> nnx.State:
    """The model's `nnx.Param` state as ShapeDtypeStructs with `logical_axes`; allocates nothing.

    Non-Param variables (the sigmoid router's `ExpertBias`, num_experts f32 per MoE layer) are left
    out of every figure here: they are kilobytes and have no gradient or optimizer state.
    """
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0)))
    return nnx.state(model, nnx.Param)


def _is_expert(v: nnx.Variable) -> bool:
    return "exp" in v.get_metadata()["logical_axes"]


def _count(cfg: ConfigDict, state: nnx.State) -> dict[str, int]:
    moe = cfg.model.moe
    out = dict.fromkeys(("total", "active", "embedding", "unembedding", "experts"), 0)
    for path, v in nnx.to_flat_state(state):
        size = math.prod(v.shape)
        out["total"] += size
        if _is_expert(v):  # the `exp` dim holds num_experts whole experts; top_k run per token
            out["experts"] += size
            out["active"] += size * moe.top_k // moe.num_experts
        else:
            out["active"] += size
        if tuple(path) == EMBED_PATH:
            out["embedding"] += size
        elif tuple(path) == UNEMBED_PATH:
            out["unembedding"] += size
    return out


def count_params(cfg: ConfigDict) -> dict[str, int]:
    """Parameter counts.

    total: every `nnx.Param`. active: the parameters one token touches, routed experts (logical
    axes containing 'exp') at top_k/num_experts of their size, everything else in full, input
    embedding and untied unembedding included. embedding: the input table. unembedding: the output
    projection (0 when tied). experts: all routed-expert weights.
    """
    return _count(cfg, abstract_params(cfg))


def _attention_widths(m: ConfigDict) -> tuple[int, int]:
    """(q/k head width, v head width) of the attention scores and values."""
    if m.attention_kind == "mla":
        return m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim, m.mla.v_head_dim
    return m.head_dim, m.head_dim


def kv_cache_bytes_per_token(cfg: ConfigDict, dtype: str | None = None) -> int:
    """Bytes the KV cache holds per token over all layers, in `dtype` (default compute_dtype):
    GQA 2 * num_kv_heads * head_dim per layer (k and v); MLA kv_lora_rank + qk_rope_head_dim per layer
    (the latent and the shared RoPE key, for all heads)."""
    m = cfg.model
    itemsize = jnp.dtype(dtype or m.compute_dtype).itemsize
    if m.attention_kind == "mla":
        per_layer = m.mla.kv_lora_rank + m.mla.qk_rope_head_dim
    else:
        per_layer = 2 * m.num_kv_heads * m.head_dim
    return m.num_layers * per_layer * itemsize


def _flops(cfg: ConfigDict, counts: dict, seq_len: int, training: bool) -> float:
    m = cfg.model
    # The input embedding is a gather; a tied table still counts once, as the output projection.
    matmul_params = counts["active"] - (0 if m.tie_embeddings else counts["embedding"])
    qk, v = _attention_widths(m)
    attention = 2 * m.num_layers * m.num_heads * (qk + v) * seq_len / 2
    forward = 2.0 * matmul_params + attention
    return 3.0 * forward if training else forward


def flops_per_token(cfg: ConfigDict, seq_len: int, *, training: bool = True) -> float:
    """Matmul FLOPs per token, the numerator of MFU:

        forward  = 2 * P_matmul + 2 * num_layers * num_heads * (H_qk + H_v) * seq_len / 2
        training = 3 * forward   (the backward pass costs twice the forward)

    P_matmul is `count_params(cfg)['active']` less the input embedding (a gather, not a matmul;
    a tied table counts once, as the output projection). Norm scales (elementwise, < 0.01%) stay in
    P_matmul for simplicity. The attention term is QK^T and PV, 2 FLOPs per multiply-add, over
    `seq_len` keys, halved because a causal query sees half of them on average; H_qk = H_v = head_dim
    for GQA, qk_nope + qk_rope and v_head_dim for MLA (its training form; the kernels' zero padding of
    v to H_qk is not counted).
    """
    return _flops(cfg, count_params(cfg), seq_len, training)


def mesh_sizes(mesh_shape: Mapping[str, int]) -> dict[str, int]:
    """Sizes of all mesh axes: those not given are 1, and so is a `-1` axis (no devices to fill)."""
    shape = {a: int(s) for a, s in mesh_shape.items()}
    return sharding.resolve_mesh_shape(shape, math.prod(s for s in shape.values() if s != -1))


def parse_mesh(text: str) -> dict[str, int]:
    """`'data:8,fsdp:32'` -> sizes of all mesh axes (the `--mesh` flag)."""
    try:
        pairs = [item.split(":") for item in text.split(",") if item]
        return mesh_sizes({axis.strip(): int(size) for axis, size in pairs})
    except ValueError as err:
        msg = f"--mesh={text!r}: expected axis:size,... over {sharding.MESH_AXES}; {err}"
        raise ConfigError(msg) from None


class Shard(NamedTuple):
    bytes_per_device: int
    even: bool  # every dim divides over its mesh axes (what `build` on a real mesh requires)
    expert: bool  # a routed-expert weight


def _num_shards(entry, sizes: dict[str, int]) -> int:
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return math.prod(sizes[a] for a in axes)


def param_bytes_per_device(
    cfg: ConfigDict,
    mesh_shape: Mapping[str, int],
    state: nnx.State | None = None,
    *,
    dtype: str | None = None,
    replicate_uneven: bool = False,
) -> dict[str, Shard]:
    """'/'-joined parameter path -> `Shard` (its bytes on one device, evenness, expert or not).

    The PartitionSpec comes from the parameter's `logical_axes` and cfg.mesh.rules; each dim is
    split over the product of its mesh axes' sizes, rounded up when uneven (or, with
    `replicate_uneven`, kept whole, as the engine's inference layout keeps such a dim). Bytes use
    `dtype` when given, else the parameter's own dtype (param_dtype, except the router, which is
    always f32).
    """
    sizes, rules = mesh_sizes(mesh_shape), tuple(cfg.mesh.rules)
    out = {}
    for path, v in nnx.to_flat_state(abstract_params(cfg) if state is None else state):
        spec = sharding.logical_to_spec(v.get_metadata()["logical_axes"], rules)
        shards = [_num_shards(entry, sizes) for entry in spec]
        even = all(dim % n == 0 for dim, n in zip(v.shape, shards))
        if replicate_uneven:
            shards = [n if dim % n == 0 else 1 for dim, n in zip(v.shape, shards)]
        local = math.prod(-(-dim // n) for dim, n in zip(v.shape, shards))
        nbytes = local * jnp.dtype(dtype or v.dtype).itemsize
        out["/".join(map(str, path))] = Shard(nbytes, even, _is_expert(v))
    return out


def _layer_elems_per_token(m: ConfigDict, tp: int, moe: bool) -> tuple[int, int]:
    """(matmul outputs that `dots_saveable` keeps, other intermediates) of one layer per token."""
    d, e = m.d_model, m.moe
    heads, kv = -(-m.num_heads // tp), -(-m.num_kv_heads // tp)
    if m.attention_kind == "mla":
        a = m.mla
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        # q (and its low-rank input), the latent row, k_nope and v per head; output projection
        saved = a.q_lora_rank + heads * qk + a.kv_lora_rank + a.qk_rope_head_dim
        saved += heads * (a.qk_nope_head_dim + a.v_head_dim) + d
        other = 2 * d + 2 * heads * qk  # the two normed inputs; assembled keys, v-padded attention output
    else:
        saved = (heads + 2 * kv) * m.head_dim + d  # q, k, v projections; output projection
        other = 2 * d + heads * m.head_dim  # the two normed inputs; attention output
    if not moe:
        f = -(-m.d_ff // tp)
        return saved + 2 * f + d, other + f  # gate, up, down outputs; silu(gate) * up
    fe, fs = -(-e.d_ff // tp), -(-(e.shared_d_ff * e.num_shared_experts) // tp)
    saved += e.num_experts + (2 * fs + d if fs else 0)  # router logits; shared-expert matmuls
    # Routed experts run as ragged_dot, not dot_general, so dots_saveable keeps none of them.
    other += e.top_k * (2 * d + 3 * fe) + fs  # per assignment: gathered x, gate, up, product, out
    return saved, other


def activation_bytes_per_device(
    cfg: ConfigDict, mesh_shape: Mapping[str, int], batch: int, seq_len: int
) -> int:
    """Activation bytes of one training step on one device: a simple model, not XLA's figure.

    A device holds b = ceil(batch / (data*fsdp*expert)) rows of t = ceil(seq_len / sequence)
    tokens. Per token and layer, in compute dtype, heads and widths divided by tp = tensor size:
      residual        D, the layer's input (the scan carry)
      matmul outputs  q, k, v and output projections; dense MLP gate, up, down; router logits;
                      shared-expert matmuls
      other           normed inputs, attention output, SwiGLU products, routed-expert tensors
    plus the attention probabilities of each row in f32: [heads/tp, t, t] with attention_impl
    'reference', about half of that with 'query_blocked' (autodiff keeps every causal block); the O(t) kernels
    (chunked, flash, ring) keep only per-block scratch, counted as zero here.
    cfg.model.remat decides what is kept for the backward pass:
      'full'           every layer's residual + one layer's matmul outputs and other
      'dots_saveable'  every layer's residual and matmul outputs + one layer's other
      'none'           every layer's residual, matmul outputs and other
    and in all cases the f32 logits and log-probabilities, 2 * ceil(V/tp) * 4 bytes per token.
    """
    m = cfg.model
    sizes = mesh_sizes(mesh_shape)
    tp = sizes["tensor"]
    rows = -(-batch // (sizes["data"] * sizes["fsdp"] * sizes["expert"]))
    t = -(-seq_len // sizes["sequence"])
    tokens, c = rows * t, jnp.dtype(m.compute_dtype).itemsize
    score_rows = {"reference": t, "query_blocked": (t + 128) // 2}.get(m.attention_impl, 0)
    probs = rows * -(-m.num_heads // tp) * score_rows * t * 4
    num_dense, num_moe = config_lib.layer_counts(m)
    every_layer = one_layer = 0
    for n, moe in ((num_dense, False), (num_moe, True)):
        if not n:
            continue
        saved, other = _layer_elems_per_token(m, tp, moe)
        if m.remat == "none":
            every_layer += n * (tokens * c * (m.d_model + saved + other) + probs)
        elif m.remat == "dots_saveable":
            every_layer += n * tokens * c * (m.d_model + saved)
            one_layer = max(one_layer, tokens * c * other + probs)
        else:
            every_layer += n * tokens * c * m.d_model
            one_layer = max(one_layer, tokens * c * (saved + other) + probs)
    logits = 2 * tokens * -(-m.vocab_size // tp) * 4
    return every_layer + one_layer + logits


def plan(
    cfg: ConfigDict,
    mesh_shape: Mapping[str, int],
    batch: int,
    seq_len: int,
    *,
    hbm_gib: float = 95.0,
) -> dict:
    """Counts, FLOPs per token and per-device bytes of an AdamW training step, JSON-ready.

    Gradients are f32 whatever param_dtype (the train step accumulates them in f32 over
    micro-batches), AdamW's mu and nu take twice the parameters' bytes (optax keeps them in the
    parameter dtype). `fits` compares the total with `hbm_gib`; `warnings` lists what
    a real run on this mesh would reject: dims that do not divide their mesh axes, a batch or a
    length that does not divide over its shards. With `cfg.rl.micro_batches` = M (a GRPO config),
    activations are those of one micro-batch of batch / M rows.

    With the expert-parallel shard_map on this mesh (`model.moe.parallel`), `ep_buffer_bytes_dropless`
    and `ep_buffer_bytes` are one exchange buffer [J * C, D] of one MoE layer on one device (compute
    dtype; four live around the layer: send and receive, there and back) for one micro-batch, with C
    dropless and under `model.moe.ep_capacity_factor`; None without that path. Not in the total.
    """
    sizes = mesh_sizes(mesh_shape)
    micro = int(cfg.rl.micro_batches) if "rl" in cfg else 1
    state = abstract_params(cfg)
    counts = _count(cfg, state)
    shards = param_bytes_per_device(cfg, sizes, state)
    param_bytes = sum(s.bytes_per_device for s in shards.values())
    grad_bytes = sum(
        s.bytes_per_device for s in param_bytes_per_device(cfg, sizes, state, dtype="float32").values()
    )
    activation_bytes = activation_bytes_per_device(cfg, sizes, -(-batch // micro), seq_len)
    total_bytes = 3 * param_bytes + grad_bytes + activation_bytes  # parameters, mu, nu; gradients
    batch_shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    warnings = [f"{p} does not divide over its mesh axes" for p, s in shards.items() if not s.even]
    if batch % batch_shards:
        warnings.append(f"batch {batch} does not divide over data*fsdp*expert = {batch_shards}")
    if seq_len % sizes["sequence"]:
        warnings.append(f"seq_len {seq_len} does not divide over sequence = {sizes['sequence']}")
    a2a = moe_parallel.all_to_all_bytes(cfg, sizes, -(-batch // micro), seq_len)
    return {
        "mesh": sizes,
        "devices": math.prod(sizes.values()),
        "batch": batch,
        "seq_len": seq_len,
        "micro_batches": micro,
        "remat": cfg.model.remat,
        **{f"params_{k}": v for k, v in counts.items()},
        "flops_per_token_train": _flops(cfg, counts, seq_len, True),
        "flops_per_token_forward": _flops(cfg, counts, seq_len, False),
        "kv_cache_bytes_per_token": kv_cache_bytes_per_token(cfg),
        "param_bytes_per_device": param_bytes,
        "expert_param_bytes_per_device": sum(s.bytes_per_device for s in shards.values() if s.expert),
        "grad_bytes_per_device": grad_bytes,
        "adamw_bytes_per_device": 2 * param_bytes,
        "activation_bytes_per_device": activation_bytes,
        "ep_capacity_factor": float(cfg.model.moe.get("ep_capacity_factor", 0.0)),
        "ep_buffer_bytes_dropless": None if a2a is None else a2a.dropless_buffer_bytes,
        "ep_buffer_bytes": None if a2a is None else a2a.buffer_bytes,
        "total_bytes_per_device": total_bytes,
        "hbm_gib": hbm_gib,
        "fits": total_bytes <= hbm_gib * 2**30,
        "warnings": warnings,
    }


def tokens_per_device(mesh_shape: Mapping[str, int], batch: int, seq_len: int) -> int:
    """Tokens of one device's rows: ceil(batch / (data*fsdp*expert)) * ceil(seq_len / sequence)."""
    sizes = mesh_sizes(mesh_shape)
    rows = -(-batch // (sizes["data"] * sizes["fsdp"] * sizes["expert"]))
    return rows * -(-seq_len // sizes["sequence"])


if __name__ == "__main__":
    # The planner's command is `python -m rl.plan` (it plans the main job: optimizer, sampler, XLA's
    # compile); this module keeps the model's own figures. The old command hands over to the new one.
    import os
    import sys

    print(f"model.plan: the planner is `python -m rl.plan {' '.join(sys.argv[1:])}`", file=sys.stderr)
    os.execv(sys.executable, [sys.executable, "-m", "rl.plan", *sys.argv[1:]])
