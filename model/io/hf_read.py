"""Reading a Hugging Face checkpoint's tensors into placed arrays, for `model.io.hf.load`.

`check_tensors` compares the checkpoint's tensors with what our parameters need. `assemble_in_place` builds
a parameter on one device an element (layer, expert) at a time, each update donated; `place_blockwise`
reads, for any sharding, each distinct block that this process's devices hold once, from only the slices
of the HF tensors it covers (`hf_files.Checkpoint.read_slice`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from model.io import hf_files, hf_names

# Buffers some checkpoints carry that are not parameters (recomputed from the config).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def check_tensors(
    ckpt: hf_files.Checkpoint,
    params: list[hf_names.Param],
    names: dict,
    tied: bool,
    ignored_layers=(),
    not_read=(),
) -> None:
    """Every tensor `params` need is there with its shape and a dtype that loads, and no other is but those
    of `not_read`, of the layers `ignored_layers` (MTP modules left unread), buffers and FP8 scales."""
    expected = {}
    for p in params:
        for _, name in hf_names.hf_elements(p, names):
            expected[name] = p
    present = set(ckpt.weight_map)
    missing = sorted(set(expected) - present)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:5]}")
    ignorable = {n for n in present if n.endswith(_IGNORED_SUFFIXES)} | set(not_read)
    scales = hf_files.SCALE_SUFFIX
    ignorable |= {n for n in present if n.endswith(scales) and n[: -len(scales)] in expected}
    # MTP modules past model.mtp_layers (stored as decoder layers after the last one) are left unread.
    ignorable |= {n for n in present for i in ignored_layers if n.startswith(hf_names.LAYER.format(layer=i))}
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


def _read(ckpt: hf_files.Checkpoint, p: hf_names.Param, names: dict, name: str) -> np.ndarray:
    """HF tensor `name` of `p` in its stored layout, at our scale (`hf_names.stored_scale`)."""
    x = ckpt.read(name)
    scale = hf_names.stored_scale(p, names)
    return x if scale == 1.0 else x * x.dtype.type(1 / scale)


def _hf_slice(p: hf_names.Param, rest: tuple[slice, ...]):
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
        return np.transpose(hf_names.raw_bits(x).reshape(expanded)[tuple(cut)], perm).view(x.dtype)

    return tuple(index), finish


def _read_shard(
    ckpt: hf_files.Checkpoint, p: hf_names.Param, names: dict, index: tuple[slice, ...]
) -> np.ndarray:
    """The block `index` (contiguous slices over `p.shape`) of parameter `p`: of each HF tensor (layer,
    expert) it covers, only the slice it needs is read."""
    lead = p.lead
    elements = dict(hf_names.hf_elements(p, names))
    scale = hf_names.stored_scale(p, names)
    hf_index, finish = _hf_slice(p, index[lead:])
    out = np.empty(tuple(s.stop - s.start for s in index), p.dtype)
    for pos in np.ndindex(*out.shape[:lead]):
        x = ckpt.read_slice(elements[tuple(s.start + i for s, i in zip(index, pos))], hf_index)
        x = x if scale == 1.0 else x * x.dtype.type(1 / scale)
        out[pos] = finish(x)
    return out


def place_blockwise(ckpt: hf_files.Checkpoint, p: hf_names.Param, names: dict, sharding_) -> jax.Array:
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


def assemble_in_place(ckpt: hf_files.Checkpoint, p: hf_names.Param, names: dict, sharding_) -> jax.Array:
    """The parameter built on its device element by element (one layer / expert at a time), each update
    donated so XLA writes in place: the host holds one HF tensor, never a stacked [L, E, ...] copy."""
    if not p.lead:  # one tensor: placed as it is, no zeros buffer beside it
        ((_, name),) = hf_names.hf_elements(p, names)
        host = hf_names.to_ours(_read(ckpt, p, names, name), p).astype(p.dtype, copy=False)
        array = jax.device_put(host, sharding_)
        array.block_until_ready()  # the transfer holds `host` until it has run
        del host
        _release_freed_host_memory()
        return array
    array = jax.jit(lambda: jax.numpy.zeros(p.shape, p.dtype), out_shardings=sharding_)()
    for lead, name in hf_names.hf_elements(p, names):
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
