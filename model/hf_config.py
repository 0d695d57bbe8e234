"""Hugging Face `config.json` <-> our `ml_collections` config, for the architectures `model.hf` loads.

Supported: Qwen3-MoE, Qwen3, Qwen2, Llama (3.x rope scaling included) and Mixtral. Anything else, or a
supported architecture with a feature our model lacks (sliding-window layers, MoE layers that are not a
contiguous run after the dense ones, shared experts), gets a `ValueError` naming it.
"""

from __future__ import annotations

import ml_collections

from configs import base

# architecture -> (model_type, MoE tensor prefix inside a layer, expert (gate, up, down) names)
ARCHITECTURES = {
    "Qwen3MoeForCausalLM": ("qwen3_moe", "mlp", ("gate_proj", "up_proj", "down_proj")),
    "Qwen3ForCausalLM": ("qwen3", None, None),
    "Qwen2ForCausalLM": ("qwen2", None, None),
    "LlamaForCausalLM": ("llama", None, None),
    "MixtralForCausalLM": ("mixtral", "block_sparse_moe", ("w1", "w3", "w2")),
}
KNOWN_UNSUPPORTED = {
    "DeepseekV3ForCausalLM": "multi-head latent attention (MLA)",
    "DeepseekV2ForCausalLM": "multi-head latent attention (MLA)",
    "Qwen2MoeForCausalLM": "gated shared experts",
    "Gemma2ForCausalLM": "logit soft-capping and alternating sliding-window layers",
}


def architecture_of(hf: dict) -> str:
    archs = hf.get("architectures") or []
    if len(archs) != 1:
        raise ValueError(f"config.json: 'architectures' is {archs!r}; expected exactly one entry")
    arch = archs[0]
    if arch in KNOWN_UNSUPPORTED:
        raise ValueError(
            f"config.json: architecture {arch} is not supported ({KNOWN_UNSUPPORTED[arch]} is not in our "
            f"model); supported: {sorted(ARCHITECTURES)}"
        )
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"config.json: architecture {arch} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    return arch


def _rope(hf: dict, r: ml_collections.ConfigDict) -> None:
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    params.update({k: v for k, v in scaling.items() if k not in params})
    r.theta = float(params.get("rope_theta", hf.get("rope_theta", 10_000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        r.scaling = "none"
    elif kind == "linear":
        r.scaling, r.factor = "linear", float(params["factor"])
    elif kind == "llama3":
        r.scaling, r.factor = "llama3", float(params["factor"])
        r.low_freq_factor = float(params["low_freq_factor"])
        r.high_freq_factor = float(params["high_freq_factor"])
        r.original_max_position = int(params["original_max_position_embeddings"])
    else:
        raise ValueError(
            f"config.json: rope type {kind!r} is not supported for loading "
            "(supported: default, linear, llama3)"
        )


def _moe_layout(hf: dict, arch: str, num_layers: int) -> int:
    """Number of leading dense layers; errors when the MoE layers are not the trailing run."""
    if arch != "Qwen3MoeForCausalLM":
        return 0
    step = int(hf.get("decoder_sparse_step", 1))
    dense = sorted(set(hf.get("mlp_only_layers") or []))
    if step != 1:
        raise ValueError(
            f"config.json: decoder_sparse_step={step}; our model needs MoE on every layer after the dense "
            "ones (decoder_sparse_step=1)"
        )
    if dense != list(range(len(dense))) or len(dense) > num_layers:
        raise ValueError(
            f"config.json: mlp_only_layers={dense}; our model supports only the first N layers dense "
            "(mlp_only_layers = [0, ..., N-1])"
        )
    return len(dense)


def from_hf(hf: dict) -> ml_collections.ConfigDict:
    """Our config for an HF `config.json` dict (fields named in errors are HF's)."""
    arch = architecture_of(hf)
    if hf.get("use_sliding_window") or (arch == "MixtralForCausalLM" and hf.get("sliding_window")):
        raise ValueError(
            "config.json: sliding-window attention layers are not supported; set sliding_window null"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act={hf['hidden_act']!r}; only silu (SwiGLU) is supported")
    cfg = base.get_config()
    m = cfg.model
    m.vocab_size = int(hf["vocab_size"])
    m.d_model = int(hf["hidden_size"])
    m.num_layers = int(hf["num_hidden_layers"])
    m.num_heads = int(hf["num_attention_heads"])
    m.num_kv_heads = int(hf.get("num_key_value_heads") or m.num_heads)
    m.head_dim = int(hf.get("head_dim") or m.d_model // m.num_heads)
    m.d_ff = int(hf["intermediate_size"])
    m.norm_eps = float(hf["rms_norm_eps"])
    m.tie_embeddings = bool(hf.get("tie_word_embeddings", False))
    m.qk_norm = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    m.attention_bias = arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False))
    if hf.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias=true is not supported")
    _rope(hf, m.rope)
    if arch in ("Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        e = m.moe
        e.num_experts = int(hf.get("num_experts") or hf["num_local_experts"])
        e.top_k = int(hf["num_experts_per_tok"])
        e.d_ff = int(hf.get("moe_intermediate_size") or hf["intermediate_size"])
        e.num_shared_experts = 0
        e.router = "softmax"
        # Mixtral renormalises the top-k softmax weights; Qwen3-MoE does when norm_topk_prob is set.
        e.renormalize = arch == "MixtralForCausalLM" or bool(hf.get("norm_topk_prob", False))
        e.first_dense_layers = _moe_layout(hf, arch, m.num_layers)
        e.load_balance_weight = float(hf.get("router_aux_loss_coef", e.load_balance_weight))
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    m.param_dtype = m.compute_dtype = str(dtype)
    cfg.hf = ml_collections.ConfigDict({"architecture": arch, "config": hf})
    return cfg


def to_hf(cfg: ml_collections.ConfigDict) -> dict:
    """An HF `config.json` dict for our config: the loaded one updated, or a new one for our own models."""
    m = cfg.model
    arch = cfg.hf.architecture if "hf" in cfg else default_architecture(cfg)
    hf = dict(cfg.hf.config.to_dict() if "hf" in cfg else {})
    if m.moe.num_experts and m.moe.num_shared_experts:
        raise ValueError("model.moe.num_shared_experts > 0 has no counterpart in the supported HF formats")
    if m.rope.scaling not in ("none", "linear", "llama3"):
        raise ValueError(f"model.rope.scaling={m.rope.scaling!r} cannot be exported (none, linear, llama3)")
    model_type = ARCHITECTURES[arch][0]
    hf.update(
        architectures=[arch],
        model_type=model_type,
        vocab_size=m.vocab_size,
        hidden_size=m.d_model,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        intermediate_size=m.d_ff,
        rms_norm_eps=m.norm_eps,
        tie_word_embeddings=bool(m.tie_embeddings),
        hidden_act="silu",
        dtype=str(m.param_dtype),
    )
    rope = {"rope_theta": m.rope.theta, "rope_type": "default"}
    if m.rope.scaling == "linear":
        rope.update(rope_type="linear", factor=m.rope.factor)
    elif m.rope.scaling == "llama3":
        rope.update(
            rope_type="llama3",
            factor=m.rope.factor,
            low_freq_factor=m.rope.low_freq_factor,
            high_freq_factor=m.rope.high_freq_factor,
            original_max_position_embeddings=m.rope.original_max_position,
        )
    hf["rope_parameters"] = rope
    hf.pop("rope_scaling", None)
    hf["rope_theta"] = m.rope.theta
    if arch == "LlamaForCausalLM":
        hf["attention_bias"] = bool(m.attention_bias)
    if m.moe.num_experts:
        key = "num_experts" if arch == "Qwen3MoeForCausalLM" else "num_local_experts"
        hf.update({key: m.moe.num_experts, "num_experts_per_tok": m.moe.top_k})
        if arch == "Qwen3MoeForCausalLM":
            hf.update(
                moe_intermediate_size=m.moe.d_ff,
                norm_topk_prob=bool(m.moe.renormalize),
                decoder_sparse_step=1,
                mlp_only_layers=list(range(m.moe.first_dense_layers)),
            )
    return hf


def default_architecture(cfg: ml_collections.ConfigDict) -> str:
    """The HF architecture our own models are exported as."""
    m = cfg.model
    if m.moe.num_experts:
        if m.moe.router != "softmax" or m.moe.routed_scaling != 1.0:
            raise ValueError(
                "model.moe.router must be 'softmax' with routed_scaling 1.0 to export to an HF format"
            )
        if m.qk_norm:
            return "Qwen3MoeForCausalLM"
        if m.moe.renormalize and not m.moe.first_dense_layers and not m.attention_bias:
            return "MixtralForCausalLM"
        raise ValueError(
            "an MoE model without qk_norm exports as Mixtral, which needs moe.renormalize=True, no dense "
            "layers and no attention bias; set model.qk_norm=True to export as Qwen3-MoE"
        )
    if m.qk_norm:
        return "Qwen3ForCausalLM"
    if m.attention_bias:
        return "Qwen2ForCausalLM"
    return "LlamaForCausalLM"
