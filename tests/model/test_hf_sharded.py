"""Hugging Face checkpoints read slice by slice into the trainer's shardings and written back without
gathering the model in one process.

One process over the 8 fake devices: `model.io.hf.load_sharded` gives the unsharded load's values with exactly
`rl.train_state.init_state`'s shardings (init_state moves nothing), and reads every distinct block once (on
one process that is each stored byte once: `bytes_read` is the checkpoint's data section, where a reader of
whole tensors per device would read it 8 times). An FP8 block-quantized slice is the slice of the tensor
dequantized whole. Two processes x 4 devices (fsdp 8 across both, as `rl.train` runs them) each read half
of every matrix and the whole of every vector, go through init_state, and `model.io.hf.save` writes the files
of each between them: the tensors are the original's bit for bit and transformers reads the directory.
"""

import json
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_SHARD_BYTES = 40_000  # several files per process for the test checkpoint (~150 kB)


def _make_checkpoint(path):
    """transformers' tiny Qwen3-MoE of tests/hf_models.py (f32), saved with `save_pretrained` (the child
    processes and the tests that load no checkpoint run without torch)."""
    import hf_models  # skips where torch or transformers is not installed

    return hf_models.make_hf("qwen3_moe", path)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    return path, _make_checkpoint(path)


def _run_config(src, **mesh_shape):
    """`configs/grpo.py:test` post-training the checkpoint `src` (its model, as rl.train runs it) on a mesh
    of `mesh_shape` over the 8 devices."""
    from configs import grpo
    from model import sharding
    from rl import validate

    cfg = grpo.get_config("test")
    cfg.rl.init_from = str(src)
    cfg = validate.init_from_config(cfg)
    cfg.mesh.shape = {a: 1 for a in sharding.MESH_AXES} | mesh_shape
    return cfg


def _data_bytes(path) -> int:
    """The size of a safetensors file's tensor data: the file less its 8-byte length and JSON header."""
    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return os.path.getsize(path) - 8 - header


def _leaves(state) -> list:
    return [v for _, v in sorted(nnx.to_flat_state(state), key=lambda kv: str(kv[0]))]


def _value(v):
    return v.get_value() if hasattr(v, "get_value") else v.value


def test_fp8_slice_is_the_slice_of_the_tensor_dequantized_whole(tmp_path):
    """A [10, 13] e4m3 tensor in 4x4 blocks (partial at the edges); slices on and off the block grid."""
    from model.io import hf_files

    rng = np.random.RandomState(0)
    w = rng.uniform(-448, 448, (10, 13)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.01, 2.0, (3, 4)).astype(np.float32)  # ceil(10 / 4) x ceil(13 / 4) blocks
    save_file(
        {"w": w, "w_scale_inv": scale, "v": rng.randn(6).astype(np.float32)},
        str(tmp_path / "model.safetensors"),
    )
    ckpt = hf_files.Checkpoint(tmp_path, block=(4, 4))
    whole = hf_files.dequantize_blocks(w, scale, (4, 4))
    np.testing.assert_array_equal(ckpt.read("w"), whole)
    for index in [
        (slice(3, 9), slice(5, 12)),
        (slice(0, 4), slice(4, 8)),
        (slice(9, 10), slice(0, 13)),
        (slice(None), slice(12, 13)),
    ]:
        before = ckpt.bytes_read
        np.testing.assert_array_equal(ckpt.read_slice("w", index), whole[index])
        if index == (slice(3, 9), slice(5, 12)):
            # 6 x 7 e4m3 bytes, and the f32 scales of the blocks they touch: rows 0-11 (blocks 0..2) and
            # columns 4-11 (blocks 1..2), 3 x 2 x 4 bytes.
            assert ckpt.bytes_read - before == 6 * 7 + 3 * 2 * 4
    before = ckpt.bytes_read
    np.testing.assert_array_equal(ckpt.read_slice("v", (slice(2, 5),)), ckpt.read("v")[2:5])
    assert ckpt.bytes_read - before == 3 * 4 + 6 * 4  # the slice, then the whole vector
    ckpt.close()


@pytest.mark.parametrize(
    "mesh_shape,scan_layers",
    [({"fsdp": 8}, True), ({"data": 2, "expert": 2, "tensor": 2}, False)],
    ids=["fsdp8", "data2-expert2-tensor2-unscanned"],
)
def test_load_sharded_has_the_trainers_shardings_and_reads_each_block_once(
    qwen3_moe, mesh_shape, scan_layers
):
    from model import sharding
    from model.io import hf, hf_config
    from rl import train_state

    path, _ = qwen3_moe
    cfg = _run_config(path, **mesh_shape)
    cfg.model.scan_layers = scan_layers
    mesh = sharding.make_mesh(cfg.mesh.shape)
    params, model_state, stats = hf.load_sharded(path, cfg, mesh)

    # Every stored byte read once: the distinct blocks of all devices tile each tensor exactly once (a
    # replicated norm is one block, read once for the devices holding it).
    assert stats.bytes_read == stats.tensor_bytes == _data_bytes(path / "model.safetensors")
    gate = params["moe_layers"]["blocks"]["mlp"]["gate"] if scan_layers else None
    if gate is not None:  # [L, E, D, F], D split 8 ways: each device's block is 1/8 of each expert's matrix
        assert gate[...].addressable_shards[0].data.shape == (2, 4, 32 // 8, 24)

    _, unsharded = hf.load(path, overrides=hf_config.runtime_fields(cfg.model))
    for (p, a), (q, b) in zip(
        sorted(nnx.to_flat_state(params)), sorted(nnx.to_flat_state(unsharded)), strict=True
    ):
        assert p == q and np.asarray(_value(a)).tobytes() == np.asarray(_value(b)).tobytes(), p

    _, state = train_state.init_state(cfg, mesh=mesh, params=params, model_state=model_state)
    for mine, placed in zip(_leaves(params), _leaves(state.params), strict=True):
        assert _value(placed) is _value(mine)  # already where init_state puts it: no move
    for mine, placed in zip(_leaves(model_state), _leaves(state.model_state), strict=True):
        assert _value(placed).sharding == _value(mine).sharding


def test_a_split_inner_dim_of_a_flattened_hf_dim_reads_rows_whole_then_cuts(qwen3_moe):
    """head_dim split over `tensor` (heads not): HF stores q/k/v as [heads * head_dim, hidden] and o as
    [hidden, heads * head_dim], so a device's half of head_dim is no contiguous range. Each of the 2 blocks
    reads the whole flattened dim and cuts it: q, k, v, o are read twice; every other tensor once."""
    from configs.base import DEFAULT_RULES
    from model import sharding
    from model.io import hf, hf_files

    path, _ = qwen3_moe
    rules = [(n, "tensor" if n == "head_dim" else None if "heads" in n else a) for n, a in DEFAULT_RULES]
    mesh = sharding.make_mesh({a: 1 for a in sharding.MESH_AXES} | {"data": 4, "tensor": 2})
    before = hf_files.total_bytes_read()
    cfg, params = hf.load(path, mesh=mesh, rules=rules)
    bytes_read = hf_files.total_bytes_read() - before
    q = params["moe_layers"]["blocks"]["attn"]["q"][...]  # [L, D, N, H]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, None, None, "tensor")
    _, whole = hf.load(path)
    for (p, a), (_, b) in zip(
        sorted(nnx.to_flat_state(params)), sorted(nnx.to_flat_state(whole)), strict=True
    ):
        assert np.asarray(_value(a)).tobytes() == np.asarray(_value(b)).tobytes(), p
    original = load_file(str(path / "model.safetensors"))
    attn = sum(
        v.nbytes
        for k, v in original.items()
        if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))
    )
    total = sum(v.nbytes for v in original.values())
    assert bytes_read == total + attn


def test_fp8_checkpoint_loads_sharded_as_unsharded(qwen3_moe, tmp_path):
    """The checkpoint's matrices quantized to e4m3 in 3x3 blocks, which the fsdp-8 blocks (4 of the 32
    hidden columns) cut through: the mesh load equals the one-device load bit for bit."""
    from model import sharding
    from model.io import hf, hf_config

    path, _ = qwen3_moe
    out = {}
    for name, x in load_file(str(path / "model.safetensors")).items():
        if x.ndim == 2 and name != "model.embed_tokens.weight":
            scale = np.full((-(-x.shape[0] // 3), -(-x.shape[1] // 3)), 2.0**-6, np.float32)
            out[name], out[name + "_scale_inv"] = (x * 2.0**6).astype(ml_dtypes.float8_e4m3fn), scale
        else:
            out[name] = x
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    save_file(out, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [3, 3]}
    (fp8 / "config.json").write_text(json.dumps(config))

    cfg = _run_config(fp8, fsdp=8)
    params, _, stats = hf.load_sharded(fp8, cfg, sharding.make_mesh(cfg.mesh.shape))
    _, whole = hf.load(fp8, overrides=hf_config.runtime_fields(cfg.model))
    for (p, a), (q, b) in zip(
        sorted(nnx.to_flat_state(params)), sorted(nnx.to_flat_state(whole)), strict=True
    ):
        assert p == q and np.asarray(_value(a)).tobytes() == np.asarray(_value(b)).tobytes(), p
    # A block of 4 columns touches 2 or 3 of the 3-wide scale blocks: the scales are read more than once.
    assert stats.tensor_bytes < stats.bytes_read < 2 * stats.tensor_bytes


def test_sharded_state_saves_the_original_bytes(qwen3_moe, tmp_path):
    """One process, params on fsdp 8: `save` assembles each tensor from the 8 devices' blocks."""
    from model import sharding
    from model.io import hf

    path, _ = qwen3_moe
    cfg = _run_config(path, fsdp=8)
    params, model_state, _ = hf.load_sharded(path, cfg, sharding.make_mesh(cfg.mesh.shape))
    hf.save(cfg, nnx.merge_state(params, model_state), tmp_path / "out")
    original = load_file(str(path / "model.safetensors"))
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(saved) == sorted(original)
    for k, v in original.items():
        assert saved[k].dtype == v.dtype and saved[k].tobytes() == v.tobytes(), k


def test_two_processes_read_their_halves_and_save_between_them(qwen3_moe, tmp_path):
    """Two processes x 4 devices, one fsdp-8 mesh: each reads half of every matrix (its 4 of the 8 blocks
    of the hidden dim) and every vector whole (replicated), init_state moves nothing, and the pair's `save`
    writes files of both processes with one index: the original tensors bit for bit, which transformers
    loads to the original's logits."""
    import xla_env

    path, ref = qwen3_moe
    port = xla_env.free_port()
    out = tmp_path / "exported"
    procs = []
    for i in range(2):
        env = xla_env.process_env(4, port, i)
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            str(path),
            str(out),
            str(tmp_path / f"report{i}.json"),
        ]
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    reports = [json.loads((tmp_path / f"report{i}.json").read_text()) for i in range(2)]

    original = load_file(str(path / "model.safetensors"))
    # By hand: fsdp splits the hidden dim (`embed`) of every matrix 8 ways, 4 blocks per process; vectors
    # (norms) are replicated, read whole by each process.
    half = sum(v.nbytes // 2 if v.ndim == 2 else v.nbytes for v in original.values())
    total = sum(v.nbytes for v in original.values())
    for r in reports:
        assert r["bytes_read"] == half and r["tensor_bytes"] == total
        assert r["placed"]  # init_state kept the loaded arrays
    print(f"bytes read per process: {[r['bytes_read'] for r in reports]} of {total}")

    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert sorted(index["weight_map"]) == sorted(original) and index["metadata"]["total_size"] == total
    assert sorted(os.listdir(out)) == sorted(files | {"config.json", "model.safetensors.index.json"})
    written = {}
    for f in files:
        written.update(load_file(str(out / f)))
    for k, v in original.items():
        assert written[k].dtype == v.dtype and written[k].tobytes() == v.tobytes(), k
    assert all(r["files"] for r in reports) and not set(reports[0]["files"]) & set(reports[1]["files"])
    assert set(reports[0]["files"]) | set(reports[1]["files"]) == files  # each file by one process

    import torch
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    toks = torch.tensor(np.random.RandomState(0).randint(0, 128, (2, 12)))
    with torch.no_grad():
        np.testing.assert_array_equal(loaded(toks).logits.numpy(), ref(toks).logits.numpy())


def _child(src: str, out: str, report: str) -> None:
    """One of the two processes: rl.train's rl.init_from load and init_state, then `save` (as rl.export)."""
    from rl import distributed

    distributed.initialize()
    from model.io import hf
    from rl import train_state

    cfg = _run_config(src, fsdp=8)
    mesh = distributed.trainer_mesh(cfg)
    params, model_state, stats = hf.load_sharded(src, cfg, mesh)
    _, state = train_state.init_state(cfg, mesh=mesh, params=params, model_state=model_state)
    placed = all(_value(a) is _value(b) for a, b in zip(_leaves(params), _leaves(state.params), strict=True))
    mine = hf.save(cfg, train_state.weights(state), out, max_shard_bytes=MAX_SHARD_BYTES)
    distributed.barrier("saved")
    with open(report, "w") as f:
        json.dump(
            dict(
                process=jax.process_index(),
                bytes_read=stats.bytes_read,
                tensor_bytes=stats.tensor_bytes,
                placed=placed,
                files=mine,
            ),
            f,
        )


if __name__ == "__main__":
    _child(*sys.argv[1:])
