"""inference.serve.load: a Hugging Face directory, and a training run's weights read from its checkpoint
without rl (bit-equal to the trainer's restore), also served through the CLI."""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

import serving  # noqa: E402
from engines import small_engine  # noqa: E402

import model  # noqa: E402
from configs import tiny  # noqa: E402
from inference.serve import load as serve_load  # noqa: E402
from model.io.tokenizer import ByteTokenizer  # noqa: E402

ECFG = small_engine()

# --- loading ------------------------------------------------------------------------------------------------


def test_load_hf_directory(tmp_path):
    pytest.importorskip("safetensors")
    from flax import nnx

    from model.io import hf

    cfg = tiny.get_config("dense")  # (tiny MoE has qk_norm and a shared expert: no HF format holds both)
    m = model.build(cfg, seed=3)
    hf.save(cfg, nnx.state(m, nnx.Param), tmp_path / "ckpt")
    loaded = serve_load.load_hf(str(tmp_path / "ckpt"), tokenizer="byte")
    assert loaded.name == "ckpt" and isinstance(loaded.tokenizer, ByteTokenizer)
    got, want = nnx.state(loaded.weights, nnx.Param), nnx.state(m, nnx.Param)
    for a, b in zip(jax_leaves(got), jax_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _save_run(workdir, config_arg: str = "test", *, reference: bool = False, step: int = 3):
    """A training run directory as rl.train leaves it: config.json and a checkpoint at `step` of the train
    state (with `reference`: packed with the KL reference, as a run with a KL term checkpoints it). Returns
    the train state."""
    import jax

    from configs import grpo
    from rl import checkpoint, run, train_state

    cfg = grpo.get_config(config_arg)
    if reference and cfg.rl.loss.kl_kind == "none":
        cfg.rl.loss.kl_kind = "k3"
    workdir.mkdir(exist_ok=True)
    (workdir / "config.json").write_text(cfg.to_json_best_effort())
    _, state = train_state.init_state(cfg, seed=7 + step)  # not the run's seed: the weights are these
    # Selection biases away from their zero init, so that reading them is checked too.
    state = state.replace(model_state=jax.tree.map(lambda x: x + 0.25 * (step + 1), state.model_state))
    ref = train_state.reference_weights(state, cfg.rl.reference_dtype) if reference else None
    with checkpoint.Checkpointer(str(workdir / "checkpoints"), save_every=1, model_config=cfg.model) as ckpt:
        ckpt.save(step, run.pack(state, ref, None), {"step": step, "version": 0}, force=True)
        ckpt.wait()
    return state


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run with a checkpoint at step 3, and its weights."""
    from rl import train_state

    workdir = tmp_path_factory.mktemp("serve") / "run"
    return workdir, train_state.weights(_save_run(workdir))


def test_load_run_directory(run_dir):
    workdir, weights = run_dir
    loaded = serve_load.load_run(str(workdir))
    assert loaded.name == "run" and isinstance(loaded.tokenizer, ByteTokenizer)
    for a, b in zip(jax_leaves(loaded.weights), jax_leaves(weights)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("config_arg, reference", [("test", False), ("test,deepseek", True)])
def test_load_run_reads_the_weights_the_trainer_restores(tmp_path, config_arg, reference):
    """`load_run` reads only the weights (no `rl`); they are bit for bit, in tree, dtype and placement, those
    of the trainer's restore of the whole state (`rl.run.restore_state`) merged as the trainer hands them to
    its engine. Two checkpoints: the latest and a given step; a sigmoid router's selection biases; a
    checkpoint packed with its KL reference."""
    import jax

    from configs.runs import read_config
    from inference.engine import weight_shardings
    from rl import run, train_state

    workdir = tmp_path / "run"
    for step in (2, 5):
        _save_run(workdir, config_arg, reference=reference, step=step)
    cfg = read_config(str(workdir))
    for step in (None, 2):
        want = train_state.weights(run.restore_state(cfg, str(workdir), step)[0])
        got = serve_load.load_run(str(workdir), step).weights
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax_leaves(got), jax_leaves(want)):
            assert (a.shape, a.dtype, a.sharding) == (b.shape, b.dtype, b.sharding)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if config_arg == "test,deepseek":  # a sigmoid router: selection biases beside the params
        assert jax_leaves(run.restore_state(cfg, str(workdir))[0].model_state)
    # On a mesh: the same values, each read into the layout of an engine there.
    mesh = serve_load.parse_mesh("expert:2,tensor:2")
    loaded = serve_load.load_run(str(workdir), 2, mesh=mesh, engine_cfg=ECFG)
    assert loaded.placed
    where = jax_leaves(weight_shardings(cfg, ECFG, mesh))
    for a, b, sharding in zip(jax_leaves(loaded.weights), jax_leaves(want), where, strict=True):
        assert a.sharding == sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def test_cli_serves_a_run(run_dir):
    """`python -m inference.serve --workdir=RUN` in a subprocess: the run's model, one completion, exit."""
    workdir, _ = run_dir
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    import jax

    # The tests' persistent compilation cache (conftest.py), so a rerun compiles nothing.
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir
    )
    cmd = [
        sys.executable,
        "-m",
        "inference.serve",
        f"--workdir={workdir}",
        f"--port={port}",
        "--draft=none",
        "--nowarmup",
        "--max_batch=4",
        "--max_seq_len=96",
        "--page_size=8",
        "--prefill_chunk=32",
        "--num_pages=64",
        "--host_cache_pages=16",
    ]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        c = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120
        )

        def up():
            try:
                return [m.id for m in c.models.list()] == ["run"]
            except openai.APIConnectionError:
                return False

        assert serving.poll(up, 120, 0.5), (
            proc.stdout.read1().decode() if proc.poll() is not None else "not up"
        )
        r = c.completions.create(model="run", prompt="cli", max_tokens=4, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
