"""python -m rl.plan --config=configs/deepseek_v3.py --mesh=fsdp:16,expert:64 --batch=1024

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
    m.update(vocab_size=129_280, d_model=7168, num_layers=61, d_ff=18_432)
    m.update(remat="full", compute_dtype="bfloat16")
    # MLA: num_kv_heads is unused (every head's keys are expanded from the one latent); head_dim is
    # qk_nope + qk_rope, informational.
    m.update(attention_kind="mla", num_heads=128, num_kv_heads=128, head_dim=192)
    m.mla.update(q_lora_rank=1536, kv_lora_rank=512, v_head_dim=128)
    m.mla.update(qk_nope_head_dim=128, qk_rope_head_dim=64)
    m.rope.update(theta=10_000.0, scaling="yarn", factor=40.0, original_max_position=4096)
    m.rope.update(beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    m.moe.update(num_experts=256, top_k=8, n_group=8, topk_group=4, d_ff=2048, first_dense_layers=3)
    m.moe.update(num_shared_experts=1, shared_d_ff=2048, router="sigmoid", routed_scaling=2.5)
    m.moe.update(load_balance_weight=1e-4)
    cfg.mesh.shape.update(data=8, fsdp=16, expert=64, tensor=4)
    cfg.update(batch_size=8192, seq_len=4096)
    return cfg
