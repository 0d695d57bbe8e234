"""The safetensors side of `model.io.hf`: a lazy reader of a checkpoint directory (one tensor, or one slice of
one, at a time; FP8 block-quantized tensors dequantized as they are read) that counts the bytes it reads, and
a writer of size-capped shards with their index, whose files several processes can write between them.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

SCALE_SUFFIX = "_scale_inv"  # FP8 checkpoints: `<name>_scale_inv` beside each e4m3 `<name>`

_total_bytes_read = 0  # every Checkpoint of this process, since it started


def total_bytes_read() -> int:
    """Bytes of tensor data that every `Checkpoint` of this process has read so far."""
    return _total_bytes_read


def _fp8_dtypes() -> dict:
    import ml_dtypes

    return {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def read_header(path: pathlib.Path) -> tuple[int, dict]:
    """(offset of the data, JSON header) of a safetensors file: 8 bytes of header size, the header, data."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return 8 + size, json.loads(f.read(size))


def read_raw(
    path: pathlib.Path, name: str, index: tuple[slice, ...] | None = None, header: tuple | None = None
) -> np.ndarray:
    """One tensor (or its slice `index`) read from the safetensors layout itself: the numpy reader of
    safetensors does not know the float8 dtypes. A slice is copied out of a read-only map of the file, so
    only the pages it covers are read. `header`: the file's `read_header`, if known."""
    start, entries = header or read_header(path)
    info = entries[name]
    begin, end = info["data_offsets"]
    dtype = _fp8_dtypes()[info["dtype"]]
    if end == begin:
        return np.zeros(info["shape"], dtype)
    mapped = np.memmap(path, np.uint8, "r", offset=start + begin, shape=(end - begin,))
    whole = mapped.view(dtype).reshape(info["shape"])
    out = np.array(whole if index is None else whole[index])
    del whole, mapped
    return out


def dequantize_blocks(
    w_OI: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], offset: tuple[int, int] = (0, 0)
) -> np.ndarray:
    """f32 weights of a block-quantized [out, in] tensor: block (i, j) of `block` rows x cols is
    multiplied by scale_inv[i, j] (edge blocks are partial). `w_OI` may be a slice of the tensor that starts
    at row, column `offset`; `scale_inv` then holds the scales of the blocks it covers, from the block of
    `offset` on."""
    o, i = w_OI.shape
    bo, bi = block
    r, c = offset[0] % bo, offset[1] % bi
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), bo, axis=0), bi, axis=1)[r : r + o, c : c + i]
    return w_OI.astype(np.float32) * s


def full_slices(index: Sequence, shape: Sequence[int]) -> tuple[slice, ...]:
    """`index` (slices with step 1, fewer than the dims allowed) as slice(start, stop) over every dim of
    `shape`."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape, strict=True):
        r = range(n)[s]
        if r.step != 1:
            raise ValueError(f"slice {s} of a dim of {n}: only contiguous slices are read")
        out.append(slice(r.start, r.start + len(r)))
    return tuple(out)


class Checkpoint:
    """Lazy access to the tensors of a directory of safetensors files. FP8 block-quantized tensors
    (`quantization_config.weight_block_size`) are dequantized to f32 as they are read, one at a time."""

    def __init__(self, directory: pathlib.Path, block: tuple[int, int] | None = None):
        self.block = block
        self.bytes_read = 0  # tensor data read from disk (a slice counts its own bytes)
        index = directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (directory / "model.safetensors").exists():
            with safe_open(directory / "model.safetensors", "np") as f:
                weight_map = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise FileNotFoundError(
                f"{directory}: no model.safetensors or model.safetensors.index.json; pass the checkpoint "
                "directory (PyTorch .bin checkpoints are not read: convert them to safetensors)"
            )
        self.directory, self.weight_map = directory, weight_map
        self._files: dict[str, object] = {}
        self._headers: dict[str, tuple] = {}  # FP8 files' `read_header`, parsed once

    def _file(self, name: str):
        fname = self.weight_map[name]
        if fname not in self._files:
            self._files[fname] = safe_open(self.directory / fname, "np").__enter__()
        return self._files[fname]

    def shape_dtype(self, name: str) -> tuple[tuple, str]:
        s = self._file(name).get_slice(name)
        return tuple(s.get_shape()), s.get_dtype()

    def stored_bytes(self, name: str) -> int:
        """Bytes of tensor `name` as stored (FP8: with its scales)."""
        shape, dtype = self.shape_dtype(name)
        nbytes = math.prod(shape) * ITEMSIZES[dtype]
        return nbytes + (self.stored_bytes(name + SCALE_SUFFIX) if dtype in FP8_DTYPES else 0)

    def quantized(self, name: str) -> bool:
        return self.shape_dtype(name)[1] in FP8_DTYPES

    def _count(self, x: np.ndarray) -> np.ndarray:
        global _total_bytes_read
        self.bytes_read += x.nbytes
        _total_bytes_read += x.nbytes
        return x

    def read(self, name: str) -> np.ndarray:
        """A copy of one tensor (FP8: dequantized to f32); the file is mapped only while it is read, so the
        pages of tensors already placed do not stay resident (they would count once more against host
        memory)."""
        if self.quantized(name):
            w = self._count(read_raw(self.directory / self.weight_map[name], name))
            scale = self.read(name + SCALE_SUFFIX)
            return dequantize_blocks(w, scale, self.block)
        with safe_open(self.directory / self.weight_map[name], "np") as f:
            return self._count(f.get_tensor(name))

    def read_slice(self, name: str, index: Sequence[slice]) -> np.ndarray:
        """The slice `index` (contiguous slices over the stored dims) of one tensor, read alone: the file's
        pages outside it are not read. FP8: the slice of the e4m3 weight and the scales of the blocks it
        covers, dequantized to f32 (equal to dequantizing the whole tensor and slicing it). The file stays
        mapped until `close`."""
        shape, _ = self.shape_dtype(name)
        index = full_slices(index, shape)
        if self.quantized(name):
            fname = self.weight_map[name]
            if fname not in self._headers:
                self._headers[fname] = read_header(self.directory / fname)
            w = self._count(read_raw(self.directory / fname, name, index, self._headers[fname]))
            (rows, cols), (bo, bi) = index, self.block
            blocks = (
                slice(rows.start // bo, -(-rows.stop // bo)),
                slice(cols.start // bi, -(-cols.stop // bi)),
            )
            scale = self.read_slice(name + SCALE_SUFFIX, blocks)
            return dequantize_blocks(w, scale, self.block, (rows.start, cols.start))
        return self._count(self._file(name).get_slice(name)[index])

    def close(self) -> None:
        for f in self._files.values():
            f.__exit__(None, None, None)
        self._files.clear()


FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
FP8_DTYPES = {"F8_E4M3", "F8_E5M2"}
ITEMSIZES = {"F8_E4M3": 1, "F8_E5M2": 1, "F16": 2, "BF16": 2, "F32": 4, "F64": 8}


def tensor_bytes(shape: Sequence[int], dtype: np.dtype) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def plan_files(tensors: Iterable[tuple[str, int, int]], max_bytes: int) -> dict[str, str]:
    """{tensor name: file name} of a checkpoint's shards, decided alike by every process from what all of
    them write: `tensors` is (name, bytes, writing process) in writing order. Each process's tensors fill
    files of at most `max_bytes` in that order (a tensor larger than that gets a file of its own); process
    0's files come first. The files are `model-NNNNN-of-MMMMM.safetensors`, or `model.safetensors` alone."""
    tensors = list(tensors)
    groups: list[list[str]] = []
    for process in sorted({p for _, _, p in tensors}):
        names, size = [], 0
        for name, nbytes, p in tensors:
            if p != process:
                continue
            if names and size + nbytes > max_bytes:
                groups.append(names)
                names, size = [], 0
            names.append(name)
            size += nbytes
        groups.append(names)
    total = len(groups)
    files = {}
    for n, names in enumerate(groups, start=1):
        final = "model.safetensors" if total == 1 else f"model-{n:05d}-of-{total:05d}.safetensors"
        files.update(dict.fromkeys(names, final))
    return files


def write_index(directory: pathlib.Path, files: dict[str, str], total_size: int) -> None:
    """model.safetensors.index.json for the files of `plan_files` (none, and an old one removed, when there
    is one file)."""
    index = directory / "model.safetensors.index.json"
    if len(set(files.values())) > 1:
        body = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(files.items()))}
        index.write_text(json.dumps(body, indent=2, sort_keys=True))
    elif index.exists():
        index.unlink()


class ShardWriter:
    """Writes the tensors `names` (one process's share) into the files `files` (`plan_files`) assigns them.
    A file is written, under a temporary name and then renamed, once its last tensor is added: the host holds
    at most one file's tensors."""

    def __init__(self, directory: pathlib.Path, files: dict[str, str], names: Iterable[str]):
        self.directory, self.files = directory, files
        self.left = Counter(files[n] for n in names)
        self.pending: dict[str, dict[str, np.ndarray]] = {}

    def add(self, name: str, tensor: np.ndarray) -> None:
        file = self.files[name]
        self.pending.setdefault(file, {})[name] = tensor
        self.left[file] -= 1
        if not self.left[file]:
            tmp = self.directory / f".{file}.tmp"
            save_file(self.pending.pop(file), str(tmp), metadata={"format": "pt"})
            tmp.replace(self.directory / file)

    def finish(self) -> None:
        missing = sorted(f for f, n in self.left.items() if n)
        if missing:
            raise RuntimeError(f"shards {missing} did not get all their tensors")
