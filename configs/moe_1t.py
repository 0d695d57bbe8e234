"""python -m model.plan --config=configs/moe_1t.py --mesh=fsdp:16,expert:64 --batch=1024

(1,024 chips, e.g. a TPU v5p-2048 slice: 59 GiB a chip of its 95 for a 1024 x 4096-token step.)

Trillion-parameter class: Kimi K2's published geometry (moonshotai/Kimi-K2-Instruct config.json). 61
layers, d_model 7168, the first layer dense (width 18432), then 384 routed experts (top-8, width 2048)
plus 1 shared expert, sigmoid routing with an aux-loss-free selection bias, routed scaling 2.827; MLA
with 64 heads: q_lora 1536, kv_lora 512, qk_nope 128, qk_rope 64, v_head 128; vocab 163840; YaRN RoPE
(x32 from 4k, mscale = mscale_all_dim = 1). `model.plan`: 1.027T total, 32.9B active parameters
(published: ~1.04T / 32B); the MLA cache holds 61 x 576 values per token (68.6 KiB in bf16).
"""

from configs import base


def get_config(arg: str | None = None):
    del arg
    cfg = base.get_config()
    m = cfg.model
    m.vocab_size = 163_840
    m.d_model = 7168
    m.num_layers = 61
    m.num_heads = 64
    m.num_kv_heads = 64  # unused by MLA (every head's keys are expanded from the one latent)
    m.head_dim = 192  # qk_nope + qk_rope: informational under MLA
    m.d_ff = 18_432
    m.attention_kind = "mla"
    m.mla.q_lora_rank = 1536
    m.mla.kv_lora_rank = 512
    m.mla.qk_nope_head_dim = 128
    m.mla.qk_rope_head_dim = 64
    m.mla.v_head_dim = 128
    m.rope.theta = 50_000.0
    m.rope.scaling = "yarn"
    m.rope.factor = 32.0
    m.rope.original_max_position = 4096
    m.rope.beta_fast = 1.0
    m.rope.beta_slow = 1.0
    m.rope.mscale = 1.0
    m.rope.mscale_all_dim = 1.0
    m.moe.num_experts = 384
    m.moe.top_k = 8
    m.moe.d_ff = 2048
    m.moe.num_shared_experts = 1
    m.moe.shared_d_ff = 2048
    m.moe.first_dense_layers = 1
    m.moe.router = "sigmoid"
    m.moe.renormalize = True
    m.moe.routed_scaling = 2.827
    m.moe.load_balance_weight = 1e-4
    m.remat = "full"
    m.param_dtype = "float32"
    m.compute_dtype = "bfloat16"
    cfg.mesh.shape.data = 8
    cfg.mesh.shape.fsdp = 32
    cfg.mesh.shape.expert = 64
    cfg.mesh.shape.tensor = 4
    # One 4k-token sequence per data*fsdp*expert shard: 16384 x 4096 = 67M tokens per step.
    cfg.batch_size = 16_384
    cfg.seq_len = 4096
    return cfg
