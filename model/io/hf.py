"""Hugging Face checkpoints: `load(dir) -> (cfg, params)` and `save(cfg, params, dir)`, no torch.

Safetensors are read with safetensors' numpy API. Without a mesh a parameter is built on its device one HF
tensor (layer, expert) at a time. On a mesh (`load(mesh=...)`, `load(shardings=...)` for exact targets such
as the engine's, `load_sharded` for the main job, a mesh across processes included) each distinct block
that this process's devices hold is read once, from only the slices of the HF tensors it covers
(`hf_files.Checkpoint.read_slice`): a host holds its share of the model plus one block in flight, never the
whole model. `save` writes from every process the tensors it holds,
gathering no parameter into one process.

Our parameters stack layers ([L, ...] when `scan_layers`) and experts ([E, ...]); HF stores one tensor
per layer and expert, linear weights as [out, in]. `_TABLE` maps each of our parameter paths to its HF
name and layout; `hf_config` maps the configs; `hf_files` reads and writes the safetensors files.
Supported architectures: `hf_config.ARCHITECTURES`. What config.json declares and only the tensors tell
(MTP modules a checkpoint lacks, Qwen2-MoE's shared-expert gates) is `read_config`'s.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import functools
import itertools
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
from model import sharding
from model.io import hf_config, hf_files
from model.moe.layer import ExpertBias
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


def _hf_slice(p: _Param, rest: tuple[slice, ...]):
    """(slice of the HF tensor, function of what was read -> our element block `rest`) for the block `rest`
    (contiguous slices over our element dims) of one element of `p`. An HF dim that flattens several of our
    dims is read from the first one's slice with the others whole, then cut: exact when those are whole
    (as for heads split over `tensor`), a little more than the block otherwise."""
    e, es = p.entry, p.elem_shape
    if e.layout == "same":
        groups = [[d] for d in range(len(es))]
    elif e.layout == "flat":
        groups = [list(range(len(es)))] if es else []
    else:  # stored [out, in]; ours is [in..., out...]
        groups = [list(range(e.in_dims, len(es))), list(range(e.in_dims))]
    index, expanded, cut = [], [], []
    for g in groups:
        inner = math.prod(es[d] for d in g[1:])
        first = rest[g[0]]
        index.append(slice(first.start * inner, first.stop * inner))
        expanded += [first.stop - first.start] + [es[d] for d in g[1:]]
        cut += [slice(None)] + [rest[d] for d in g[1:]]
    order = [d for g in groups for d in g]
    perm = [order.index(d) for d in range(len(es))]

    def finish(x: np.ndarray) -> np.ndarray:
        return np.transpose(_bits(x).reshape(expanded)[tuple(cut)], perm).view(x.dtype)

    return tuple(index), finish


def _read_shard(ckpt: hf_files.Checkpoint, p: _Param, names: dict, index: tuple[slice, ...]) -> np.ndarray:
    """The block `index` (contiguous slices over `p.shape`) of parameter `p`: of each HF tensor (layer,
    expert) it covers, only the slice it needs is read."""
    lead = p.lead
    elements = dict(_elements(p, names))
    scale = _scale(p, names)
    hf_index, finish = _hf_slice(p, index[lead:])
    out = np.empty(tuple(s.stop - s.start for s in index), p.dtype)
    for pos in np.ndindex(*out.shape[:lead]):
        x = ckpt.read_slice(elements[tuple(s.start + i for s, i in zip(index, pos))], hf_index)
        x = x if scale == 1.0 else x * x.dtype.type(1 / scale)
        out[pos] = finish(x)
    return out


def _place_sharded(ckpt: hf_files.Checkpoint, p: _Param, names: dict, sharding_) -> jax.Array:
    """Parameter `p` with `sharding_`, each distinct block that this process's devices hold read once (the
    devices holding the same block share the read): the host holds one block at a time. On a mesh across
    processes each process reads only its devices' blocks."""
    blocks: dict[tuple, tuple] = {}  # (start, stop) per dim -> (slices, devices)
    for device, index in sharding_.addressable_devices_indices_map(p.shape).items():
        index = hf_files.full_slices(index, p.shape)
        blocks.setdefault(tuple((s.start, s.stop) for s in index), (index, []))[1].append(device)
    arrays = []
    for index, devices in blocks.values():
        host = _read_shard(ckpt, p, names, index)
        placed = [jax.device_put(host, d) for d in devices]
        jax.block_until_ready(placed)  # the transfers hold `host` until they have run
        arrays += placed
        del host
    _release_freed_host_memory()
    return jax.make_array_from_single_device_arrays(p.shape, sharding_, arrays)


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
                    "checkpoints whose shared_expert_gate weights are all zero (as model.io.hf.save writes) "
                    "load"
                )
    finally:
        ckpt.close()


def _abstract(cfg: ml_collections.ConfigDict, variables=nnx.Param):
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0)))
    return nnx.split(abstract, variables, ...)


@dataclasses.dataclass(frozen=True)
class LoadStats:
    """What a load read: `bytes_read`, tensor data read from disk by this process (a slice counts its own
    bytes), of `tensor_bytes`, what the tensors it loads hold as stored (FP8: with their scales)."""

    bytes_read: int
    tensor_bytes: int


def load(
    directory,
    *,
    mesh: jax.sharding.Mesh | None = None,
    dtype: str | None = None,
    variables=nnx.Param,
    overrides: Mapping[str, Any] | None = None,
    rules: sharding.Rules | None = None,
    shardings: nnx.State | Mapping[tuple, jax.sharding.Sharding] | None = None,
):
    """(cfg, params) of an HF checkpoint: `params` is the model's `nnx.Param` state, each array placed
    with its sharding on `mesh` (by `rules`, default the checkpoint config's `mesh.rules`; the returned
    cfg's) or on the default device. On a mesh every device's block is read slice by slice, each distinct
    block once per process, and a mesh may span processes (each reads only its devices' blocks). `dtype`
    overrides the parameter dtype (FP8 checkpoints load in their non-quantized dtype, bf16 by default).
    `variables` (an nnx filter) widens what is read, e.g. `(nnx.Param, model.moe.layer.ExpertBias)` for
    DeepSeek-V3's `e_score_correction_bias`, which `load_model` reads too. `overrides`: model fields set
    after config.json is read (`read_config`), e.g. the runtime settings `scan_layers` or `remat` (the layout
    of the params follows them). `shardings` (instead of `mesh` and `rules`): each parameter's exact
    target, any sharding (e.g. `inference.engine.weight_shardings`, which replicates a dim that does not
    divide its axes): a state in the tree of what is read, its variables holding shardings, or a
    {path: sharding} mapping; read block by block as on a mesh; the returned cfg's mesh is config.json's."""
    cfg, params, _ = _load(directory, mesh, dtype, variables, overrides, rules, shardings)
    return cfg, params


def _targets(shardings) -> dict:
    """{path: sharding} of `load`'s `shardings` argument."""
    if not isinstance(shardings, nnx.State):
        return dict(shardings)
    value = lambda v: sharding.variable_value(v) if isinstance(v, nnx.Variable) else v
    return {path: value(v) for path, v in nnx.to_flat_state(shardings)}


def _load(directory, mesh, dtype, variables, overrides, rules, shardings=None):
    """`load`, and its `LoadStats`."""
    if shardings is not None and (mesh is not None or rules is not None):
        raise ValueError("model.io.hf.load: give `shardings`, or `mesh` (and `rules`), not both")
    directory = pathlib.Path(directory)
    cfg = read_config(directory, overrides=overrides)
    if dtype is not None:
        cfg.model.param_dtype = cfg.model.compute_dtype = str(jnp.dtype(dtype))
    if mesh is not None:
        cfg.mesh.shape = ml_collections.ConfigDict(dict(zip(mesh.axis_names, mesh.axis_sizes)))
    if rules is not None:
        cfg.mesh.rules = tuple((name, tuple(a) if isinstance(a, list) else a) for name, a in rules)
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
        tensor_bytes = sum(ckpt.stored_bytes(n) for p in params for _, n in _elements(p, names))
        blockwise = mesh is not None or shardings is not None
        if shardings is not None:
            targets = _targets(shardings)
            missing = [p.path for p in params if p.path not in targets]
            if missing:
                raise ValueError(
                    f"model.io.hf.load: `shardings` has no entry for {len(missing)} parameter(s), e.g. "
                    f"{'/'.join(map(str, missing[0]))}"
                )
        elif mesh is None:
            targets = {p.path: jax.sharding.SingleDeviceSharding(jax.devices()[0]) for p in params}
        else:
            flat = nnx.to_flat_state(sharding.state_shardings(params_state, mesh, cfg.mesh.rules))
            targets = {path: s for path, s in flat}
        values = {}
        for p in params:
            if not blockwise:
                values[p.path] = _assemble_in_place(ckpt, p, names, targets[p.path])
            else:
                values[p.path] = _place_sharded(ckpt, p, names, targets[p.path])
                ckpt.close()  # unmaps the files: the pages read stay out of this process's memory
    finally:
        ckpt.close()
    for path, var in nnx.to_flat_state(params_state):
        var.set_value(values[path])
    return cfg, params_state, LoadStats(ckpt.bytes_read, tensor_bytes)


def load_model(
    directory,
    *,
    mesh: jax.sharding.Mesh | None = None,
    dtype: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    rules: sharding.Rules | None = None,
    shardings: nnx.State | Mapping[tuple, jax.sharding.Sharding] | None = None,
):
    """(cfg, Transformer) with the checkpoint's weights (and expert selection biases); the arguments as in
    `load`."""
    variables = (nnx.Param, ExpertBias)
    cfg, params = load(
        directory,
        mesh=mesh,
        dtype=dtype,
        variables=variables,
        overrides=overrides,
        rules=rules,
        shardings=shardings,
    )
    graphdef, _, rest = _abstract(cfg, variables)
    return cfg, nnx.merge(graphdef, params, rest)


def load_sharded(
    directory, cfg: ml_collections.ConfigDict, mesh: jax.sharding.Mesh | None
) -> tuple[nnx.State, nnx.State, LoadStats]:
    """(params, model_state, stats) of the checkpoint in `directory` for a run: `cfg` is the run's config,
    whose model is the checkpoint's (`rl.validate.init_from_config` makes it so) with the run's runtime
    fields (`hf_config.runtime_fields`), and `mesh` the trainer's, possibly across processes. Every array has
    the sharding `rl.train_state.init_state(cfg, mesh=mesh, ...)` gives it (`cfg.mesh.rules` by logical
    axes), so init_state moves nothing, and each process reads only the slices its devices hold (no mesh:
    the default device). `params`: the `nnx.Param` state; `model_state`: the other variables (the sigmoid
    routers' selection biases)."""
    variables = (nnx.Param, ExpertBias)
    overrides = hf_config.runtime_fields(cfg.model)
    ckpt_cfg, state, stats = _load(directory, mesh, None, variables, overrides, cfg.mesh.rules)
    graphdef, _, rest = _abstract(ckpt_cfg, variables)
    _, params, model_state = nnx.split(nnx.merge(graphdef, state, rest), nnx.Param, ...)
    return params, model_state, stats


# --- Save -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Source:
    """Where `save` takes one parameter's HF tensors from: `value` (an array, or on a mesh across processes
    its `sharding` first, when no process holds all of some element), and the process that writes each
    element (in `_elements` order)."""

    value: Any
    sharding: Any
    writers: tuple


def _export_sharding(x: jax.Array, p: _Param) -> jax.sharding.NamedSharding:
    """x's devices as a (process, local device) mesh: the first leading dim (layers, experts) that divides
    over the processes split across them, and a dim that divides over each process's devices (one that x
    splits, if any) split over those. An element then lies in one process. Without such a leading dim every
    process holds the whole parameter (split over its devices where a dim allows)."""
    devices = sorted(x.sharding.device_set, key=lambda d: (d.process_index, d.id))
    per_process = collections.Counter(d.process_index for d in devices)
    if len(set(per_process.values())) != 1:  # uneven processes: every device holds all of it
        mesh = jax.sharding.Mesh(np.asarray(devices).reshape(1, -1), ("proc", "local"))
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    procs, local = len(per_process), len(devices) // len(per_process)
    mesh = jax.sharding.Mesh(np.asarray(devices).reshape(procs, local), ("proc", "local"))
    spec = [None] * len(p.shape)
    split = next((d for d in range(p.lead) if p.shape[d] % procs == 0), None)
    if split is not None:
        spec[split] = "proc"
    # Within a process, a dim the source already splits first: XLA reshards that without replicating.
    source = x.sharding.shard_shape(p.shape)
    dims = sorted(range(len(p.shape)), key=lambda d: source[d] == p.shape[d])
    within = next((d for d in dims if d != split and p.shape[d] % local == 0), None)
    if within is not None:
        spec[within] = "local"
    elif split is not None and p.shape[split] % (procs * local) == 0:
        spec[split] = ("proc", "local")
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


def _holders(p: _Param, sharding_) -> dict[tuple, list[int]] | None:
    """{leading-dim block ((start, stop) per leading dim): the processes whose devices hold all of each
    element in it}, or None when some element is whole in no process."""
    boxes: dict[tuple, dict[int, set]] = {}
    for device, index in sharding_.devices_indices_map(p.shape).items():
        index = hf_files.full_slices(index, p.shape)
        block = tuple((s.start, s.stop) for s in index[: p.lead])
        box = tuple((s.start, s.stop) for s in index[p.lead :])
        boxes.setdefault(block, {}).setdefault(device.process_index, set()).add(box)
    out = {}
    for block, by_process in boxes.items():
        every = set().union(*by_process.values())
        out[block] = sorted(q for q, held in by_process.items() if held == every)
        if not out[block]:
            return None
    return out


def _source(p: _Param, x, processes: int, counter) -> _Source:
    """Which process writes each element of `p` (value `x`): one that holds all of it; among several, turn
    by turn (`counter`, shared by the parameters), so replicated parameters spread over the processes."""
    everyone = list(range(processes))
    if not isinstance(x, jax.Array) or x.is_fully_addressable:  # every process holds the same values
        elements = range(math.prod(p.shape[: p.lead]))
        return _Source(x, None, tuple(everyone[next(counter) % processes] for _ in elements))
    target, holders = x.sharding, _holders(p, x.sharding)
    if holders is None:
        target = _export_sharding(x, p)
        holders = _holders(p, target)
    writers = []
    for lead in np.ndindex(*p.shape[: p.lead]):
        block = next(b for b in holders if all(s <= i < e for (s, e), i in zip(b, lead)))
        writers.append(holders[block][next(counter) % len(holders[block])])
    return _Source(x, None if target == x.sharding else target, tuple(writers))


@functools.partial(jax.jit, static_argnums=2)
def _take(block, lead_K, lead: int):
    """block[lead_K] (one element of a device's block), on its device."""
    starts = tuple(lead_K) + (0,) * (block.ndim - lead)
    return jax.lax.dynamic_slice(block, starts, (1,) * lead + block.shape[lead:]).reshape(block.shape[lead:])


def _gather_element(x, p: _Param, lead: tuple) -> np.ndarray:
    """Element `lead` of `p` (our layout) on the host, from this process's devices' blocks of it."""
    if not isinstance(x, jax.Array):
        return np.asarray(x)[lead]
    out = np.empty(p.elem_shape, x.dtype)
    seen = set()
    for shard in x.addressable_shards:
        index = hf_files.full_slices(shard.index, p.shape)
        key = tuple((s.start, s.stop) for s in index)
        if key in seen or not all(s.start <= i < s.stop for s, i in zip(index, lead)):
            continue
        seen.add(key)
        local = np.asarray([i - s.start for s, i in zip(index, lead)], np.int32)
        out[index[p.lead :]] = np.asarray(_take(shard.data, local, p.lead) if p.lead else shard.data)
    return out


def save(
    cfg: ml_collections.ConfigDict, params: nnx.State, directory, *, max_shard_bytes: int = 2**31
) -> list[str]:
    """Writes `params` (the `nnx.Param` state, or one with the `ExpertBias` variables too, which DeepSeek-V3
    stores as `e_score_correction_bias`; without them transformers starts those at zero) as an HF
    checkpoint: config.json and safetensors shards (with model.safetensors.index.json when there are
    several).

    Nothing is gathered into one process. Every process calls `save` with the same `directory` (a file
    system they share) and writes the HF tensors (one layer / expert each) that it holds whole, into files
    every process names alike (`hf_files.plan_files`); process 0 writes config.json and the index. A
    parameter of which some element is whole in no process (its element dims split across processes) is
    first resharded, all processes together, so that its layers or experts are split across processes.
    The directory is complete when every process has returned: a caller across processes waits for all
    (a barrier) before it reads or moves it. Peak memory: per device, its block of the parameter being
    written, twice when that one is resharded; per host, the HF tensor being assembled and the tensors of
    the file being filled (at most `max_shard_bytes`). One process writes what gathering each parameter
    would: the same files, tensors and bytes. Returns the names of the files this process wrote."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf = hf_config.to_hf(cfg)
    names = _names(hf["architectures"][0])
    out_dtype = np.dtype(jax.numpy.dtype(cfg.model.param_dtype))
    me, processes = jax.process_index(), jax.process_count()
    values = dict(nnx.to_flat_state(params))
    counter = itertools.count()
    sources, plan = [], []  # plan: (HF name, bytes, writing process) in writing order
    for p in _describe(params, cfg):
        source = _source(p, sharding.variable_value(values[p.path]), processes, counter)
        dt = p.dtype if p.entry.name.endswith("e_score_correction_bias") else out_dtype  # f32 in HF too
        hf_bytes = hf_files.tensor_bytes(p.hf_shape(), dt)
        plan += [(name, hf_bytes, q) for (_, name), q in zip(_elements(p, names), source.writers)]
        copies = [n for n, ours in _MTP_COPIES.items() if ours == p.path]  # MTP layers' shared copies
        plan += [
            (_mtp_copy(cfg, k, copies[0]), hf_bytes, source.writers[0])
            for k in range(cfg.model.mtp_layers)
            if copies
        ]
        sources.append((p, source, dt, copies))
    zeros = _zero_tensors(cfg, names, hf)
    plan += [(name, hf_files.tensor_bytes(shape, out_dtype), 0) for name, shape in zeros.items()]
    files = hf_files.plan_files(plan, max_shard_bytes)
    writer = hf_files.ShardWriter(directory, files, [name for name, _, q in plan if q == me])
    for p, source, dt, copies in sources:
        x = source.value if source.sharding is None else jax.device_put(source.value, source.sharding)
        scale = _scale(p, names)
        for (lead, name), q in zip(_elements(p, names), source.writers):
            if q != me:
                continue
            stored = _to_hf(_gather_element(x, p, lead), p).astype(dt)
            writer.add(name, stored if scale == 1.0 else stored * stored.dtype.type(scale))
            for k in range(cfg.model.mtp_layers) if copies else ():
                writer.add(_mtp_copy(cfg, k, copies[0]), stored)
        del x
    for name, shape in zeros.items() if me == 0 else ():
        writer.add(name, np.zeros(shape, out_dtype))
    writer.finish()
    if me == 0:
        hf_files.write_index(directory, files, sum(nbytes for _, nbytes, _ in plan))
        (directory / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
    return sorted({files[name] for name, _, q in plan if q == me})
