"""inference.serve on a mesh (`--mesh`): a Hugging Face checkpoint read straight into the engine's layout.

A transformers-written Qwen3-MoE (tests/hf_models.py's tiny one with the byte tokenizer's vocab: 4
experts, 4 query / 2 kv heads, f32, one safetensors file) is loaded by serve's loader with
`--mesh=expert:2,tensor:2` over the 8 fake devices (data: the other 2). Every weight then has exactly
`inference.engine.weight_shardings`' sharding and the one-device load's values; the process read each stored
byte once (`hf_files.total_bytes_read` equals the file's tensor data, where a reader of whole tensors per
device would read it 8 times), and the host-to-device transfers were exactly one per device and weight, of
that device's block (no weight placed whole on one device and resharded). Both served engines take those
arrays without a copy, and greedy tokens equal the one-device engine's. On `tensor:4` the engine replicates
the 2 kv heads over the 4 tensor devices, a layout the training rules refuse: the loader takes it all the
same. A bad `--mesh` is refused naming the flag, by `parse_mesh` and by the CLI before it loads anything.
"""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from configs.errors import UserError
from inference import Engine, EngineConfig, SamplingParams
from inference.drafters import WEIGHTS
from inference.engine import weight_shardings
from inference.serve import server as serve_server
from inference.serve.load import load_hf, parse_mesh
from model.io import hf_files

pytest.importorskip("safetensors")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ECFG = EngineConfig(
    max_batch=4, max_seq_len=64, page_size=8, num_pages=64, prefill_chunk=16, prefill_batch=2, min_bucket=16
)
VOCAB = 264  # the byte tokenizer's 256 bytes and 3 specials, a multiple of the tensor axis
PROMPTS = [[3, 17, 5], [90, 2, 44, 61, 7, 12, 100], [1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """tests/hf_models.py's tiny Qwen3-MoE with a vocab of VOCAB, saved by transformers' `save_pretrained`
    (the tests that load no checkpoint run without torch)."""
    import hf_models  # skips where torch or transformers is not installed

    path = tmp_path_factory.mktemp("qwen3_moe")
    hf_models.make_hf("qwen3_moe", path, vocab_size=VOCAB)
    return path


@pytest.fixture(scope="module")
def one_device(checkpoint):
    """Serve's loader without a mesh (today's path), and its engine."""
    loaded = load_hf(str(checkpoint), tokenizer="byte")
    return loaded, Engine(loaded.cfg, loaded.weights, ECFG)


def _data_bytes(path) -> int:
    """A safetensors file's tensor data: the file less its 8-byte length and JSON header."""
    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return os.path.getsize(path) - 8 - header


def _flat(state) -> dict:
    value = lambda v: v.get_value() if hasattr(v, "get_value") else v.value
    return {path: value(v) for path, v in nnx.to_flat_state(state)}


def _load_on(checkpoint, mesh_flag: str, monkeypatch):
    """(mesh, serve's load on it, bytes read); asserts that every transfer to a device was that device's
    block of one weight, once: the bytes put are the weights' shards, one put each."""
    mesh = parse_mesh(mesh_flag)
    put, real_put = [], jax.device_put
    with monkeypatch.context() as m:
        m.setattr(
            jax, "device_put", lambda x, *a, **k: put.append(np.asarray(x).nbytes) or real_put(x, *a, **k)
        )
        before = hf_files.total_bytes_read()
        loaded = load_hf(str(checkpoint), tokenizer="byte", mesh=mesh, engine_cfg=ECFG)
        bytes_read = hf_files.total_bytes_read() - before
    shards = [s.data.nbytes for a in jax.tree.leaves(loaded.weights) for s in a.addressable_shards]
    assert sorted(put) == sorted(shards)
    return mesh, loaded, bytes_read


def _assert_engine_layout_and_values(loaded, mesh, want_weights):
    targets = _flat(weight_shardings(loaded.cfg, ECFG, mesh))
    got, want = _flat(loaded.weights), _flat(nnx.state(want_weights, WEIGHTS))
    assert set(got) == set(targets) == set(want)
    for path, array in got.items():
        assert array.sharding == targets[path], path
        np.testing.assert_array_equal(np.asarray(array), np.asarray(want[path]), err_msg=str(path))


def test_hf_dir_on_expert2_tensor2_loads_into_the_engine_layout_and_decodes_alike(
    checkpoint, one_device, monkeypatch
):
    mesh, loaded, bytes_read = _load_on(checkpoint, "expert:2,tensor:2", monkeypatch)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "expert": 2, "tensor": 2, "sequence": 1}
    assert loaded.placed
    assert bytes_read == _data_bytes(checkpoint / "model.safetensors")  # each stored byte once
    reference_loaded, reference = one_device
    _assert_engine_layout_and_values(loaded, mesh, reference_loaded.weights)
    gate = _flat(loaded.weights)[("moe_layers", "blocks", "mlp", "gate")]  # [L, E, D, F] = [2, 4, 32, 24]
    assert gate.sharding.shard_shape(gate.shape) == (2, 2, 32, 12)  # experts over expert, F over tensor

    server = serve_server.Server.build(loaded, ECFG, draft="ngram", warmup=False, mesh=mesh)
    plain, fast = (server.loops[n].engine for n in (loaded.name, loaded.name + serve_server.FAST_SUFFIX))
    loaded_leaves = jax.tree.leaves(loaded.weights)
    for eng in (plain, fast):  # placed: both engines run on the loaded arrays themselves
        assert eng.mesh is mesh
        assert all(a is b for a, b in zip(jax.tree.leaves(eng.params), loaded_leaves, strict=True))

    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    got = [c.tokens for c in plain.generate(PROMPTS, greedy)]
    want = [c.tokens for c in reference.generate(PROMPTS, greedy)]
    assert got == want and all(len(t) == NEW_TOKENS for t in got)


def test_hf_dir_on_tensor4_takes_the_engines_replicated_kv_heads(checkpoint, one_device, monkeypatch):
    from model.io import hf

    mesh, loaded, bytes_read = _load_on(checkpoint, "tensor:4", monkeypatch)
    with pytest.raises(ValueError, match="num_kv_heads"):  # the training layout cannot split 2 kv heads
        hf.load(checkpoint, mesh=mesh)
    assert bytes_read == _data_bytes(checkpoint / "model.safetensors")
    _assert_engine_layout_and_values(loaded, mesh, one_device[0].weights)
    k = _flat(loaded.weights)[("moe_layers", "blocks", "attn", "k")]  # [L, D, K, H] = [2, 32, 2, 8]
    assert k.sharding.is_fully_replicated


@pytest.mark.parametrize(
    "flag, why",
    [
        ("expert:2,tensor:3", "does not divide"),
        ("data:4,tensor:4", "but there are 8 devices"),
        ("bogus:2", "'bogus:2' is not one"),
        ("tensor", "'tensor' is not one"),
        ("tensor:2,tensor:2", "'tensor' is given twice"),
        ("tensor:two", "not an integer"),
        ("tensor:0", "must be positive"),
        ("sequence:2", "decoding shards no sequence"),
    ],
)
def test_bad_mesh_is_refused_naming_the_flag(flag, why):
    with pytest.raises(UserError, match=f"^--mesh={flag}") as e:
        parse_mesh(flag)
    assert why in str(e.value)


def test_cli_refuses_a_bad_mesh_before_loading(tmp_path):
    """The CLI exits 2 with one line naming --mesh, before it reads the (missing) checkpoint."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "inference.serve", f"--hf_dir={tmp_path}", "--mesh=expert:3,tensor:3"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: --mesh=expert:3,tensor:3 over "), proc.stderr
