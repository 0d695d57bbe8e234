"""python -m model.plan --config=configs/base.py

Defaults shared by every config. Other files start from `base.get_config()` and change what differs.

Layout:
  model.*       architecture (sizes, attention, rope, MoE, dtypes, scan/remat)
  mesh.shape    mesh axis sizes, in the fixed order data, fsdp, expert, tensor, sequence
  mesh.rules    logical axis name -> mesh axes (model code names logical axes only)
"""

import ml_collections

from configs import schema
from configs.schema import Bool, Choice, Float, Int

MESH_AXES = ("data", "fsdp", "expert", "tensor", "sequence")

# Logical axis -> mesh axes. Parameters use the bare names, activations the `act_` names, so a
# parameter dimension (FSDP-sharded `embed`) and an activation dimension (replicated `act_embed`)
# can map differently.
DEFAULT_RULES = (
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("exp", "expert"),
    ("layers", None),
    ("norm", None),
    # activations
    ("act_batch", ("data", "fsdp", "expert")),
    ("act_length", "sequence"),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    ("act_exp", "expert"),
    ("act_tokens", ("data", "fsdp")),
)


def _attention_impls() -> tuple:
    from model.attention import ATTENTION_IMPLS  # late: configs stay importable without JAX

    return tuple(sorted(ATTENTION_IMPLS))


DTYPES = ("float32", "bfloat16", "float16")

# Every model field: default, what it does, allowed values. Rules tying fields together (heads divisible by
# kv heads, top_k <= num_experts, sizes divisible by mesh axes) are in model/config.py.
MODEL = {
    "vocab_size": Int(256, "token vocabulary size", lo=1),
    "d_model": Int(64, "residual stream width", lo=1),
    "num_layers": Int(2, "transformer blocks", lo=1),
    "num_heads": Int(4, "query heads (a multiple of num_kv_heads)", lo=1),
    "num_kv_heads": Int(2, "key/value heads (GQA)", lo=1),
    "head_dim": Int(16, "width of one attention head (even, for RoPE)", lo=2),
    "d_ff": Int(128, "width of dense (non-MoE) SwiGLU layers", lo=1),
    "norm_eps": Float(1e-6, "RMSNorm epsilon", lo=0, lo_open=True),
    "tie_embeddings": Bool(False, "the output projection is the embedding matrix"),
    "qk_norm": Bool(False, "Qwen3-style per-head RMSNorm on queries and keys"),
    "attention_impl": Choice(
        "auto", "auto: flash on TPU/GPU, chunked elsewhere (model/attention.py)", _attention_impls
    ),
    "attention_bias": Bool(False, "a bias on the q/k/v projections (Qwen2)"),
    "attention_kind": Choice(
        "gqa", "gqa: grouped-query attention; mla: multi-head latent attention (DeepSeek-V3)", ("gqa", "mla")
    ),
    "mla.q_lora_rank": Int(0, "mla: width of the query low-rank path; 0: a full query projection", lo=0),
    "mla.kv_lora_rank": Int(32, "mla: width of the compressed KV latent (what the cache holds)", lo=1),
    "mla.qk_nope_head_dim": Int(16, "mla: per-head query/key width without RoPE", lo=1),
    "mla.qk_rope_head_dim": Int(
        8, "mla: query/key RoPE width, the key part shared by all heads (even)", lo=2
    ),
    "mla.v_head_dim": Int(16, "mla: per-head value width", lo=1),
    "mla.rope_interleave": Bool(
        True, "mla: RoPE pairs are adjacent dims (x0, x1) as in DeepSeek checkpoints"
    ),
    "rope.theta": Float(10_000.0, "RoPE base", lo=0, lo_open=True),
    "rope.scaling": Choice("none", "context extension of RoPE", ("none", "linear", "llama3", "yarn")),
    "rope.factor": Float(1.0, "context extension factor (scaling != none)", lo=1),
    "rope.original_max_position": Int(4096, "pre-training context of a scaled RoPE", lo=1),
    "rope.low_freq_factor": Float(1.0, "llama3 scaling: low-frequency band edge", lo=0, lo_open=True),
    "rope.high_freq_factor": Float(
        4.0, "llama3 scaling: high-frequency band edge (> low)", lo=0, lo_open=True
    ),
    "rope.beta_fast": Float(32.0, "yarn scaling: fast ramp edge (rotations)", lo=0, lo_open=True),
    "rope.beta_slow": Float(1.0, "yarn scaling: slow ramp edge (rotations)", lo=0, lo_open=True),
    "rope.mscale": Float(
        0.0, "yarn: cos/sin scale numerator coefficient (0 with mscale_all_dim 0: default)", lo=0
    ),
    "rope.mscale_all_dim": Float(
        0.0, "yarn: cos/sin scale denominator; mla also scales the softmax by its mscale^2 (DeepSeek)", lo=0
    ),
    "moe.num_experts": Int(0, "routed experts per MoE layer; 0: every layer is dense", lo=0),
    "moe.top_k": Int(2, "experts per token (<= num_experts)", lo=1),
    "moe.d_ff": Int(128, "width of one routed expert", lo=1),
    "moe.num_shared_experts": Int(0, "experts every token goes through", lo=0),
    "moe.shared_d_ff": Int(128, "width of one shared expert", lo=1),
    "moe.first_dense_layers": Int(0, "the first N layers use the dense MLP (DeepSeek/Kimi style)", lo=0),
    "moe.router": Choice(
        "softmax", "sigmoid: DeepSeek-V3 scores with a selection bias", ("softmax", "sigmoid")
    ),
    "moe.n_group": Int(1, "group-limited routing: expert groups (DeepSeek-V3: 8); 1: plain top-k", lo=1),
    "moe.topk_group": Int(1, "group-limited routing: groups a token may use (<= n_group)", lo=1),
    "moe.renormalize": Bool(True, "renormalise the top-k weights to sum to one"),
    "moe.routed_scaling": Float(1.0, "multiplies the routed output (DeepSeek-V3: 2.5)", lo=0, lo_open=True),
    "moe.impl": Choice(
        "ragged", "ragged (dropless) or capacity (fixed slots per expert)", ("ragged", "capacity")
    ),
    "moe.capacity_factor": Float(
        1.25, "capacity impl: slots per expert = factor * tokens * top_k / E", lo=0, lo_open=True
    ),
    "moe.expert_parallel": Choice(
        "auto",
        "with experts sharded: auto (shard_map + all-to-all where the layout allows, else GSPMD), "
        "shard_map (refuse layouts it cannot run), gspmd",
        ("auto", "shard_map", "gspmd"),
    ),
    "moe.ep_exchange": Choice(
        "auto",
        "the expert-parallel shard_map's all-to-all: padded (every slot sent), ragged "
        "(jax.lax.ragged_all_to_all, only the filled slots; TPU/GPU, not yet run on any); auto: padded",
        ("auto", "padded", "ragged"),
    ),
    "moe.ep_capacity_factor": Float(
        0.0,
        "expert-parallel shard_map: slots per (sender, receiver) shard pair "
        "C = ceil(factor * T' * top_k / J) (T' tokens per shard, J expert shards); assignments past C are "
        "dropped and counted (moe/dropped_fraction); 0: dropless, C = T' * min(top_k, experts per shard)",
        lo=0,
    ),
    "moe.gather_max_tokens": Int(
        0,
        "token counts (batch x length) at or below this gather each token's top-k experts' weights instead "
        "of sort/dispatch; -1: while tokens * top_k <= num_experts; 0: never",
        lo=-1,
    ),
    "moe.every_expert_max_tokens": Int(
        -1,
        "token counts (batch x length) at or below this run every expert on every token (three matmuls over "
        "the stacked experts, the top-k routing weights zeroing the rest) instead of sort/dispatch; -1: in "
        "the decoding engine's calls of up to max_batch x (num_draft + 1) tokens, never training; 0: never",
        lo=-1,
    ),
    "moe.load_balance_weight": Float(0.01, "weight of the load-balancing auxiliary loss", lo=0),
    "moe.z_loss_weight": Float(1e-3, "weight of the router z-loss", lo=0),
    "moe.bias_update_rate": Float(1e-3, "aux-loss-free balancing: step size of the selection bias", lo=0),
    "mtp_layers": Int(
        0,
        "multi-token-prediction modules after the last layer (DeepSeek-V3: 1; HF num_nextn_predict_layers)",
        lo=0,
    ),
    "scan_layers": Bool(
        True, "one scanned block per layer kind: one layer compiled, not L (2 compile faster unrolled)"
    ),
    "remat": Choice(
        "none", "activation recomputation in the backward pass", ("none", "full", "dots_saveable")
    ),
    "param_dtype": Choice("float32", "dtype of the stored parameters", DTYPES),
    "compute_dtype": Choice("float32", "dtype of activations and matmuls", DTYPES),
}


def model_defaults() -> ml_collections.ConfigDict:
    return schema.build(MODEL)


def mesh_defaults() -> ml_collections.ConfigDict:
    mesh = ml_collections.ConfigDict()
    # -1 on one axis means "all remaining devices". Sizes must multiply to the device count.
    mesh.shape = ml_collections.ConfigDict({a: 1 for a in MESH_AXES})
    mesh.shape.data = -1
    mesh.rules = DEFAULT_RULES
    return mesh


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg
    cfg = ml_collections.ConfigDict()
    cfg.model = model_defaults()
    cfg.mesh = mesh_defaults()
    cfg.seed = 0
    # Sizes used by the planner's activation estimate and by the demo.
    cfg.batch_size = 8
    cfg.seq_len = 64
    return cfg
