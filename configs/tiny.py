"""python -m model.demo --config=configs/tiny.py

The test size: ~0.3M parameters, 2 layers, 4 routed experts (top-2) plus one shared expert, byte vocab.
`configs/tiny.py:dense` gives the same model with dense MLPs; `:capacity` uses the capacity MoE impl.
"""

from configs import base


def get_config(arg: str | None = None):
    cfg = base.get_config()
    m = cfg.model
    m.vocab_size = 256
    m.d_model = 64
    m.num_layers = 2
    m.num_heads = 4
    m.num_kv_heads = 2
    m.head_dim = 16
    m.d_ff = 128
    m.qk_norm = True
    m.moe.num_experts = 4
    m.moe.top_k = 2
    m.moe.d_ff = 96
    m.moe.num_shared_experts = 1
    m.moe.shared_d_ff = 64
    cfg.batch_size = 8
    cfg.seq_len = 32
    for a in (arg or "").split(","):
        if a == "dense":
            m.moe.num_experts = 0
        elif a == "capacity":
            m.moe.impl = "capacity"
        elif a:
            raise ValueError(f"configs/tiny.py: unknown argument {a!r}; use dense and/or capacity")
    return cfg
