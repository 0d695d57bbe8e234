"""Hugging Face checkpoints: `load(dir) -> (cfg, params)` and `save(cfg, params, dir)`, no torch.

Safetensors are read with safetensors' numpy API. Without a mesh a parameter is built on its device one HF
tensor (layer, expert) at a time. On a mesh (`load(mesh=...)`, `load(shardings=...)` for exact targets such
as the engine's, `load_sharded` for the main job, a mesh across processes included) each distinct block
that this process's devices hold is read once, from only the slices of the HF tensors it covers
(`hf_files.Checkpoint.read_slice`): a host holds its share of the model plus one block in flight, never the
whole model. `save` writes from every process the tensors it holds,
gathering no parameter into one process.

Our parameters stack layers ([L, ...] when `scan_layers`) and experts ([E, ...]); HF stores one tensor
per layer and expert, linear weights as [out, in]. `hf_names` maps each of our parameter paths to its HF
name and layout; `hf_config` maps the configs; `hf_files` reads and writes the safetensors files;
`hf_read` reads tensors into placed arrays.
Supported architectures: `hf_config.ARCHITECTURES`. What config.json declares and only the tensors tell
(MTP modules a checkpoint lacks, Qwen2-MoE's shared-expert gates) is `read_config`'s.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import json
import logging
import math
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from model import config as config_lib
from model import sharding
from model.io import hf_config, hf_files, hf_names, hf_read
from model.moe.layer import ExpertBias
from model.transformer import Transformer

log = logging.getLogger(__name__)


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
    m, names = cfg.model, hf_names.arch_names(cfg.hf.architecture)
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
        for i in hf_names.moe_layer_ids(m) if names["shared_gate"] else ():
            name = hf_names.SHARED_GATE.format(layer=i, **names)
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
    target, any sharding (e.g. `inference.weights.weight_shardings`, which replicates a dim that does not
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
    params = hf_names.describe(params_state, cfg)
    names = hf_names.arch_names(cfg.hf.architecture)
    hf = cfg.hf.config.to_dict()
    ckpt = _open(directory, hf)
    first_unused = cfg.model.num_layers + cfg.model.mtp_layers  # MTP modules past model.mtp_layers
    mtp = range(first_unused, cfg.model.num_layers + hf_config.mtp_layers(hf))
    # Tensors of variables this call does not read (the expert biases, for a Param-only load) are known.
    _, everything, _ = _abstract(cfg, (nnx.Param, ExpertBias))
    read = {p.path for p in params}
    not_read = [
        n
        for p in hf_names.describe(everything, cfg)
        if p.path not in read
        for _, n in hf_names.hf_elements(p, names)
    ]
    not_read += [
        hf_names.mtp_copy(cfg, k, name) for k in range(cfg.model.mtp_layers) for name in hf_names.MTP_COPIES
    ]
    not_read += list(
        hf_names.zero_tensors(cfg, names, hf)
    )  # the shared-expert gates, zero (`_match_tensors`)
    try:
        hf_read.check_tensors(ckpt, params, names, bool(cfg.model.tie_embeddings), mtp, not_read)
        tensor_bytes = sum(ckpt.stored_bytes(n) for p in params for _, n in hf_names.hf_elements(p, names))
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
                values[p.path] = hf_read.assemble_in_place(ckpt, p, names, targets[p.path])
            else:
                values[p.path] = hf_read.place_blockwise(ckpt, p, names, targets[p.path])
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
    element (in `hf_names.hf_elements` order)."""

    value: Any
    sharding: Any
    writers: tuple


def _export_sharding(x: jax.Array, p: hf_names.Param) -> jax.sharding.NamedSharding:
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


def _holders(p: hf_names.Param, sharding_) -> dict[tuple, list[int]] | None:
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


def _source(p: hf_names.Param, x, processes: int, counter) -> _Source:
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


def _gather_element(x, p: hf_names.Param, lead: tuple) -> np.ndarray:
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
    names = hf_names.arch_names(hf["architectures"][0])
    out_dtype = np.dtype(jax.numpy.dtype(cfg.model.param_dtype))
    me, processes = jax.process_index(), jax.process_count()
    values = dict(nnx.to_flat_state(params))
    counter = itertools.count()
    sources, plan = [], []  # plan: (HF name, bytes, writing process) in writing order
    for p in hf_names.describe(params, cfg):
        source = _source(p, sharding.variable_value(values[p.path]), processes, counter)
        dt = p.dtype if p.entry.name.endswith("e_score_correction_bias") else out_dtype  # f32 in HF too
        hf_bytes = hf_files.tensor_bytes(p.hf_shape(), dt)
        plan += [(name, hf_bytes, q) for (_, name), q in zip(hf_names.hf_elements(p, names), source.writers)]
        copies = [n for n, ours in hf_names.MTP_COPIES.items() if ours == p.path]  # MTP layers' shared copies
        plan += [
            (hf_names.mtp_copy(cfg, k, copies[0]), hf_bytes, source.writers[0])
            for k in range(cfg.model.mtp_layers)
            if copies
        ]
        sources.append((p, source, dt, copies))
    zeros = hf_names.zero_tensors(cfg, names, hf)
    plan += [(name, hf_files.tensor_bytes(shape, out_dtype), 0) for name, shape in zeros.items()]
    files = hf_files.plan_files(plan, max_shard_bytes)
    writer = hf_files.ShardWriter(directory, files, [name for name, _, q in plan if q == me])
    for p, source, dt, copies in sources:
        x = source.value if source.sharding is None else jax.device_put(source.value, source.sharding)
        scale = hf_names.stored_scale(p, names)
        for (lead, name), q in zip(hf_names.hf_elements(p, names), source.writers):
            if q != me:
                continue
            stored = hf_names.to_hf(_gather_element(x, p, lead), p).astype(dt)
            writer.add(name, stored if scale == 1.0 else stored * stored.dtype.type(scale))
            for k in range(cfg.model.mtp_layers) if copies else ():
                writer.add(hf_names.mtp_copy(cfg, k, copies[0]), stored)
        del x
    for name, shape in zeros.items() if me == 0 else ():
        writer.add(name, np.zeros(shape, out_dtype))
    writer.finish()
    if me == 0:
        hf_files.write_index(directory, files, sum(nbytes for _, nbytes, _ in plan))
        (directory / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
    return sorted({files[name] for name, _, q in plan if q == me})
