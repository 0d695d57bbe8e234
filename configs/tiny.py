"""python -m model.demo --config=configs/tiny.py

The test size: ~0.3M parameters, 2 layers, 4 routed experts (top-2) plus one shared expert, byte vocab.
`configs/tiny.py:dense` gives the same model with dense MLPs; `:capacity` uses the capacity MoE impl;
`:deepseek` is a DeepSeek-V3 / Kimi K2-like model of the same size: MLA with the query low-rank path, the
sigmoid router over 8 experts in 2 groups (a token uses 1), one dense first layer, one MTP module (it exports
as DeepseekV3ForCausalLM). Arguments are comma-separated and applied in order.
"""

from configs import base


def get_config(arg: str | None = None):
    cfg = base.get_config()
    m = cfg.model
    m.update(vocab_size=256, d_model=64, num_layers=2, d_ff=128, num_heads=4, num_kv_heads=2, head_dim=16)
    m.qk_norm = True
    m.moe.update(num_experts=4, top_k=2, d_ff=96, num_shared_experts=1, shared_d_ff=64)
    cfg.update(batch_size=8, seq_len=32)
    return base.apply_model_args(cfg, arg, "tiny.py", {"deepseek": lambda m, _: _deepseek(m)})


def _deepseek(m) -> None:
    """The DeepSeek-V3 layout at the tiny size (the fields `model.io.hf_config.from_hf` sets for it)."""
    m.attention_kind = "mla"
    m.qk_norm = False
    m.mla.update(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    m.num_kv_heads = m.num_heads  # MLA expands every head's keys from the one latent
    m.head_dim = m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim
    e = m.moe
    e.router, e.num_experts, e.top_k, e.d_ff = "sigmoid", 8, 2, 48
    e.n_group, e.topk_group, e.routed_scaling = 2, 1, 2.5
    e.num_shared_experts, e.shared_d_ff = 1, e.d_ff  # DeepSeek-V3's shared experts are expert-wide
    e.first_dense_layers = 1
    m.mtp_layers = 1
