"""Sharded end to end: two `rl.train` processes of 4 fake CPU devices each post-train a transformers-written
Qwen3-MoE checkpoint (`rl.init_from`) on a trainer mesh of fsdp 8 with one engine over both processes
(expert 2 x tensor 2 x data 2, lockstep), then two `rl.export` processes write it back, and transformers'
logits on the export equal our model's of the final state.

What no device may hold, checked on the live-bytes figure the main job logs (`memory/*`, the largest over
every device of both processes, `rl.memory`):
- the checkpoint's parameters are 1,239,936 f32 elements (4.96 MB, by hand below); every device holds less
  than that in all its live arrays together: params, Adam's two moments, the engine's weights and its KV
  pages. No device could have held the model in the old layout (one device, then replicated weights);
- each part equals `rl.plan.memory.device_bytes`'s prediction for this config and meshes exactly, and the
  whole within `TOTAL_RTOL` (what the prediction leaves out: a rollout batch and per-step scalars, ~1 KB).
Bytes read from the checkpoint: each process reads its devices' slices: half of every matrix (fsdp splits
one dim of each 8 ways, 4 parts per process) and every vector whole (counted from the safetensors header).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import xla_env
from hf_models import LOGIT_ATOL, hf_logits, jit_logits, make_hf, write_byte_tokenizer
from safetensors import safe_open

from configs import grpo
from configs.runs import read_config
from rl import run as run_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 260  # the byte-level tokenizer's 257 ids, rounded up
# tests/hf_models.py's tiny Qwen3-MoE (2 layers, 4 query / 2 kv heads, top-2), wider and with more experts.
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=64,
    head_dim=16,
    moe_intermediate_size=192,
    num_experts=16,
    max_position_embeddings=128,
)
# By hand: per layer q 64x64, k and v 64x32, o 64x64, 2 norms of 64 and q/k norms of 16, a router 16x64
# and 16 experts of 3 x 64 x 192; embedding and head 260 x 64 each; a final norm of 64.
LAYER = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 2 * 64 + 2 * 16 + 16 * 64 + 16 * 3 * 64 * 192
PARAMS = 2 * LAYER + 2 * VOCAB * 64 + 64
assert PARAMS == 1_239_936
TOTAL_RTOL = 0.01
LAYOUT = {  # trainer fsdp 8 over both processes; one engine over both, expert 2 x tensor 2 x data 2
    "mesh.shape.data": 1,
    "mesh.shape.fsdp": 8,
    "rl.engine.mesh.processes": 0,
    "rl.engine.mesh.expert": 2,
    "rl.engine.mesh.tensor": 2,
}
RUN = {
    "rl.steps": 2,
    "rl.checkpoint_every": 2,
    # Two warm-start steps at this rate: the random checkpoint then answers the debug domain right about
    # half the time, so GRPO has groups with a reward signal (found by trying: 3 or more steps, all right).
    "rl.sft.steps": 2,
    "rl.sft.optim.lr": 3e-2,
    **LAYOUT,
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe_pod")
    make_hf("qwen3_moe", path, **SIZES)
    write_byte_tokenizer(path)
    return path


def _pair(args: list[str], log_dir, name: str) -> list[str]:
    """Runs `python -m <args>` as two processes of 4 fake devices; returns their outputs."""
    port = xla_env.free_port()
    procs = []
    for i in range(2):
        env = xla_env.process_env(4, port, i)
        log = open(log_dir / f"{name}.{i}.log", "w")  # noqa: SIM115
        procs.append(
            subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=env, stdout=log, stderr=log)
        )
        log.close()
    for p in procs:
        p.wait(timeout=1200)
    logs = [(log_dir / f"{name}.{i}.log").read_text() for i in range(2)]
    assert all(p.returncode == 0 for p in procs), "\n".join(x[-3000:] for x in logs)
    return logs


def _expected_bytes_read(path) -> tuple[int, int]:
    """(bytes of the checkpoint's tensors, bytes one process reads: half of every matrix, vectors whole)."""
    total = mine = 0
    with safe_open(str(path / "model.safetensors"), framework="np") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            x = f.get_slice(name)
            n = int(np.prod(x.get_shape())) * 4
            total += n
            mine += n if len(x.get_shape()) == 1 else n // 2
    return total, mine


def _config(checkpoint):
    cfg = grpo.get_config("test")
    cfg.rl.init_from = str(checkpoint)
    for dotted, value in RUN.items():
        *parents, leaf = dotted.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        node[leaf] = value
    return cfg


def test_two_processes_post_train_a_checkpoint_no_device_could_hold(checkpoint, tmp_path):
    from model.io import hf
    from rl import train_state, validate
    from rl.plan import memory as plan_memory

    workdir, exported = tmp_path / "run", tmp_path / "exported"
    flags = [f"--config.{k}={v}" for k, v in RUN.items()]
    logs = _pair(
        [
            "rl.train",
            "--config=configs/grpo.py:test",
            f"--workdir={workdir}",
            "--eval=false",
            f"--config.rl.init_from={checkpoint}",
            *flags,
        ],
        tmp_path,
        "train",
    )

    # Each process read its slices: half of every matrix, every vector whole.
    total, mine = _expected_bytes_read(checkpoint)
    assert total == 4 * PARAMS
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    read = next(r for r in records if "init_from/bytes_read_max" in r)
    assert read["init_from/checkpoint_bytes"] == total
    assert read["init_from/bytes_read_max"] == mine and read["init_from/bytes_read_total"] == 2 * mine
    assert f"read {mine:,}, {mine:,} of the checkpoint's {total:,} bytes" in logs[0]
    assert "sampler: 1 engine(s), each over 2 process(es)" in logs[0]

    # The run trained: SFT and GRPO steps, at least one update with a reward signal.
    grpo_records = [r for r in records if "train/loss" in r or "train/skipped" in r]
    assert [r["step"] for r in grpo_records] == [1, 2]
    assert any("train/loss" in r for r in grpo_records)

    # Live bytes per device: every logged step, against the planner's prediction and the model's size.
    run_cfg = validate.init_from_config(_config(checkpoint))
    planned = plan_memory.device_bytes(run_cfg, {"fsdp": 8}, {"data": 2, "expert": 2, "tensor": 2})
    steps = [r for r in records if "memory/device_bytes" in r]
    assert len(steps) == 2
    for r in steps:
        for part in ("params", "optimizer", "sampler_weights", "kv_pages"):
            assert r[f"memory/{part}_bytes"] == planned[part], (part, r, planned)
        assert abs(r["memory/device_bytes"] - planned["total"]) <= TOTAL_RTOL * planned["total"], (r, planned)
        assert r["memory/device_bytes"] < 4 * PARAMS  # less than the f32 checkpoint, all parts together
    print(f"planned {planned}; measured {steps[-1]}")

    # Export by both processes; transformers reads it, and its logits are our model's of the final state.
    out = _pair(["rl.export", f"--workdir={workdir}", f"--out={exported}"], tmp_path, "export")
    assert "wrote step 2" in out[0] or (exported / "config.json").exists()
    state, meta = run_dir.restore_state(read_config(str(workdir)), str(workdir))
    assert meta["step"] == 2
    model_def, _ = train_state.init_state(read_config(str(workdir)), seed=0)
    toks = np.random.RandomState(1).randint(0, VOCAB, (2, 12))
    want = hf_logits(exported, toks)
    np.testing.assert_allclose(jit_logits(model_def, state, toks), want, atol=LOGIT_ATOL, rtol=0)
    # The export is the trained model, not the checkpoint it started from.
    _, original = hf.load(checkpoint)
    assert not np.array_equal(
        np.asarray(original["unembed"][...]), np.asarray(hf.load(exported)[1]["unembed"][...])
    )
