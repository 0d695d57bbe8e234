"""Hugging Face checkpoints: `load(dir) -> (cfg, params)` and `save(cfg, params, dir)`, no torch.

Safetensors are read with safetensors' numpy API, one tensor at a time: every parameter is created with
`jax.make_array_from_callback`, whose callback reads only the HF tensors (layers, experts) that the
requested shard covers. A host therefore holds the placed model plus one tensor in flight, never the
whole model twice, and with a mesh each device's shard is assembled from only what it needs.

Our parameters stack layers ([L, ...] when `scan_layers`) and experts ([E, ...]); HF stores one tensor
per layer and expert, linear weights as [out, in]. `_TABLE` maps each of our parameter paths to its HF
name and layout; `hf_config` maps the configs; `hf_files` reads and writes the safetensors files.
Supported architectures: `hf_config.ARCHITECTURES`. What config.json declares and only the tensors tell
(MTP modules a checkpoint lacks, Qwen2-MoE's shared-expert gates) is `read_config`'s.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import json
import logging
import math
import pathlib
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from model import config as config_lib
from model import hf_config, hf_files, sharding
from model.moe import ExpertBias
from model.transformer import Transformer

log = logging.getLogger(__name__)

# Buffers some checkpoints carry that are not parameters (recomputed from the config).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class _Entry:
    """How one of our parameter paths (inside a layer, or top-level) is stored in HF."""

    name: str  # HF name, with {layer} / {expert} and `_names` placeholders ({moe}, {shared}, ...)
    layout: str  # "linear": [out, in] stored, ours is its transpose; "flat": 1-D; "same": same shape
    in_dims: int = 1  # linear: how many of our leading element dims form `in`
    gated: bool = False  # stored x 2 where the format halves it by a zero gate (`hf_config.Arch.shared_gate`)


_LAYER = "model.layers.{layer}."
_TABLE = {
    ("attn", "q"): _Entry(_LAYER + "self_attn.q_proj.weight", "linear"),
    ("attn", "k"): _Entry(_LAYER + "self_attn.k_proj.weight", "linear"),
    ("attn", "v"): _Entry(_LAYER + "self_attn.v_proj.weight", "linear"),
    ("attn", "o"): _Entry(_LAYER + "self_attn.o_proj.weight", "linear", in_dims=2),
    ("attn", "q_bias"): _Entry(_LAYER + "self_attn.q_proj.bias", "flat"),
    ("attn", "k_bias"): _Entry(_LAYER + "self_attn.k_proj.bias", "flat"),
    ("attn", "v_bias"): _Entry(_LAYER + "self_attn.v_proj.bias", "flat"),
    ("attn", "q_norm", "scale"): _Entry(_LAYER + "self_attn.q_norm.weight", "flat"),
    ("attn", "k_norm", "scale"): _Entry(_LAYER + "self_attn.k_norm.weight", "flat"),
    ("attn_norm", "scale"): _Entry(_LAYER + "input_layernorm.weight", "flat"),
    ("mlp_norm", "scale"): _Entry(_LAYER + "post_attention_layernorm.weight", "flat"),
    ("dense", "gate"): _Entry(_LAYER + "mlp.gate_proj.weight", "linear"),
    ("dense", "up"): _Entry(_LAYER + "mlp.up_proj.weight", "linear"),
    ("dense", "down"): _Entry(_LAYER + "mlp.down_proj.weight", "linear"),
    ("attn", "q_a"): _Entry(_LAYER + "self_attn.q_a_proj.weight", "linear"),
    ("attn", "q_a_norm", "scale"): _Entry(_LAYER + "self_attn.q_a_layernorm.weight", "flat"),
    ("attn", "q_b"): _Entry(_LAYER + "self_attn.q_b_proj.weight", "linear"),
    ("attn", "kv_a"): _Entry(_LAYER + "self_attn.kv_a_proj_with_mqa.weight", "linear"),
    ("attn", "kv_a_norm", "scale"): _Entry(_LAYER + "self_attn.kv_a_layernorm.weight", "flat"),
    ("attn", "kv_b"): _Entry(_LAYER + "self_attn.kv_b_proj.weight", "linear"),
    ("moe", "router"): _Entry(_LAYER + "{moe}.gate.weight", "linear"),
    ("moe", "expert_bias"): _Entry(_LAYER + "{moe}.gate.e_score_correction_bias", "flat"),
    ("moe", "shared", "gate"): _Entry(_LAYER + "{moe}.{shared}.gate_proj.weight", "linear"),
    ("moe", "shared", "up"): _Entry(_LAYER + "{moe}.{shared}.up_proj.weight", "linear"),
    ("moe", "shared", "down"): _Entry(_LAYER + "{moe}.{shared}.down_proj.weight", "linear", gated=True),
    ("moe", "gate"): _Entry(_LAYER + "{moe}.experts.{expert}.{gate}.weight", "linear"),
    ("moe", "up"): _Entry(_LAYER + "{moe}.experts.{expert}.{up}.weight", "linear"),
    ("moe", "down"): _Entry(_LAYER + "{moe}.experts.{expert}.{down}.weight", "linear"),
    ("embed", "embedding"): _Entry("model.embed_tokens.weight", "same"),
    ("unembed",): _Entry("lm_head.weight", "linear"),
    ("final_norm", "scale"): _Entry("model.norm.weight", "flat"),
    # Multi-token-prediction modules (model.mtp): decoder layers after the last one, with these extras.
    ("mtp", "enorm", "scale"): _Entry(_LAYER + "enorm.weight", "flat"),
    ("mtp", "hnorm", "scale"): _Entry(_LAYER + "hnorm.weight", "flat"),
    ("mtp", "eh_proj"): _Entry(_LAYER + "eh_proj.weight", "linear"),
    ("mtp", "norm", "scale"): _Entry(_LAYER + "shared_head.norm.weight", "flat"),
}
# Copies of the shared embedding and output matrix that DeepSeek-V3 stores in each MTP layer.
_MTP_COPIES = {"embed_tokens.weight": ("embed", "embedding"), "shared_head.head.weight": ("unembed",)}
# Qwen2-MoE's shared-expert gate (one per MoE layer), which our model has not: stored as zeros.
_SHARED_GATE = _LAYER + "{moe}.{shared}_gate.weight"


@dataclasses.dataclass(frozen=True)
class _Param:
    """One of our parameters: its path, full shape, and which leading dims are layers / experts."""

    path: tuple
    shape: tuple
    dtype: np.dtype
    entry: _Entry
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


def _names(arch: str) -> dict:
    """The placeholders of `_Entry.name` for `arch`, and its `shared_gate`."""
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


def _scale(p: _Param, names: dict) -> float:
    """Stored / ours: 2 for the shared down_proj behind Qwen2-MoE's zero gate (sigmoid(0) = 1/2), else 1.
    Both ways exact (a power of two) but for overflow, or a subnormal halved on loading."""
    return 2.0 if p.entry.gated and names["shared_gate"] else 1.0


def _describe(params_state: nnx.State, cfg: ml_collections.ConfigDict) -> list[_Param]:
    """Our parameters in checkpoint terms, from the (abstract) Param state (and expert biases)."""
    m = cfg.model
    shared_ok = _names(cfg.hf.architecture if "hf" in cfg else hf_config.default_architecture(cfg))["shared"]
    num_dense, _ = config_lib.layer_counts(m)
    out = []
    for path, var in nnx.to_flat_state(params_state):
        value = sharding.variable_value(var)
        shape, dtype = tuple(value.shape), np.dtype(value.dtype)
        if path[0] == "mtp":  # module i is HF layer num_layers + i; its block is a decoder layer
            layer_ids, stacked, rest = (m.num_layers + path[1],), False, path[2:]
            if rest[0] != "block":
                entry, experts = _TABLE.get(("mtp",) + rest), 0
            else:
                key = rest[1:]
                if key[0] == "mlp":
                    key = ("moe" if m.moe.num_experts else "dense",) + key[1:]
                entry = _TABLE.get(key)
                per_expert = key[0] == "moe" and key[1] in ("gate", "up", "down")
                experts = m.moe.num_experts if per_expert else 0
        elif path[0] not in ("dense_layers", "moe_layers"):
            entry, layer_ids, stacked, experts = _TABLE.get(path), (None,), False, 0
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
            entry = _TABLE.get(key)
            per_expert = key[0] == "moe" and key[1] in ("gate", "up", "down")
            experts = m.moe.num_experts if per_expert else 0
        if entry is None:
            raise ValueError(f"parameter {'/'.join(map(str, path))} has no Hugging Face counterpart")
        out.append(_Param(path, shape, dtype, entry, layer_ids, stacked, experts))
    return out


def _hf_name(p: _Param, names: dict, layer, expert) -> str:
    return p.entry.name.format(layer=layer, expert=expert, **names)


def _elements(p: _Param, names: dict) -> Iterator[tuple[tuple, str]]:
    """(index of the element in our parameter's leading dims, HF tensor name) for every stored tensor."""
    experts = range(p.experts) if p.experts else (None,)
    for li, layer in enumerate(p.layer_ids):
        for ei, expert in enumerate(experts):
            lead = ((li,) if p.stacked else ()) + ((ei,) if p.experts else ())
            yield lead, _hf_name(p, names, layer, expert)


def _bits(x: np.ndarray) -> np.ndarray:
    """The same bytes as unsigned ints: numpy transposes bf16 (an ml_dtypes extension type) elementwise
    through Python-level casts, ~10x slower than moving plain integers."""
    return x.view(f"u{x.dtype.itemsize}")


def _to_ours(hf_array: np.ndarray, p: _Param) -> np.ndarray:
    if p.entry.layout == "linear":
        moved = np.ascontiguousarray(_bits(hf_array).T).view(hf_array.dtype)
        return moved.reshape(p.elem_shape)
    return hf_array.reshape(p.elem_shape)


def _to_hf(elem: np.ndarray, p: _Param) -> np.ndarray:
    hf_shape = p.hf_shape()
    if p.entry.layout == "linear":
        return np.ascontiguousarray(elem.reshape(hf_shape[::-1]).T)
    return elem.reshape(hf_shape)


def _check(
    ckpt: hf_files.Checkpoint, params: list[_Param], names: dict, tied: bool, ignored_layers=(), not_read=()
) -> None:
    expected = {}
    for p in params:
        for _, name in _elements(p, names):
            expected[name] = p
    present = set(ckpt.weight_map)
    missing = sorted(set(expected) - present)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:5]}")
    ignorable = {n for n in present if n.endswith(_IGNORED_SUFFIXES)} | set(not_read)
    scales = hf_files.SCALE_SUFFIX
    ignorable |= {n for n in present if n.endswith(scales) and n[: -len(scales)] in expected}
    # MTP modules past model.mtp_layers (stored as decoder layers after the last one) are left unread.
    ignorable |= {n for n in present for i in ignored_layers if n.startswith(_LAYER.format(layer=i))}
    if tied:
        ignorable.add("lm_head.weight")  # some tied checkpoints also store the (identical) output matrix
    unexpected = sorted(present - set(expected) - ignorable)
    if unexpected:
        raise ValueError(
            f"checkpoint has {len(unexpected)} tensor(s) this architecture does not use, e.g. "
            f"{unexpected[:5]} (a different architecture, or a config.json that does not match the weights?)"
        )
    for name, p in expected.items():
        shape, dtype = ckpt.shape_dtype(name)
        if shape != p.hf_shape():
            raise ValueError(f"tensor {name}: shape {shape}, but config.json implies {p.hf_shape()}")
        if dtype in hf_files.FP8_DTYPES:
            if ckpt.block is None or name + hf_files.SCALE_SUFFIX not in present:
                raise ValueError(
                    f"tensor {name}: dtype {dtype} needs {name + hf_files.SCALE_SUFFIX} and config.json's "
                    "quantization_config.weight_block_size (block-quantized FP8)"
                )
        elif dtype not in hf_files.FLOAT_DTYPES:
            raise ValueError(f"tensor {name}: dtype {dtype}; only float and block-quantized FP8 tensors load")


def _read(ckpt: hf_files.Checkpoint, p: _Param, names: dict, name: str) -> np.ndarray:
    """HF tensor `name` of `p` in its stored layout, at our scale (`_scale`)."""
    x = ckpt.read(name)
    scale = _scale(p, names)
    return x if scale == 1.0 else x * x.dtype.type(1 / scale)


def _reader(ckpt: hf_files.Checkpoint, p: _Param, names: dict):
    """Callback for `make_array_from_callback`: the shard `index` of parameter `p`, read tensor by tensor."""
    lead = p.lead
    all_elems = dict(_elements(p, names))

    def read(index: tuple) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(p.shape) - len(index))
        lead_ranges = [range(p.shape[d])[index[d]] for d in range(lead)]
        rest = index[lead:]
        out_shape = tuple(len(r) for r in lead_ranges) + tuple(
            len(range(p.shape[lead + d])[rest[d]]) for d in range(len(rest))
        )
        out = np.empty(out_shape, p.dtype)
        for pos in np.ndindex(*[len(r) for r in lead_ranges]):
            key = tuple(r[i] for r, i in zip(lead_ranges, pos))
            out[pos] = _to_ours(_read(ckpt, p, names, all_elems[key]), p)[rest].astype(p.dtype)
        return out

    return read


@functools.partial(jax.jit, donate_argnums=0, static_argnums=(3, 4))
def _set_element(array, hf_elem, lead_K, layout: str, elem_shape: tuple):
    """array[lead] = our layout of one HF tensor, in place (donated). The transpose of [out, in] runs
    here, in XLA, which is several times faster than numpy's strided copy of 2-byte types."""
    bits = jax.lax.bitcast_convert_type
    # XLA's CPU backend computes 16-bit floats in f32: a transpose or update of bf16 becomes converts of
    # whole arrays, not an in-place write. Same-width checkpoints therefore move plain 16-bit integers.
    dtype = array.dtype
    as_bits = dtype.itemsize == 2 and hf_elem.dtype == dtype
    if as_bits:
        array, hf_elem = bits(array, jnp.uint16), bits(hf_elem, jnp.uint16)
    elem = hf_elem.T if layout == "linear" else hf_elem
    elem = elem.reshape((1,) * lead_K.shape[0] + elem_shape).astype(array.dtype)
    starts = tuple(lead_K) + (0,) * len(elem_shape)
    out = jax.lax.dynamic_update_slice(array, elem, starts)
    return bits(out, dtype) if as_bits else out


def _assemble_in_place(ckpt: hf_files.Checkpoint, p: _Param, names: dict, sharding_) -> jax.Array:
    """The parameter built on its device element by element (one layer / expert at a time), each update
    donated so XLA writes in place: the host holds one HF tensor, never a stacked [L, E, ...] copy."""
    if not p.lead:  # one tensor: placed as it is, no zeros buffer beside it
        ((_, name),) = _elements(p, names)
        host = _to_ours(_read(ckpt, p, names, name), p).astype(p.dtype, copy=False)
        array = jax.device_put(host, sharding_)
        array.block_until_ready()  # the transfer holds `host` until it has run
        del host
        _release_freed_host_memory()
        return array
    array = jax.jit(lambda: jax.numpy.zeros(p.shape, p.dtype), out_shardings=sharding_)()
    for lead, name in _elements(p, names):
        lead_K = np.asarray(lead, np.int32)  # traced: one compile per parameter, not per layer
        array = _set_element(array, _read(ckpt, p, names, name), lead_K, p.entry.layout, p.elem_shape)
        array.block_until_ready()  # the element's host buffers are free once the update ran
        _release_freed_host_memory()
    return array


def _release_freed_host_memory() -> None:
    """glibc keeps freed tensors of up to 32 MiB in its heap (its mmap threshold adapts upwards), so
    RSS would grow by the transfer buffers of every element; `malloc_trim` hands them back."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _zero_tensors(cfg: ml_collections.ConfigDict, names: dict, hf: dict) -> dict[str, tuple]:
    """{name: shape} of what `save` writes as zeros: tensors the format (config.json `hf`) has and our model
    not (Qwen2-MoE's shared-expert gates, and its q/k/v biases when qkv_bias is set for a model without)."""
    m = cfg.model
    out = {}
    if names["shared_gate"]:
        out.update({_SHARED_GATE.format(layer=i, **names): (1, m.d_model) for i in _moe_layer_ids(m)})
    if hf.get("qkv_bias") and not m.attention_bias:
        widths = {"q": m.num_heads, "k": m.num_kv_heads, "v": m.num_kv_heads}
        for i in range(m.num_layers):
            for x, heads in widths.items():
                out[_TABLE[("attn", f"{x}_bias")].name.format(layer=i)] = (heads * m.head_dim,)
    return out


def _moe_layer_ids(m: ml_collections.ConfigDict) -> range:
    num_dense, _ = config_lib.layer_counts(m)
    return range(num_dense, m.num_layers)


def _mtp_copy(cfg, k: int, name: str) -> str:
    return _LAYER.format(layer=cfg.model.num_layers + k) + name


def read_config(directory, *, overrides: Mapping[str, Any] | None = None) -> ml_collections.ConfigDict:
    """Our config for the checkpoint in `directory` (its config.json, with what its tensors decide:
    `_match_tensors`), with the dotted model fields of `overrides` set (e.g. `hf_config.runtime_fields` of
    another config: {"remat": "full", ...})."""
    directory = pathlib.Path(directory)
    path = directory / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found; pass a Hugging Face checkpoint directory")
    cfg = hf_config.from_hf(json.loads(path.read_text()))
    _match_tensors(cfg, directory)
    hf_config.set_fields(cfg.model, dict(overrides or {}))
    return cfg


def _open(directory: pathlib.Path, hf: dict) -> hf_files.Checkpoint:
    block = (hf.get("quantization_config") or {}).get("weight_block_size")
    return hf_files.Checkpoint(directory, None if block is None else tuple(block))


def _match_tensors(cfg: ml_collections.ConfigDict, directory: pathlib.Path) -> None:
    """What config.json declares but the tensors decide. MTP modules it counts and the files lack (as in a
    DeepSeek-V3 written by transformers' `save_pretrained`, which drops them) are not loaded: model.mtp_layers
    counts the stored ones (a warning says so). Qwen2-MoE's shared-expert gates must be zero."""
    m, names = cfg.model, _names(cfg.hf.architecture)
    if not m.mtp_layers and not names["shared_gate"]:
        return
    ckpt = _open(directory, cfg.hf.config.to_dict())
    try:
        layers = {n.split(".")[2] for n in ckpt.weight_map if n.startswith("model.layers.")}
        stored = 0
        while stored < m.mtp_layers and str(m.num_layers + stored) in layers:
            stored += 1
        if stored < m.mtp_layers:
            log.warning(
                "%s: config.json declares %d multi-token-prediction module(s) (num_nextn_predict_layers) but "
                "the safetensors hold %d; loading model.mtp_layers=%d",
                directory,
                m.mtp_layers,
                stored,
                stored,
            )
            m.mtp_layers = stored
        for i in _moe_layer_ids(m) if names["shared_gate"] else ():
            name = _SHARED_GATE.format(layer=i, **names)
            if name not in ckpt.weight_map:
                raise ValueError(f"checkpoint is missing {name}")
            if np.any(ckpt.read(name) != 0):
                raise ValueError(
                    f"{name} is not zero: our model has no gated shared expert, so only Qwen2-MoE "
                    "checkpoints whose shared_expert_gate weights are all zero (as model.hf.save writes) load"
                )
    finally:
        ckpt.close()


def _abstract(cfg: ml_collections.ConfigDict, variables=nnx.Param):
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0)))
    return nnx.split(abstract, variables, ...)


def load(
    directory,
    *,
    mesh: jax.sharding.Mesh | None = None,
    dtype: str | None = None,
    variables=nnx.Param,
    overrides: Mapping[str, Any] | None = None,
):
    """(cfg, params) of an HF checkpoint: `params` is the model's `nnx.Param` state, each array placed
    with its sharding on `mesh` (or on the default device). `dtype` overrides the parameter dtype (FP8
    checkpoints load in their non-quantized dtype, bf16 by default). `variables` (an nnx filter) widens
    what is read, e.g. `(nnx.Param, model.moe.ExpertBias)` for DeepSeek-V3's `e_score_correction_bias`,
    which `load_model` reads too. `overrides`: model fields set after config.json is read (`read_config`),
    e.g. the runtime settings `scan_layers` or `remat` (the layout of the params follows them)."""
    directory = pathlib.Path(directory)
    cfg = read_config(directory, overrides=overrides)
    if dtype is not None:
        cfg.model.param_dtype = cfg.model.compute_dtype = str(jnp.dtype(dtype))
    if mesh is not None:
        cfg.mesh.shape = ml_collections.ConfigDict(dict(zip(mesh.axis_names, mesh.axis_sizes)))
    config_lib.validate(cfg, None if mesh is None else mesh.size)
    _, params_state, _ = _abstract(cfg, variables)
    params = _describe(params_state, cfg)
    names = _names(cfg.hf.architecture)
    hf = cfg.hf.config.to_dict()
    ckpt = _open(directory, hf)
    first_unused = cfg.model.num_layers + cfg.model.mtp_layers  # MTP modules past model.mtp_layers
    mtp = range(first_unused, cfg.model.num_layers + hf_config.mtp_layers(hf))
    # Tensors of variables this call does not read (the expert biases, for a Param-only load) are known.
    _, everything, _ = _abstract(cfg, (nnx.Param, ExpertBias))
    read = {p.path for p in params}
    not_read = [n for p in _describe(everything, cfg) if p.path not in read for _, n in _elements(p, names)]
    not_read += [_mtp_copy(cfg, k, name) for k in range(cfg.model.mtp_layers) for name in _MTP_COPIES]
    not_read += list(_zero_tensors(cfg, names, hf))  # the shared-expert gates, zero (`_match_tensors`)
    try:
        _check(ckpt, params, names, bool(cfg.model.tie_embeddings), mtp, not_read)
        if mesh is None:
            shardings = {p.path: jax.sharding.SingleDeviceSharding(jax.devices()[0]) for p in params}
        else:
            flat = nnx.to_flat_state(sharding.state_shardings(params_state, mesh, cfg.mesh.rules))
            shardings = {path: s for path, s in flat}
        values = {}
        for p in params:
            if mesh is None:
                values[p.path] = _assemble_in_place(ckpt, p, names, shardings[p.path])
            else:
                reader = _reader(ckpt, p, names)
                values[p.path] = jax.make_array_from_callback(p.shape, shardings[p.path], reader)
    finally:
        ckpt.close()
    for path, var in nnx.to_flat_state(params_state):
        var.set_value(values[path])
    return cfg, params_state


def load_model(
    directory,
    *,
    mesh: jax.sharding.Mesh | None = None,
    dtype: str | None = None,
    overrides: Mapping[str, Any] | None = None,
):
    """(cfg, Transformer) with the checkpoint's weights (and expert selection biases); `overrides` as in
    `load`."""
    variables = (nnx.Param, ExpertBias)
    cfg, params = load(directory, mesh=mesh, dtype=dtype, variables=variables, overrides=overrides)
    graphdef, _, rest = _abstract(cfg, variables)
    return cfg, nnx.merge(graphdef, params, rest)


def save(
    cfg: ml_collections.ConfigDict, params: nnx.State, directory, *, max_shard_bytes: int = 2**31
) -> None:
    """Writes `params` (the `nnx.Param` state, or one with the `ExpertBias` variables too, which DeepSeek-V3
    stores as `e_score_correction_bias`; without them transformers starts those at zero) as an HF
    checkpoint: config.json and safetensors shards (with model.safetensors.index.json when there are
    several), one parameter on the host at a time."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf = hf_config.to_hf(cfg)
    arch = hf["architectures"][0]
    names = _names(arch)
    out_dtype = np.dtype(jax.numpy.dtype(cfg.model.param_dtype))
    described = _describe(params, cfg)
    values = dict(nnx.to_flat_state(params))
    writer = hf_files.ShardWriter(directory, max_shard_bytes)
    for p in described:
        host = np.asarray(jax.device_get(sharding.variable_value(values[p.path])))
        dt = p.dtype if p.entry.name.endswith("e_score_correction_bias") else out_dtype  # f32 in HF too
        scale = _scale(p, names)
        for lead, name in _elements(p, names):
            stored = _to_hf(host[lead], p).astype(dt)
            writer.add(name, stored if scale == 1.0 else stored * stored.dtype.type(scale))
        copies = [n for n, ours in _MTP_COPIES.items() if ours == p.path]  # MTP layers' shared copies
        for k in range(cfg.model.mtp_layers) if copies else ():
            writer.add(_mtp_copy(cfg, k, copies[0]), _to_hf(host, p).astype(dt))
        del host
    for name, shape in _zero_tensors(cfg, names, hf).items():
        writer.add(name, np.zeros(shape, out_dtype))
    writer.finish()
    (directory / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
