"""python -m model.plan --config=configs/small.py

Colab size: ~95M total parameters, ~29M active per token (16 experts top-2 plus one shared expert,
8 layers, d_model 512, vocab 8192). `configs/small.py:dense` replaces every MoE layer by a dense SwiGLU
of the same active width; `:capacity` uses the capacity MoE impl; `:attention=NAME` picks an attention
impl (default `auto`); `:experts=32` changes the expert count.
"""

from configs import base


def get_config(arg: str | None = None):
    cfg = base.get_config()
    m = cfg.model
    m.vocab_size = 8192
    m.d_model = 512
    m.num_layers = 8
    m.num_heads = 8
    m.num_kv_heads = 4
    m.head_dim = 64
    m.qk_norm = True
    m.rope.theta = 1_000_000.0
    m.moe.num_experts = 16
    m.moe.top_k = 2
    m.moe.d_ff = 384
    m.moe.num_shared_experts = 1
    m.moe.shared_d_ff = 384
    # Dense variant: one SwiGLU as wide as the active experts (top_k + shared).
    m.d_ff = m.moe.d_ff * (m.moe.top_k + m.moe.num_shared_experts)
    # Eight layers unroll cheaply; on CPU the unrolled stack trains ~15% faster than the scan (which
    # stacks per-layer residuals with dynamic-update-slices). Pod configs keep scan_layers=True.
    m.scan_layers = False
    cfg.batch_size = 8
    cfg.seq_len = 512
    for a in (arg or "").split(","):
        if a == "dense":
            m.moe.num_experts = 0
        elif a == "capacity":
            m.moe.impl = "capacity"
        elif a.startswith("attention="):
            m.attention_impl = a.split("=", 1)[1]
        elif a.startswith("experts="):
            m.moe.num_experts = int(a.split("=", 1)[1])
        elif a:
            raise ValueError(
                f"configs/small.py: unknown argument {a!r}; use dense, capacity, attention=NAME or experts=N"
            )
    return cfg
