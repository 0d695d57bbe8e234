"""Rollout memory and MoE all-to-all traffic for the planner (`python -m rl.plan --inference_mesh=...`).

Rollout memory: the engine's weights per device under the inference layout, the KV-cache bytes per token
per device, and how many sequences of a given context fit per device beside the weights in a given HBM.

Inference layout: the engine's (`inference.layout`): the training rules with `data`, `fsdp` (and
`sequence`) dropped from every weight's axes, so weights are tensor parallel over heads, kv heads, MLP
width and vocab, experts are split over `expert`, everything is replicated over data and fsdp (which,
like `expert`, hold different sequences), and a dim that does not divide its mesh axes is kept whole. KV
cache per device, the same rule as `inference.layout.page_shardings`: GQA keys and values are split over
`tensor` when num_kv_heads divides by it and are replicated over it otherwise; MLA's latent row is read
by every head, so it is replicated over `tensor`.

MoE all-to-all, per device per MoE layer for n tokens dispatched by that device (derivation in
`all_to_all_bytes_per_layer`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax.numpy as jnp
from ml_collections import ConfigDict

from configs.fields import DTYPES
from inference.layout import inference_config
from model import config as config_lib
from model import plan as plan_lib

# Cloud TPU v5p: "HBM2e capacity and bandwidth: 95 GB, 2765 GBps" per chip (cloud.google.com/tpu/docs/v5p,
# key specifications). The planner reads the 95 as GiB, its default since it was written; if the page's GB
# are 10**9 bytes, a chip has 88.5 GiB (pass --hbm_gib=88.5). Other chips: --hbm_gib (v5e 16 GB, v6e 32 GB,
# H100 80 GB, H200 141 GB, by their vendors' pages).
V5P_HBM_GIB = 95.0


def inference_weight_bytes_per_device(
    cfg: ConfigDict, mesh_shape: Mapping[str, int], dtype: str | None = None, state=None
) -> dict[str, plan_lib.Shard]:
    """'/'-joined parameter path -> `Shard` under the inference layout, in `dtype` (default: each
    parameter's own, what `inference.Engine` holds when given the trainer's params). A dim that does
    not divide its mesh axes is kept whole (replicated over them; `Shard.even` is False)."""
    infer = inference_config(cfg)
    return plan_lib.param_bytes_per_device(infer, mesh_shape, state, dtype=dtype, replicate_uneven=True)


def kv_sharded_over_tensor(cfg: ConfigDict, tensor: int) -> bool:
    """Whether each device holds 1/tensor of the KV cache: GQA with num_kv_heads divisible by tensor."""
    m = cfg.model
    return m.attention_kind != "mla" and m.num_kv_heads % tensor == 0


def kv_bytes_per_token_per_device(cfg: ConfigDict, tensor: int, dtype: str | None = None) -> int:
    """KV-cache bytes one device holds per token of a sequence (all layers)."""
    total = plan_lib.kv_cache_bytes_per_token(cfg, dtype)
    return total // tensor if kv_sharded_over_tensor(cfg, tensor) else total


def rollout_plan(
    cfg: ConfigDict,
    mesh_shape: Mapping[str, int],
    *,
    context: int,
    hbm_gib: float = V5P_HBM_GIB,
    weight_dtype: str | None = None,
    kv_dtype: str | None = None,
    state=None,
) -> dict:
    """Weights, KV bytes per token and sequences of `context` tokens that fit, per device, JSON-ready.

    sequences_per_device = floor((hbm_gib * 2**30 - weight bytes) / (context * KV bytes per token per
    device)): the KV of that many sequences fits in what the weights leave. A device of a tensor group
    holds its share (or, replicated, all) of the same sequences, so the mesh holds sequences_per_device *
    devices / tensor sequences at once. Not counted: the decode step's activations and logits, XLA's
    scratch, a draft model's or MTP module's weights and cache, page rounding (context is rounded to
    whole pages by the engine).
    """
    if context < 1:
        raise ValueError(f"--context={context}: the context length must be at least 1 token")
    for flag, dtype in (("--inference_dtype", weight_dtype), ("--kv_dtype", kv_dtype)):
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"{flag}={dtype!r}: use one of {DTYPES}")
    sizes = plan_lib.mesh_sizes(mesh_shape)
    tp = sizes["tensor"]
    shards = inference_weight_bytes_per_device(cfg, sizes, weight_dtype, state)
    weights = sum(s.bytes_per_device for s in shards.values())
    kv_dtype = kv_dtype or cfg.model.compute_dtype
    kv_token = kv_bytes_per_token_per_device(cfg, tp, kv_dtype)
    free = int(hbm_gib * 2**30) - weights
    per_device = max(free, 0) // (context * kv_token)
    devices = math.prod(sizes.values())
    warnings = [
        f"{p} does not divide over its mesh axes: replicated" for p, s in shards.items() if not s.even
    ]
    if free < 0:
        warnings.append(f"the weights alone ({weights / 2**30:.1f} GiB) exceed {hbm_gib:g} GiB per device")
    if sizes["sequence"] > 1:
        warnings.append("sequence > 1: the engine does not split a sequence's KV over the sequence axis")
    return {
        "inference_mesh": sizes,
        "inference_devices": devices,
        "weight_dtype": weight_dtype or "param_dtype",
        "kv_dtype": kv_dtype,
        "weight_bytes_per_device": weights,
        "expert_weight_bytes_per_device": sum(s.bytes_per_device for s in shards.values() if s.expert),
        "kv_cache_bytes_per_token": plan_lib.kv_cache_bytes_per_token(cfg, kv_dtype),
        "kv_sharded_over_tensor": kv_sharded_over_tensor(cfg, tp),
        "kv_bytes_per_token_per_device": kv_token,
        "context": context,
        "kv_bytes_per_sequence_per_device": context * kv_token,
        "hbm_gib": hbm_gib,
        "sequences_per_device": per_device,
        "sequences_on_mesh": per_device * (devices // tp),
        "rollout_warnings": warnings,
    }


def all_to_all_bytes_per_layer(tokens: int, top_k: int, d_model: int, itemsize: int, expert: int) -> int:
    """Bytes one device sends in one MoE layer's forward: dispatch + combine.

    Each of the device's `tokens` goes to top_k experts, so it dispatches tokens * top_k rows of d_model
    values. With the experts spread evenly over the `expert` axis (ep devices) and routing balanced, a
    row lands on each device with probability 1/ep, so (ep - 1)/ep of the rows leave the device; the
    combine sends each expert output back the same way. Hence

        bytes = 2 * tokens * top_k * d_model * itemsize * (ep - 1) / ep

    It is also what the device receives (balanced routing is symmetric). This is the dropless (ragged)
    exchange, where only real rows move; a padded exchange sends every slot of its fixed buffer, full or
    not, so more (how much depends on the dispatch's slot count). The backward pass of training sends
    the same again (the transposes of the two all-to-alls), so a training step moves twice this per
    layer. Skewed routing makes some devices send and receive more than this mean.
    """
    if expert < 1:
        raise ValueError(f"mesh expert axis={expert}: it must be at least 1")
    return 2 * tokens * top_k * d_model * itemsize * (expert - 1) // expert


def all_to_all_plan(
    cfg: ConfigDict, mesh_shape: Mapping[str, int], tokens_per_device: int, *, micro_batches: int = 1
) -> dict:
    """All-to-all bytes per device for a mesh with expert > 1 (an empty dict otherwise), JSON-ready:
    per MoE layer, per forward (all MoE layers) and per train step (forward and backward of each of
    `micro_batches` micro-batches of `tokens_per_device` tokens)."""
    m, sizes = cfg.model, plan_lib.mesh_sizes(mesh_shape)
    ep, e = sizes["expert"], m.moe
    if ep <= 1 or not e.num_experts:
        return {}
    itemsize = jnp.dtype(m.compute_dtype).itemsize
    ragged = all_to_all_bytes_per_layer(tokens_per_device, e.top_k, m.d_model, itemsize, ep)
    num_moe = config_lib.layer_counts(m)[1]
    return {
        "a2a_tokens_per_device": tokens_per_device,
        "a2a_bytes_per_layer": ragged,
        "a2a_moe_layers": num_moe,
        "a2a_bytes_per_forward": ragged * num_moe,
        "a2a_bytes_per_train_step": 2 * ragged * num_moe * micro_batches,
    }
