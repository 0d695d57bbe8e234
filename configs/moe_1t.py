"""python -m rl.plan --config=configs/moe_1t.py --mesh=fsdp:16,expert:64 --batch=1024

(1,024 chips, e.g. a TPU v5p-2048 slice: 59 GiB a chip of its 95 for a 1024 x 4096-token step.)

Trillion-parameter class: Kimi K2's published geometry (moonshotai/Kimi-K2-Instruct config.json). 61
layers, d_model 7168, the first layer dense (width 18432), then 384 routed experts (top-8, width 2048)
plus 1 shared expert, sigmoid routing with an aux-loss-free selection bias, routed scaling 2.827; MLA
with 64 heads: q_lora 1536, kv_lora 512, qk_nope 128, qk_rope 64, v_head 128; vocab 163840; YaRN RoPE
(x32 from 4k, mscale = mscale_all_dim = 1). `model.plan`: 1.027T total, 32.9B active parameters
(published: ~1.04T / 32B); the MLA cache holds 61 x 576 values per token (68.6 KiB in bf16). The same
architecture as DeepSeek-V3, so this file starts from `configs/deepseek_v3.py` and sets what differs.
"""

from configs import deepseek_v3


def get_config(arg: str | None = None):
    cfg = deepseek_v3.get_config(arg)
    m = cfg.model
    m.update(vocab_size=163_840, num_heads=64, num_kv_heads=64)
    m.rope.update(theta=50_000.0, factor=32.0, beta_fast=1.0)
    m.moe.update(num_experts=384, n_group=1, topk_group=1, first_dense_layers=1, routed_scaling=2.827)
    cfg.mesh.shape.fsdp = 32
    # One 4k-token sequence per data*fsdp*expert shard: 16384 x 4096 = 67M tokens per step.
    cfg.batch_size = 16_384
    return cfg
