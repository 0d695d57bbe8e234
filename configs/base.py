"""python -m model.plan --config=configs/base.py

Defaults shared by every config. Other files start from `base.get_config()` and change what differs.

Layout:
  model.*       architecture (sizes, attention, rope, MoE, dtypes, scan/remat)
  mesh.shape    mesh axis sizes, in the fixed order data, fsdp, expert, tensor, sequence
  mesh.rules    logical axis name -> mesh axes (model code names logical axes only)
"""

import ml_collections

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


def model_defaults() -> ml_collections.ConfigDict:
    m = ml_collections.ConfigDict()
    m.vocab_size = 256
    m.d_model = 64
    m.num_layers = 2
    m.num_heads = 4
    m.num_kv_heads = 2
    m.head_dim = 16
    m.d_ff = 128  # width of dense (non-MoE) SwiGLU layers
    m.norm_eps = 1e-6
    m.tie_embeddings = False
    m.qk_norm = False  # Qwen3-style per-head RMSNorm on queries and keys
    m.attention_impl = "auto"  # flash on TPU/GPU, chunked elsewhere (model/attention.py)
    m.attention_bias = False  # Qwen2 uses a bias on q/k/v projections

    m.rope = ml_collections.ConfigDict()
    m.rope.theta = 10_000.0
    m.rope.scaling = "none"  # none | linear | llama3 | yarn
    m.rope.factor = 1.0
    m.rope.original_max_position = 4096
    m.rope.low_freq_factor = 1.0  # llama3
    m.rope.high_freq_factor = 4.0  # llama3
    m.rope.beta_fast = 32.0  # yarn
    m.rope.beta_slow = 1.0  # yarn

    m.moe = ml_collections.ConfigDict()
    m.moe.num_experts = 0  # 0: every layer is dense
    m.moe.top_k = 2
    m.moe.d_ff = 128  # width of one routed expert
    m.moe.num_shared_experts = 0
    m.moe.shared_d_ff = 128  # width of one shared expert
    m.moe.first_dense_layers = 0  # the first N layers use the dense MLP (DeepSeek/Kimi style)
    m.moe.router = "softmax"  # softmax | sigmoid (DeepSeek-V3: sigmoid scores, selection bias)
    m.moe.renormalize = True  # renormalise the top-k weights to sum to one
    m.moe.routed_scaling = 1.0  # multiplies the routed output (DeepSeek-V3 uses 2.5)
    m.moe.impl = "ragged"  # ragged (dropless) | capacity
    m.moe.capacity_factor = 1.25  # capacity impl: slots per expert = factor * tokens * top_k / E
    m.moe.load_balance_weight = 0.01
    m.moe.z_loss_weight = 1e-3
    m.moe.bias_update_rate = 1e-3  # aux-loss-free balancing: step size of the selection bias

    m.scan_layers = True
    m.remat = "none"  # none | full | dots_saveable
    m.param_dtype = "float32"
    m.compute_dtype = "float32"
    return m


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
