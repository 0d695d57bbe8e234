"""python -m model.plan --config=configs/deepseek_v3.py --mesh=fsdp:16,expert:64 --batch=1024

(1,024 chips: 82 GiB a chip of a TPU v5p's 95 for a 1024 x 4096-token step.)

DeepSeek-V3's published geometry (deepseek-ai/DeepSeek-V3 config.json; DeepSeek-V3.1 / R1 share it):
61 layers, d_model 7168, the first 3 layers dense (width 18432), then 256 routed experts (top-8 within
4 of 8 groups, width 2048) plus 1 shared expert, sigmoid routing with a selection bias, routed scaling
2.5; MLA with 128 heads: q_lora 1536, kv_lora 512, qk_nope 128, qk_rope 64, v_head 128; vocab 129280;
YaRN RoPE (x40 from 4k, mscale = mscale_all_dim = 1). `model.plan`: 671B total, 37.5B active
parameters (published: 671B / 37B, the MTP module's 14B not included); the MLA cache holds
61 x 576 values per token (68.6 KiB = 70,272 bytes in bf16).
"""

from configs import base


def get_config(arg: str | None = None):
    del arg
    cfg = base.get_config()
    m = cfg.model
    m.vocab_size = 129_280
    m.d_model = 7168
    m.num_layers = 61
    m.num_heads = 128
    m.num_kv_heads = 128  # unused by MLA
    m.head_dim = 192  # qk_nope + qk_rope: informational under MLA
    m.d_ff = 18_432
    m.attention_kind = "mla"
    m.mla.q_lora_rank = 1536
    m.mla.kv_lora_rank = 512
    m.mla.qk_nope_head_dim = 128
    m.mla.qk_rope_head_dim = 64
    m.mla.v_head_dim = 128
    m.rope.theta = 10_000.0
    m.rope.scaling = "yarn"
    m.rope.factor = 40.0
    m.rope.original_max_position = 4096
    m.rope.beta_fast = 32.0
    m.rope.beta_slow = 1.0
    m.rope.mscale = 1.0
    m.rope.mscale_all_dim = 1.0
    m.moe.num_experts = 256
    m.moe.top_k = 8
    m.moe.n_group = 8
    m.moe.topk_group = 4
    m.moe.d_ff = 2048
    m.moe.num_shared_experts = 1
    m.moe.shared_d_ff = 2048
    m.moe.first_dense_layers = 3
    m.moe.router = "sigmoid"
    m.moe.renormalize = True
    m.moe.routed_scaling = 2.5
    m.moe.load_balance_weight = 1e-4
    m.remat = "full"
    m.param_dtype = "float32"
    m.compute_dtype = "bfloat16"
    cfg.mesh.shape.data = 8
    cfg.mesh.shape.fsdp = 16
    cfg.mesh.shape.expert = 64
    cfg.mesh.shape.tensor = 4
    cfg.batch_size = 8192
    cfg.seq_len = 4096
    return cfg
