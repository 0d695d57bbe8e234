"""The main job across processes (multi-controller JAX, gloo collectives on CPU): two `python -m rl.train`
processes of 4 fake CPU devices each against one process of 8, a restart of both (the checkpoint saved and
restored across processes), and (slow) kill -9 of both followed by a restart.

Equal runs: the trainer's mesh is data=8 either way; every process draws the same global tasks and rolls out
its half with per-group sampling seeds, so the samples are the same. What differs is the order of the batch
rows (process 0's rows, padding, process 1's rows, padding; one process: every sample, then padding), so the
order in which the loss and gradient sums add up, and the all-reduce over 2 processes (gloo): gradients
agree to f32 rounding (~1e-7 relative), not bit for bit. Adam with its default eps (1e-8) would turn a
rounding difference in a near-zero gradient into an update of up to lr (its step is ~lr * sign(g)), so both
runs use eps=1e-3: an update then moves at most lr / eps = 3 per unit of gradient change, and the optimizer
steps (6 SFT + 3 or 4 GRPO) of ~1e-7 gradient rounding stay far below the tolerance, 2e-6 absolute
(measured: 2.4e-7 after 4 GRPO steps, while GRPO moved the parameters by up to 1.1e-2). The killed-and-
restarted pair of processes ends bit-identical to the uninterrupted pair (same process count, same
reduction order).

The default run's test compares the pair with the pytest worker itself (8 fake devices, the same config):
one process started less, and its programs are mostly compiled already.
"""

import os
import signal
import subprocess
import time

import main_job
import numpy as np
import pytest
import xla_env

from configs import grpo

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 4


OVERRIDES = {  # the run of both tests, also as --config flags
    "rl.checkpoint_every": 1,
    "rl.max_to_keep": 8,
    "rl.optim.eps": 1e-3,  # see the module docstring
}


# Sampler layouts (rl.engine.mesh): one engine over both processes, run in lockstep; an engine per process.
# Either samples the one-device engine's tokens (tests/inference/test_engine_hosts.py): the runs stay equal.
ONE_ENGINE = {"rl.engine.mesh.processes": 0, "rl.engine.mesh.expert": 2, "rl.engine.mesh.tensor": 2}
ENGINE_EACH = {"rl.engine.mesh.processes": 1, "rl.engine.mesh.expert": 2, "rl.engine.mesh.tensor": 2}


def _command(workdir, steps: int = STEPS, layout: dict | None = None) -> list[str]:
    flags = [f"--config.{k}={v}" for k, v in {**OVERRIDES, **(layout or {})}.items()]
    return main_job.command(workdir) + [f"--config.rl.steps={steps}", *flags]


def _start_pair(workdir, log_dir, steps: int = STEPS, layout: dict | None = None) -> list[subprocess.Popen]:
    port = xla_env.free_port()
    procs = []
    for i in range(2):
        env = xla_env.process_env(4, port, i)
        log = open(os.path.join(log_dir, f"{os.path.basename(workdir)}.{i}.log"), "ab")  # noqa: SIM115
        procs.append(
            subprocess.Popen(_command(workdir, steps, layout), cwd=ROOT, env=env, stdout=log, stderr=log)
        )
        log.close()
    return procs


def _wait(procs, log_dir, timeout=1500.0) -> None:
    deadline = time.time() + timeout
    for p in procs:
        try:
            p.wait(max(deadline - time.time(), 1))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    if any(p.returncode for p in procs):
        logs = "".join((log_dir / f).read_text()[-3000:] for f in sorted(os.listdir(log_dir)))
        raise AssertionError(f"return codes {[p.returncode for p in procs]}\n{logs}")


def _final(workdir, step=None):
    from rl import checkpoint, train_state

    cfg = grpo.get_config("test")
    _, target = train_state.init_state(cfg, seed=cfg.rl.seed)
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), save_every=1)
    state, meta = ckpt.restore(step, target_state=target)
    ckpt.close()
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(state.params)], meta


def _in_process_run(workdir, steps: int) -> None:
    """The test config's run in this process (the worker's 8 fake devices), as `_command` would run it."""
    from rl import train

    cfg = grpo.get_config("test")
    for dotted, value in {**OVERRIDES, "rl.steps": steps}.items():
        *parents, leaf = dotted.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        node[leaf] = value
    train.train(cfg, str(workdir), run_eval=False)


def _params_moved_and_equal(a, b, warm) -> float:
    moved = max(float(np.abs(x - y).max()) for x, y in zip(a, warm, strict=True))
    assert moved > 1e-3  # the GRPO updates happened (else equality would say little)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, atol=2e-6, rtol=0)
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def test_two_processes_equal_one_and_resume_across_processes(tmp_path):
    """Two processes run 2 GRPO steps with one engine over both and stop; restarted with rl.steps=3 and an
    engine each (the sampler layout is not part of the checkpoint), they restore step 2 across processes
    and run the third. One process (this one) runs the 3 steps; the parameters agree."""
    logs = tmp_path / "logs"
    logs.mkdir()
    pair, single = tmp_path / "pair", tmp_path / "single"
    procs = _start_pair(pair, logs, steps=2, layout=ONE_ENGINE)
    _in_process_run(single, 3)  # straight through: a resume is exact (test_train's kill -9 test)
    _wait(procs, logs)
    _wait(_start_pair(pair, logs, steps=3, layout=ENGINE_EACH), logs)
    said = (logs / "pair.0.log").read_text()
    assert "sampler: 1 engine(s), each over 2 process(es)" in said
    assert "sampler: 2 engine(s), each over its process" in said

    (a, meta_a), (b, meta_b) = _final(pair), _final(single)
    assert meta_a["step"] == meta_b["step"] == 3
    worst = _params_moved_and_equal(a, b, _final(pair, step=0)[0])
    print(f"2-process vs 1-process max |dparam| = {worst:.3g}")
    # Only process 0 writes metrics: one line per step, the resumed run's appended to the first's.
    steps = [line for line in (pair / "metrics.jsonl").read_text().splitlines() if '"train/loss"' in line]
    assert len(steps) == 3


@pytest.mark.slow
def test_two_processes_equal_one_and_resume_after_kill_9(tmp_path):
    """Covered in the default run, less the kill, by the test above (and by test_train.py's kill -9 of one
    process): two processes against one process of 8 started apart, and a kill -9 of both processes, all
    with one engine over both processes (lockstep)."""
    logs = tmp_path / "logs"
    logs.mkdir()
    pair, killed, single = tmp_path / "pair", tmp_path / "killed", tmp_path / "single"

    procs = _start_pair(pair, logs, layout=ONE_ENGINE)
    one = subprocess.run(
        _command(single, layout=ONE_ENGINE),
        cwd=ROOT,
        env=xla_env.process_env(8),
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    _wait(procs, logs)

    procs = _start_pair(killed, logs, layout=ONE_ENGINE)
    deadline = time.time() + 1500
    while not (killed / "checkpoints" / "2").exists():
        assert all(p.poll() is None for p in procs) and time.time() < deadline, "ended before step 2"
        time.sleep(0.05)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait()
    _wait(_start_pair(killed, logs, layout=ONE_ENGINE), logs)

    (a, meta_a), (b, meta_b), (c, meta_c) = _final(pair), _final(single), _final(killed)
    assert meta_a["step"] == meta_b["step"] == meta_c["step"] == STEPS
    worst = _params_moved_and_equal(a, b, _final(pair, step=0)[0])
    for x, y in zip(a, c, strict=True):
        assert np.array_equal(x, y)
    print(f"2-process vs 1-process max |dparam| = {worst:.3g}")
    # Only process 0 writes metrics: one line per step per logged quantity set, not two.
    steps = [line for line in (pair / "metrics.jsonl").read_text().splitlines() if '"train/loss"' in line]
    assert len(steps) == STEPS
