"""An engine across hosts (`rl.engine.mesh`, `rl.sampler`): two processes of 4 fake CPU devices each, the
trainer's state on fsdp 8 over both, pushed to the sampler layout in one jitted reshard.

- One engine over both processes (expert 2 x tensor 2, data 2: `rl.engine.mesh.processes=0`), stepped in
  lockstep by both: the same tokens on both, equal to the one-device engine's greedy tokens and seeded T=1
  samples, log-probs within `LOGP_ATOL`.
- An engine per process (expert 2 x tensor 2 over its 4 devices): the same.
Each device holds its share of the weights, not a copy: the largest per-device bytes of the engine's weights
are checked against the share derived by hand below.
"""

import json
import os
import subprocess
import sys

import engine_hosts_common as common
import jax
import numpy as np
import pytest
import xla_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# As tests/inference/test_sharded_engine.py: the sharded forward adds the same f32 terms in another order.
LOGP_ATOL = 1e-5


# The test model (configs/grpo.py:test): vocab 256, width 64, 2 MoE layers of 4 experts of width 96 with a
# shared expert of width 64, 4 query / 2 kv heads of 16; f32. The engine layout (inference.layout) splits
# the vocabulary, heads, kv heads and expert widths over tensor 2, the experts over expert 2; norms and
# routers are whole on every device.
_ATTN = {"q": 64 * 4 * 16, "k": 64 * 2 * 16, "v": 64 * 2 * 16, "o": 4 * 16 * 64}  # all split over tensor
_NORMS = 16 + 16 + 64 + 64  # q_norm, k_norm, attn_norm, mlp_norm: whole
_EXPERTS = 3 * 4 * 64 * 96  # gate, up, down: experts over expert, width over tensor (/ 4)
_SHARED = 3 * 64 * 64  # the shared expert's width over tensor (/ 2)
_ROUTER = 64 * 4  # whole
_VOCAB = 2 * 256 * 64  # embedding and unembedding, vocabulary over tensor (/ 2)
FULL_ELEMENTS = _VOCAB + 64 + 2 * (sum(_ATTN.values()) + _NORMS + _EXPERTS + _SHARED + _ROUTER)
SHARE_ELEMENTS = (
    _VOCAB // 2 + 64 + 2 * (sum(_ATTN.values()) // 2 + _NORMS + _EXPERTS // 4 + _SHARED // 2 + _ROUTER)
)


def _pair(tmp_path) -> list[list[dict]]:
    """Each process's results, one per layout."""
    port = xla_env.free_port()
    script = os.path.join(ROOT, "tests", "inference", "engine_hosts_child.py")
    path = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")])
    procs, logs = [], [tmp_path / f"child.{i}.log" for i in range(2)]
    for i, log in enumerate(logs):
        with open(log, "w") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, script, str(i), str(port)],
                    cwd=ROOT,
                    env=xla_env.process_env(4, PYTHONPATH=path),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    results = []
    for p, log in zip(procs, logs, strict=True):
        p.wait(timeout=600)
        text = log.read_text()
        assert p.returncode == 0, text[-4000:]
        lines = [x[len("RESULT ") :] for x in text.splitlines() if x.startswith("RESULT ")]
        results.append([json.loads(x) for x in lines])
    return results


@pytest.fixture(scope="module")
def reference() -> dict:
    from inference import Engine
    from rl import train_state, validate

    cfg = common.config()
    _, state = train_state.init_state(cfg, seed=common.SEED)
    engine = Engine(cfg, train_state.weights(state), validate.engine_config(cfg))
    out = common.run(engine)
    out["crowd"] = common.run(engine, common.CROWD)
    out["param_bytes"] = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(train_state.weights(state)))
    return out


def _same_as_reference(out: dict, ref: dict) -> None:
    assert out["greedy"] == ref["greedy"]
    assert out["sampled"] == ref["sampled"]
    for a, b in zip(out["logprobs"], ref["logprobs"], strict=True):
        np.testing.assert_allclose(a, b, atol=LOGP_ATOL, rtol=0)


def test_engine_across_processes_equals_one_device(reference, tmp_path):
    results = _pair(tmp_path)
    for i, outs in enumerate(results):
        assert [out["per"] for out in outs] == [0, 1, "spec"]
        spec = outs.pop()  # speculative, preempting: the same greedy tokens (exact speculative decoding)
        assert spec["greedy"] == reference["crowd"]["greedy"] and spec["proposed"] > 0
        assert spec["preemptions"] > 0, spec  # the pool holds 3 pages: a growing sequence evicts another
        for out in outs:
            per = out["per"]
            _same_as_reference(out, reference)
            assert out["lockstep"] == (per == 0)
            assert out["engine_processes"] == ([0, 1] if per == 0 else [i])
            assert out["engine_size"] == (8 if per == 0 else 4)
            assert out["engine_shape"]["expert"] == 2 and out["engine_shape"]["tensor"] == 2
            assert reference["param_bytes"] == 4 * FULL_ELEMENTS
            assert out["weight_bytes"] == 4 * SHARE_ELEMENTS
