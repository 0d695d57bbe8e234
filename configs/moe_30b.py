"""python -m model.plan --config=configs/moe_30b.py --mesh=fsdp:16,expert:8

Qwen3-30B-A3B geometry: 48 layers, d_model 2048, 32 query / 4 kv heads of 128, QK-norm, 128 experts
(top-8, width 768, renormalised), no shared expert, vocab 151936. ~30.5B total, ~3.3B active.
"""

from configs import base


def get_config(arg: str | None = None):
    del arg
    cfg = base.get_config()
    m = cfg.model
    m.vocab_size = 151_936
    m.d_model = 2048
    m.num_layers = 48
    m.num_heads = 32
    m.num_kv_heads = 4
    m.head_dim = 128
    m.d_ff = 6144
    m.qk_norm = True
    m.norm_eps = 1e-6
    m.rope.theta = 1_000_000.0
    m.moe.num_experts = 128
    m.moe.top_k = 8
    m.moe.d_ff = 768
    m.moe.num_shared_experts = 0
    m.moe.renormalize = True
    m.moe.load_balance_weight = 1e-3
    m.remat = "full"
    m.param_dtype = "float32"
    m.compute_dtype = "bfloat16"
    cfg.mesh.shape.data = 1
    cfg.mesh.shape.fsdp = 16
    cfg.mesh.shape.expert = 8
    cfg.batch_size = 256
    cfg.seq_len = 4096
    return cfg
