"""python -m rl.plan --config=configs/moe_30b.py --mesh=fsdp:16,expert:8

Qwen3-30B-A3B geometry: 48 layers, d_model 2048, 32 query / 4 kv heads of 128, QK-norm, 128 experts
(top-8, width 768, renormalised), no shared expert, vocab 151936. ~30.5B total, ~3.3B active.
"""

from configs import base


def get_config(arg: str | None = None):
    del arg
    cfg = base.get_config()
    m = cfg.model
    m.update(vocab_size=151_936, d_model=2048, num_layers=48, d_ff=6144, num_heads=32, num_kv_heads=4)
    m.update(head_dim=128, qk_norm=True, remat="full", compute_dtype="bfloat16")
    m.rope.theta = 1_000_000.0
    m.moe.update(num_experts=128, top_k=8, d_ff=768, load_balance_weight=1e-3)
    cfg.mesh.shape.update(data=1, fsdp=16, expert=8)
    cfg.update(batch_size=256, seq_len=4096)
    return cfg
