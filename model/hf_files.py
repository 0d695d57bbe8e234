"""The safetensors side of `model.hf`: a lazy reader of a checkpoint directory (one tensor at a time, FP8
block-quantized tensors dequantized as they are read) and a writer of size-capped shards with their index.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

SCALE_SUFFIX = "_scale_inv"  # FP8 checkpoints: `<name>_scale_inv` beside each e4m3 `<name>`


def read_raw(path: pathlib.Path, name: str) -> np.ndarray:
    """One tensor read from the safetensors layout itself (8-byte header size, JSON header, data): the
    numpy reader of safetensors does not know the float8 dtypes."""
    import ml_dtypes

    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(size))[name]
        begin, end = info["data_offsets"]
        f.seek(8 + size + begin)
        data = f.read(end - begin)
    dtypes = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
    return np.frombuffer(data, dtypes[info["dtype"]]).reshape(info["shape"])


def dequantize_blocks(w_OI: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """f32 weights of a block-quantized [out, in] tensor: block (i, j) of `block` rows x cols is
    multiplied by scale_inv[i, j] (edge blocks are partial)."""
    o, i = w_OI.shape
    bo, bi = block
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), bo, axis=0), bi, axis=1)[:o, :i]
    return w_OI.astype(np.float32) * s


class Checkpoint:
    """Lazy access to the tensors of a directory of safetensors files. FP8 block-quantized tensors
    (`quantization_config.weight_block_size`) are dequantized to f32 as they are read, one at a time."""

    def __init__(self, directory: pathlib.Path, block: tuple[int, int] | None = None):
        self.block = block
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

    def _file(self, name: str):
        fname = self.weight_map[name]
        if fname not in self._files:
            self._files[fname] = safe_open(self.directory / fname, "np").__enter__()
        return self._files[fname]

    def shape_dtype(self, name: str) -> tuple[tuple, str]:
        s = self._file(name).get_slice(name)
        return tuple(s.get_shape()), s.get_dtype()

    def quantized(self, name: str) -> bool:
        return self.shape_dtype(name)[1] in FP8_DTYPES

    def read(self, name: str) -> np.ndarray:
        """A copy of one tensor (FP8: dequantized to f32); the file is mapped only while it is read, so the
        pages of tensors already placed do not stay resident (they would count once more against host
        memory)."""
        if self.quantized(name):
            w = read_raw(self.directory / self.weight_map[name], name)
            scale = self.read(name + SCALE_SUFFIX)
            return dequantize_blocks(w, scale, self.block)
        with safe_open(self.directory / self.weight_map[name], "np") as f:
            return f.get_tensor(name)

    def close(self) -> None:
        for f in self._files.values():
            f.__exit__(None, None, None)
        self._files.clear()


FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
FP8_DTYPES = {"F8_E4M3", "F8_E5M2"}


class ShardWriter:
    """Writes tensors into safetensors files of at most `max_bytes` (a tensor larger than that gets a
    file of its own) under temporary names; `finish` renames them `model-NNNNN-of-MMMMM.safetensors`
    (or `model.safetensors` when there is one) and writes the index."""

    def __init__(self, directory: pathlib.Path, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        self.pending: dict[str, np.ndarray] = {}
        self.size = 0
        self.written: list[tuple[pathlib.Path, list[str], int]] = []

    def add(self, name: str, tensor: np.ndarray) -> None:
        if self.pending and self.size + tensor.nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = tensor
        self.size += tensor.nbytes

    def _flush(self) -> None:
        tmp = self.directory / f".shard-{len(self.written):05d}.safetensors.tmp"
        save_file(self.pending, str(tmp), metadata={"format": "pt"})
        self.written.append((tmp, sorted(self.pending), self.size))
        self.pending, self.size = {}, 0

    def finish(self) -> None:
        self._flush()
        total = len(self.written)
        weight_map, total_size = {}, 0
        for n, (tmp, tensor_names, nbytes) in enumerate(self.written, start=1):
            final = "model.safetensors" if total == 1 else f"model-{n:05d}-of-{total:05d}.safetensors"
            tmp.replace(self.directory / final)
            weight_map.update({name: final for name in tensor_names})
            total_size += nbytes
        index = self.directory / "model.safetensors.index.json"
        if total > 1:
            body = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
            index.write_text(json.dumps(body, indent=2, sort_keys=True))
        elif index.exists():
            index.unlink()
