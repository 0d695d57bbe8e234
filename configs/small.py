"""python -m rl.plan --config=configs/small.py

Colab size: ~95M total parameters, ~29M active per token (16 experts top-2 plus one shared expert,
8 layers, d_model 512, vocab 8192). `configs/small.py:dense` replaces every MoE layer by a dense SwiGLU
of the same active width; `:capacity` uses the capacity MoE impl; `:attention=NAME` picks an attention
impl (default `auto`); `:experts=32` changes the expert count. Arguments are comma-separated.
"""

from configs import base

ARGS = {
    "attention=NAME": lambda m, name: m.update(attention_impl=name),
    "experts=N": lambda m, n: m.moe.update(num_experts=int(n)),
}


def get_config(arg: str | None = None):
    cfg = base.get_config()
    m = cfg.model
    m.update(vocab_size=8192, d_model=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64)
    m.qk_norm = True
    m.rope.theta = 1_000_000.0
    m.moe.update(num_experts=16, top_k=2, d_ff=384, num_shared_experts=1, shared_d_ff=384)
    # Dense variant: one SwiGLU as wide as the active experts (top_k + shared).
    m.d_ff = m.moe.d_ff * (m.moe.top_k + m.moe.num_shared_experts)
    # Eight layers unroll cheaply; on CPU the unrolled stack trains faster than the scan (which stacks
    # per-layer residuals with dynamic-update-slices). Pod configs keep scan_layers=True.
    m.scan_layers = False
    cfg.update(batch_size=8, seq_len=512)
    return base.apply_model_args(cfg, arg, "small.py", ARGS)
