"""Hugging Face `config.json` <-> our `ml_collections` config, for the architectures `model.io.hf` loads.

Supported: Qwen3-MoE, Qwen2-MoE, Qwen3, Qwen2, Llama (3.x rope scaling included), Mixtral and DeepSeek-V3
(Kimi K2 uses the same architecture: MLA, sigmoid routing with a selection bias, group-limited top-k, shared
experts, YaRN). Anything else, or a supported architecture with a feature our model lacks (sliding-window
layers, MoE layers that are not a contiguous run after the dense ones), gets a `ValueError` naming it; so
does a model of ours that no supported format can hold (`to_hf`, `default_architecture`).
"""

from __future__ import annotations

import dataclasses

import ml_collections

from configs import base, schema


@dataclasses.dataclass(frozen=True)
class Arch:
    """What one HF architecture holds of our model, and its tensor names inside a decoder layer."""

    model_type: str
    moe: str | None = None  # MoE module of a layer (None: dense only)
    experts: tuple[str, str, str] | None = None  # one routed expert's (gate, up, down) projections
    shared: str | None = None  # the shared experts' module inside `moe` (None: the format has none)
    # Qwen2-MoE: sigmoid(x @ shared_expert_gate.T) scales the shared expert's output. Ours has no such gate:
    # it is stored as zeros (sigmoid(0) = 1/2 exactly) with the shared down_proj doubled (exact).
    shared_gate: bool = False
    qk_norm: bool = False  # per-head RMSNorm of queries and keys (Qwen3)


_SWIGLU = ("gate_proj", "up_proj", "down_proj")
ARCHITECTURES = {
    "Qwen3MoeForCausalLM": Arch("qwen3_moe", "mlp", _SWIGLU, qk_norm=True),
    "Qwen2MoeForCausalLM": Arch("qwen2_moe", "mlp", _SWIGLU, shared="shared_expert", shared_gate=True),
    "Qwen3ForCausalLM": Arch("qwen3", qk_norm=True),
    "Qwen2ForCausalLM": Arch("qwen2"),
    "LlamaForCausalLM": Arch("llama"),
    "MixtralForCausalLM": Arch("mixtral", "block_sparse_moe", ("w1", "w3", "w2")),
    "DeepseekV3ForCausalLM": Arch("deepseek_v3", "mlp", _SWIGLU, shared="shared_experts"),
}
# Architectures whose experts are routed by a softmax over all of them (top-k of those probabilities).
_SOFTMAX_MOE = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")
KNOWN_UNSUPPORTED = {
    "DeepseekV2ForCausalLM": "DeepSeek-V2 routing (softmax scores, group-limited greedy selection)",
    "Gemma2ForCausalLM": "logit soft-capping and alternating sliding-window layers",
}


# Model fields config.json does not define: how the model runs and trains, not what it computes. `from_hf`
# leaves them at configs/base.py's defaults; a caller with its own settings passes them to `model.io.hf.load`.
RUNTIME_FIELDS = (
    "attention_impl",
    "scan_layers",
    "remat",
    "moe.impl",
    "moe.capacity_factor",
    "moe.expert_parallel",
    "moe.ep_exchange",
    "moe.ep_capacity_factor",
    "moe.z_loss_weight",
    "moe.bias_update_rate",
)


def runtime_fields(m: ml_collections.ConfigDict) -> dict:
    """{dotted name: value} of `RUNTIME_FIELDS` in the model block `m`."""
    out = {}
    for name in RUNTIME_FIELDS:
        node = m
        for part in name.split("."):
            node = node[part]
        out[name] = node
    return out


def set_fields(m: ml_collections.ConfigDict, values: dict) -> None:
    """Sets the dotted model fields `values` in the model block `m`."""
    for name, value in values.items():
        schema.set_path(m, name, value)


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
    elif kind == "yarn":
        if params.get("attention_factor") is not None or params.get("truncate", True) is not True:
            raise ValueError("config.json: yarn with attention_factor or truncate=false is not supported")
        r.scaling, r.factor = "yarn", float(params["factor"])
        r.original_max_position = int(params["original_max_position_embeddings"])
        r.beta_fast = float(params.get("beta_fast") or 32.0)
        r.beta_slow = float(params.get("beta_slow") or 1.0)
        r.mscale = float(params.get("mscale") or 0.0)
        r.mscale_all_dim = float(params.get("mscale_all_dim") or 0.0)
    else:
        raise ValueError(
            f"config.json: rope type {kind!r} is not supported for loading "
            "(supported: default, linear, llama3, yarn)"
        )


def _moe_layout(hf: dict, arch: str, num_layers: int) -> int:
    """Number of leading dense layers; errors when the MoE layers are not the trailing run."""
    if arch not in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
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
    m.qk_norm = ARCHITECTURES[arch].qk_norm
    if arch == "Qwen2MoeForCausalLM":  # q/k/v biases unless the config says otherwise (transformers >= 5)
        m.attention_bias = bool(hf.get("qkv_bias", True))
    else:
        m.attention_bias = arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False))
    if hf.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias=true is not supported")
    _rope(hf, m.rope)
    if arch in _SOFTMAX_MOE:
        e = m.moe
        e.num_experts = int(hf.get("num_experts") or hf["num_local_experts"])
        e.top_k = int(hf["num_experts_per_tok"])
        e.d_ff = int(hf.get("moe_intermediate_size") or hf["intermediate_size"])
        e.num_shared_experts = 0
        if ARCHITECTURES[arch].shared:  # Qwen2-MoE: one shared expert (its gate: `model.io.hf`)
            e.num_shared_experts, e.shared_d_ff = 1, int(hf["shared_expert_intermediate_size"])
        e.router = "softmax"
        # Mixtral renormalises the top-k softmax weights; the Qwen MoEs do when norm_topk_prob is set.
        e.renormalize = arch == "MixtralForCausalLM" or bool(hf.get("norm_topk_prob", False))
        e.first_dense_layers = _moe_layout(hf, arch, m.num_layers)
        e.load_balance_weight = float(hf.get("router_aux_loss_coef", e.load_balance_weight))
    if arch == "DeepseekV3ForCausalLM":
        _deepseek_v3(hf, m)
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if hf.get("quantization_config"):
        dtype = "bfloat16" if dtype == "float8_e4m3fn" else dtype
    m.param_dtype = m.compute_dtype = str(dtype)
    cfg.hf = ml_collections.ConfigDict({"architecture": arch, "config": hf})
    return cfg


def _deepseek_v3(hf: dict, m: ml_collections.ConfigDict) -> None:
    """MLA and DeepSeek-V3 routing fields (Kimi K2 has the same config.json keys)."""
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if hf.get(key, want) != want:
            raise ValueError(f"config.json: {key}={hf[key]!r} is not supported (only {want!r})")
    m.attention_kind = "mla"
    a = m.mla
    a.q_lora_rank = int(hf.get("q_lora_rank") or 0)
    a.kv_lora_rank = int(hf["kv_lora_rank"])
    a.qk_nope_head_dim = int(hf["qk_nope_head_dim"])
    a.qk_rope_head_dim = int(hf["qk_rope_head_dim"])
    a.v_head_dim = int(hf["v_head_dim"])
    a.rope_interleave = bool(hf.get("rope_interleave", True))
    m.num_kv_heads = m.num_heads  # unused by MLA: every head has its own keys, expanded from one latent
    m.head_dim = a.qk_nope_head_dim + a.qk_rope_head_dim
    e = m.moe
    e.num_experts = int(hf["n_routed_experts"])
    e.top_k = int(hf["num_experts_per_tok"])
    e.d_ff = int(hf["moe_intermediate_size"])
    e.num_shared_experts = int(hf.get("n_shared_experts") or 0)
    e.shared_d_ff = e.d_ff
    e.router = "sigmoid"
    e.renormalize = bool(hf.get("norm_topk_prob", True))
    e.routed_scaling = float(hf.get("routed_scaling_factor", 1.0))
    e.n_group = int(hf.get("n_group") or 1)
    e.topk_group = int(hf.get("topk_group") or 1)
    e.first_dense_layers = int(hf.get("first_k_dense_replace") or 0)
    m.mtp_layers = mtp_layers(hf)


def mtp_layers(hf: dict) -> int:
    """Multi-token-prediction modules stored after the decoder layers (DeepSeek-V3's layer 61)."""
    return int(hf.get("num_nextn_predict_layers") or hf.get("num_mtp_layers") or 0)


def to_hf(cfg: ml_collections.ConfigDict) -> dict:
    """An HF `config.json` dict for our config: the loaded one updated, or a new one for our own models.
    A model the format cannot hold is a one-line `ValueError` (`rl.export` asks before restoring a run)."""
    m = cfg.model
    arch = cfg.hf.architecture if "hf" in cfg else default_architecture(cfg)
    hf = dict(cfg.hf.config.to_dict() if "hf" in cfg else {})
    _check_fits(m, arch)
    deepseek = arch == "DeepseekV3ForCausalLM"
    if m.rope.scaling not in ("none", "linear", "llama3", "yarn"):
        raise ValueError(f"model.rope.scaling={m.rope.scaling!r} cannot be exported")
    model_type = ARCHITECTURES[arch].model_type
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
    elif m.rope.scaling == "yarn":
        rope.update(
            rope_type="yarn",
            factor=m.rope.factor,
            original_max_position_embeddings=m.rope.original_max_position,
            beta_fast=m.rope.beta_fast,
            beta_slow=m.rope.beta_slow,
        )
        if m.rope.mscale or m.rope.mscale_all_dim:
            rope.update(mscale=m.rope.mscale, mscale_all_dim=m.rope.mscale_all_dim)
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
    if deepseek:
        _deepseek_v3_to_hf(m, hf)
    elif m.moe.num_experts:
        key = "num_local_experts" if arch == "MixtralForCausalLM" else "num_experts"
        hf.update({key: m.moe.num_experts, "num_experts_per_tok": m.moe.top_k})
        if arch != "MixtralForCausalLM":
            hf.update(
                moe_intermediate_size=m.moe.d_ff,
                norm_topk_prob=bool(m.moe.renormalize),
                decoder_sparse_step=1,
                mlp_only_layers=list(range(m.moe.first_dense_layers)),
            )
        if arch == "Qwen2MoeForCausalLM":
            # Our shared experts side by side along the ffn axis are one SwiGLU of their summed width. Our
            # own models get q/k/v biases (`model.io.hf.save` writes zeros when the model has none): most
            # Qwen2-MoE readers (vLLM, transformers < 5) always have them.
            width = m.moe.shared_d_ff * m.moe.num_shared_experts
            qkv_bias = bool(m.attention_bias) or bool(hf.get("qkv_bias", True))
            hf.update(shared_expert_intermediate_size=width, qkv_bias=qkv_bias, use_sliding_window=False)
    return hf


def _check_fits(m: ml_collections.ConfigDict, arch: str) -> None:
    """Raises a one-line ValueError when `arch` cannot hold the model `m` exactly."""
    a = ARCHITECTURES[arch]
    if bool(m.qk_norm) != a.qk_norm:
        has = "has" if a.qk_norm else "has no"
        raise ValueError(f"model.qk_norm={bool(m.qk_norm)} does not fit {arch}, which {has} query/key norms")
    if bool(m.moe.num_experts) != bool(a.moe):
        raise ValueError(f"model.moe.num_experts={m.moe.num_experts} does not fit {arch}")
    if m.moe.num_experts and m.moe.num_shared_experts and not a.shared:
        raise ValueError(
            f"model.moe.num_shared_experts={m.moe.num_shared_experts}: {arch} has no shared experts"
        )
    if arch == "Qwen2MoeForCausalLM":
        if not m.moe.num_shared_experts:
            raise ValueError("Qwen2MoeForCausalLM needs a shared expert: model.moe.num_shared_experts >= 1")
        if m.head_dim * m.num_heads != m.d_model:
            raise ValueError(
                f"model.head_dim={m.head_dim} x num_heads={m.num_heads} != d_model={m.d_model}: Qwen2-MoE "
                "readers (transformers < 5, vLLM) take head_dim = hidden_size / num_attention_heads"
            )
    softmax = m.moe.router == "softmax" and m.moe.routed_scaling == 1.0
    if arch in _SOFTMAX_MOE and m.moe.num_experts and not softmax:
        raise ValueError(f"{arch} routes by softmax: model.moe.router='softmax', routed_scaling=1.0")


def _deepseek_v3_to_hf(m: ml_collections.ConfigDict, hf: dict) -> None:
    e, a = m.moe, m.mla
    if not e.num_experts or e.router != "sigmoid" or m.attention_kind != "mla":
        raise ValueError("DeepseekV3ForCausalLM needs attention_kind='mla' and MoE with the sigmoid router")
    if e.num_shared_experts and e.shared_d_ff != e.d_ff:
        raise ValueError("DeepSeek-V3 shared experts have moe.d_ff width; set moe.shared_d_ff = moe.d_ff")
    hf.update(
        q_lora_rank=a.q_lora_rank or None,
        kv_lora_rank=a.kv_lora_rank,
        qk_nope_head_dim=a.qk_nope_head_dim,
        qk_rope_head_dim=a.qk_rope_head_dim,
        v_head_dim=a.v_head_dim,
        rope_interleave=bool(a.rope_interleave),
        head_dim=a.qk_rope_head_dim,
        n_routed_experts=e.num_experts,
        num_experts_per_tok=e.top_k,
        moe_intermediate_size=e.d_ff,
        n_shared_experts=e.num_shared_experts,
        norm_topk_prob=bool(e.renormalize),
        routed_scaling_factor=e.routed_scaling,
        n_group=e.n_group,
        topk_group=e.topk_group,
        first_k_dense_replace=e.first_dense_layers,
        attention_bias=False,
        num_nextn_predict_layers=m.mtp_layers,
    )
    hf.pop("num_mtp_layers", None)
    hf.pop("quantization_config", None)  # we write the configured dtype, never FP8


def default_architecture(cfg: ml_collections.ConfigDict) -> str:
    """The HF architecture our own models are exported as."""
    m = cfg.model
    if m.attention_kind == "mla":
        return "DeepseekV3ForCausalLM"
    if m.moe.num_experts:
        if m.moe.router != "softmax" or m.moe.routed_scaling != 1.0:
            raise ValueError(
                "model.moe.router must be 'softmax' with routed_scaling 1.0 to export to an HF format"
            )
        if m.moe.num_shared_experts:
            if m.qk_norm:
                raise ValueError(
                    "no Hugging Face format holds query/key norms (model.qk_norm=True) together with shared "
                    "experts (model.moe.num_shared_experts > 0), as in every stock config: Qwen3-MoE has no "
                    "shared expert, Qwen2-MoE no qk norm. Ways out: train with --config.model.qk_norm=False "
                    "(exports as Qwen2MoeForCausalLM) or --config.model.moe.num_shared_experts=0 "
                    "(Qwen3MoeForCausalLM), or use the run as it is (rl.evaluate, inference.serve --workdir)"
                )
            return "Qwen2MoeForCausalLM"
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
