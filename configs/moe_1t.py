"""python -m model.plan --config=configs/moe_1t.py --mesh=data:8,fsdp:32,expert:64,tensor:4

Trillion-parameter class (Kimi-K2-like geometry with GQA instead of MLA): 61 layers, d_model 7168,
the first layer dense (width 18432), then 384 routed experts (top-8, width 2048) plus 1 shared expert,
sigmoid routing with an aux-loss-free selection bias, 64 query / 8 kv heads of 128, vocab 163840,
YaRN RoPE (x32 from 4k). ~1.03T total, ~35B active parameters.
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
    m.num_kv_heads = 8
    m.head_dim = 128
    m.d_ff = 18_432
    m.qk_norm = True
    m.rope.theta = 50_000.0
    m.rope.scaling = "yarn"
    m.rope.factor = 32.0
    m.rope.original_max_position = 4096
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
