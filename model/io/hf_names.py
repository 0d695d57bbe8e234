"""Our parameters in Hugging Face terms: `TABLE` maps each of our parameter paths to its HF tensor name and
layout, `describe` lists a model's parameters as `Param`s (full shape, which leading dims are layers and
experts), `hf_elements` names the HF tensor of each (layer, expert) element, and `to_ours` / `to_hf` move
one element between the layouts. `model.io.hf` reads and writes checkpoints with these.

Our parameters stack layers ([L, ...] when `scan_layers`) and experts ([E, ...]); HF stores one tensor per
layer and expert, linear weights as [out, in].
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import ml_collections
import numpy as np
from flax import nnx

from model import config as config_lib
from model import sharding
from model.io import hf_config


@dataclasses.dataclass(frozen=True)
class Entry:
    """How one of our parameter paths (inside a layer, or top-level) is stored in HF."""

    name: str  # HF name, with {layer} / {expert} and `arch_names` placeholders ({moe}, {shared}, ...)
    layout: str  # "linear": [out, in] stored, ours is its transpose; "flat": 1-D; "same": same shape
    in_dims: int = 1  # linear: how many of our leading element dims form `in`
    gated: bool = False  # stored x 2 where the format halves it by a zero gate (`hf_config.Arch.shared_gate`)


LAYER = "model.layers.{layer}."
TABLE = {
    ("attn", "q"): Entry(LAYER + "self_attn.q_proj.weight", "linear"),
    ("attn", "k"): Entry(LAYER + "self_attn.k_proj.weight", "linear"),
    ("attn", "v"): Entry(LAYER + "self_attn.v_proj.weight", "linear"),
    ("attn", "o"): Entry(LAYER + "self_attn.o_proj.weight", "linear", in_dims=2),
    ("attn", "q_bias"): Entry(LAYER + "self_attn.q_proj.bias", "flat"),
    ("attn", "k_bias"): Entry(LAYER + "self_attn.k_proj.bias", "flat"),
    ("attn", "v_bias"): Entry(LAYER + "self_attn.v_proj.bias", "flat"),
    ("attn", "q_norm", "scale"): Entry(LAYER + "self_attn.q_norm.weight", "flat"),
    ("attn", "k_norm", "scale"): Entry(LAYER + "self_attn.k_norm.weight", "flat"),
    ("attn_norm", "scale"): Entry(LAYER + "input_layernorm.weight", "flat"),
    ("mlp_norm", "scale"): Entry(LAYER + "post_attention_layernorm.weight", "flat"),
    ("dense", "gate"): Entry(LAYER + "mlp.gate_proj.weight", "linear"),
    ("dense", "up"): Entry(LAYER + "mlp.up_proj.weight", "linear"),
    ("dense", "down"): Entry(LAYER + "mlp.down_proj.weight", "linear"),
    ("attn", "q_a"): Entry(LAYER + "self_attn.q_a_proj.weight", "linear"),
    ("attn", "q_a_norm", "scale"): Entry(LAYER + "self_attn.q_a_layernorm.weight", "flat"),
    ("attn", "q_b"): Entry(LAYER + "self_attn.q_b_proj.weight", "linear"),
    ("attn", "kv_a"): Entry(LAYER + "self_attn.kv_a_proj_with_mqa.weight", "linear"),
    ("attn", "kv_a_norm", "scale"): Entry(LAYER + "self_attn.kv_a_layernorm.weight", "flat"),
    ("attn", "kv_b"): Entry(LAYER + "self_attn.kv_b_proj.weight", "linear"),
    ("moe", "router"): Entry(LAYER + "{moe}.gate.weight", "linear"),
    ("moe", "expert_bias"): Entry(LAYER + "{moe}.gate.e_score_correction_bias", "flat"),
    ("moe", "shared", "gate"): Entry(LAYER + "{moe}.{shared}.gate_proj.weight", "linear"),
    ("moe", "shared", "up"): Entry(LAYER + "{moe}.{shared}.up_proj.weight", "linear"),
    ("moe", "shared", "down"): Entry(LAYER + "{moe}.{shared}.down_proj.weight", "linear", gated=True),
    ("moe", "gate"): Entry(LAYER + "{moe}.experts.{expert}.{gate}.weight", "linear"),
    ("moe", "up"): Entry(LAYER + "{moe}.experts.{expert}.{up}.weight", "linear"),
    ("moe", "down"): Entry(LAYER + "{moe}.experts.{expert}.{down}.weight", "linear"),
    ("embed", "embedding"): Entry("model.embed_tokens.weight", "same"),
    ("unembed",): Entry("lm_head.weight", "linear"),
    ("final_norm", "scale"): Entry("model.norm.weight", "flat"),
    # Multi-token-prediction modules (model.mtp): decoder layers after the last one, with these extras.
    ("mtp", "enorm", "scale"): Entry(LAYER + "enorm.weight", "flat"),
    ("mtp", "hnorm", "scale"): Entry(LAYER + "hnorm.weight", "flat"),
    ("mtp", "eh_proj"): Entry(LAYER + "eh_proj.weight", "linear"),
    ("mtp", "norm", "scale"): Entry(LAYER + "shared_head.norm.weight", "flat"),
}
# Copies of the shared embedding and output matrix that DeepSeek-V3 stores in each MTP layer.
MTP_COPIES = {"embed_tokens.weight": ("embed", "embedding"), "shared_head.head.weight": ("unembed",)}
# Qwen2-MoE's shared-expert gate (one per MoE layer), which our model has not: stored as zeros.
SHARED_GATE = LAYER + "{moe}.{shared}_gate.weight"


@dataclasses.dataclass(frozen=True)
class Param:
    """One of our parameters: its path, full shape, and which leading dims are layers / experts."""

    path: tuple
    shape: tuple
    dtype: np.dtype
    entry: Entry
    layer_ids: tuple  # HF layer index per position of the layer dim ((None,) for top-level params)
    stacked: bool  # whether the shape has the layer dim (scan_layers) or holds one layer
    experts: int  # size of the expert dim (0: none)

    @property
    def lead(self) -> int:
        return self.stacked + (self.experts > 0)

    @property
    def elem_shape(self) -> tuple:
        return self.shape[self.lead :]

    def hf_shape(self) -> tuple:
        e = self.entry
        if e.layout == "same":
            return self.elem_shape
        if e.layout == "flat":
            return (math.prod(self.elem_shape),)
        return (math.prod(self.elem_shape[e.in_dims :]), math.prod(self.elem_shape[: e.in_dims]))


def arch_names(arch: str) -> dict:
    """The placeholders of `Entry.name` for `arch`, and its `shared_gate`."""
    a = hf_config.ARCHITECTURES[arch]
    gate, up, down = a.experts or (None, None, None)
    return {
        "moe": a.moe,
        "gate": gate,
        "up": up,
        "down": down,
        "shared": a.shared,
        "shared_gate": a.shared_gate,
    }


def stored_scale(p: Param, names: dict) -> float:
    """Stored / ours: 2 for the shared down_proj behind Qwen2-MoE's zero gate (sigmoid(0) = 1/2), else 1.
    Both ways exact (a power of two) but for overflow, or a subnormal halved on loading."""
    return 2.0 if p.entry.gated and names["shared_gate"] else 1.0


def describe(params_state: nnx.State, cfg: ml_collections.ConfigDict) -> list[Param]:
    """Our parameters in checkpoint terms, from the (abstract) Param state (and expert biases)."""
    m = cfg.model
    arch = cfg.hf.architecture if "hf" in cfg else hf_config.default_architecture(cfg)
    shared_ok = arch_names(arch)["shared"]
    num_dense, _ = config_lib.layer_counts(m)
    out = []
    for path, var in nnx.to_flat_state(params_state):
        value = sharding.variable_value(var)
        shape, dtype = tuple(value.shape), np.dtype(value.dtype)
        if path[0] == "mtp":  # module i is HF layer num_layers + i; its block is a decoder layer
            layer_ids, stacked, rest = (m.num_layers + path[1],), False, path[2:]
            if rest[0] != "block":
                entry, experts = TABLE.get(("mtp",) + rest), 0
            else:
                key = rest[1:]
                if key[0] == "mlp":
                    key = ("moe" if m.moe.num_experts else "dense",) + key[1:]
                entry = TABLE.get(key)
                per_expert = key[0] == "moe" and key[1] in ("gate", "up", "down")
                experts = m.moe.num_experts if per_expert else 0
        elif path[0] not in ("dense_layers", "moe_layers"):
            entry, layer_ids, stacked, experts = TABLE.get(path), (None,), False, 0
        else:
            is_moe = path[0] == "moe_layers"
            offset = num_dense if is_moe else 0
            rest = path[2:]
            stacked = not isinstance(rest[0], int)  # scan_layers: [L, ...]; otherwise a list of layers
            layer_ids = tuple(offset + i for i in range(shape[0])) if stacked else (offset + rest[0],)
            key = rest if stacked else rest[1:]
            if key[0] == "mlp":
                if is_moe and key[1] == "shared" and not shared_ok:
                    raise ValueError("shared experts have no counterpart in this HF format")
                key = ("moe" if is_moe else "dense",) + key[1:]
            entry = TABLE.get(key)
            per_expert = key[0] == "moe" and key[1] in ("gate", "up", "down")
            experts = m.moe.num_experts if per_expert else 0
        if entry is None:
            raise ValueError(f"parameter {'/'.join(map(str, path))} has no Hugging Face counterpart")
        out.append(Param(path, shape, dtype, entry, layer_ids, stacked, experts))
    return out


def _hf_name(p: Param, names: dict, layer, expert) -> str:
    return p.entry.name.format(layer=layer, expert=expert, **names)


def hf_elements(p: Param, names: dict) -> Iterator[tuple[tuple, str]]:
    """(index of the element in our parameter's leading dims, HF tensor name) for every stored tensor."""
    experts = range(p.experts) if p.experts else (None,)
    for li, layer in enumerate(p.layer_ids):
        for ei, expert in enumerate(experts):
            lead = ((li,) if p.stacked else ()) + ((ei,) if p.experts else ())
            yield lead, _hf_name(p, names, layer, expert)


def raw_bits(x: np.ndarray) -> np.ndarray:
    """The same bytes as unsigned ints: numpy transposes bf16 (an ml_dtypes extension type) elementwise
    through Python-level casts, ~10x slower than moving plain integers."""
    return x.view(f"u{x.dtype.itemsize}")


def to_ours(hf_array: np.ndarray, p: Param) -> np.ndarray:
    if p.entry.layout == "linear":
        moved = np.ascontiguousarray(raw_bits(hf_array).T).view(hf_array.dtype)
        return moved.reshape(p.elem_shape)
    return hf_array.reshape(p.elem_shape)


def to_hf(elem: np.ndarray, p: Param) -> np.ndarray:
    hf_shape = p.hf_shape()
    if p.entry.layout == "linear":
        return np.ascontiguousarray(elem.reshape(hf_shape[::-1]).T)
    return elem.reshape(hf_shape)


def zero_tensors(cfg: ml_collections.ConfigDict, names: dict, hf: dict) -> dict[str, tuple]:
    """{name: shape} of what `save` writes as zeros: tensors the format (config.json `hf`) has and our model
    not (Qwen2-MoE's shared-expert gates, and its q/k/v biases when qkv_bias is set for a model without)."""
    m = cfg.model
    out = {}
    if names["shared_gate"]:
        out.update({SHARED_GATE.format(layer=i, **names): (1, m.d_model) for i in moe_layer_ids(m)})
    if hf.get("qkv_bias") and not m.attention_bias:
        widths = {"q": m.num_heads, "k": m.num_kv_heads, "v": m.num_kv_heads}
        for i in range(m.num_layers):
            for x, heads in widths.items():
                out[TABLE[("attn", f"{x}_bias")].name.format(layer=i)] = (heads * m.head_dim,)
    return out


def moe_layer_ids(m: ml_collections.ConfigDict) -> range:
    num_dense, _ = config_lib.layer_counts(m)
    return range(num_dense, m.num_layers)


def mtp_copy(cfg, k: int, name: str) -> str:
    return LAYER.format(layer=cfg.model.num_layers + k) + name
