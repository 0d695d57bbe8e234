"""Options of the GRPO loop, each through the main job (`rl.train.train` on configs/grpo.py:test): the
metric that shows the option acts is checked, not only that nothing crashed.

To keep the suite within its time budget, options that do not interact share a run (PPO updates, KL to the
reference, top-k/top-p, an environment kwarg; routing replay with the group drafter; gradient projection
with the model drafter); each assertion names the option it checks. Every run is 3 GRPO steps on the tiny
model after a 10-step warm start.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import xla_env

from configs import grpo
from model.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(**rl):
    cfg = grpo.get_config("test")
    cfg.rl.steps, cfg.rl.checkpoint_every = 3, 3
    cfg.rl.update(rl)
    return cfg


def _records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _steps(workdir):
    return [r for r in _records(workdir) if "train/loss" in r]


def test_ppo_epochs_kl_top_k_and_env_kwargs(tmp_path):
    from rl import train

    cfg = _cfg(ppo_epochs=2, mini_batches=2, top_k=200, top_p=0.99)
    cfg.rl.sft.steps = 2  # a shorter warm start: the filtered sampler still misses, groups carry variance
    cfg.rl.loss.update(kl_kind="k3", kl_coef=0.1)
    cfg.rl.optim.lr = 1e-2  # big enough steps that the second update's ratio leaves the clip range
    cfg.rl.env.debug = {"delay_median_s": 0.001}
    out = train.train(cfg, str(tmp_path), run_eval=False)
    assert out["steps"] == 3 and out["engine"]["compiles_after_warmup"] == 0
    steps = [r for r in _steps(tmp_path) if r["train/loss"] is not None]
    assert len(steps) == len(_steps(tmp_path)) >= 1  # steps with a reward signal trained, all finite
    for r in steps:
        assert r["train/updates"] == 4.0  # ppo_epochs x mini_batches optimizer steps per batch
        assert np.isfinite(r["train/loss"])
    # ppo_epochs=2: from the second update on, the ratio moves and clipping engages.
    assert max(r["train/clip_fraction"] for r in steps) > 0
    assert max(r["train/ratio_max"] for r in steps) > 1.0
    # kl_kind: the policy moves away from the frozen step-0 reference.
    assert steps[-1]["train/kl"] > 0
    # top-k/top-p: the trainer scores under the sampler's processing, so the sampler's and the trainer's
    # log-probs of the sampled tokens agree (f32 engine vs f32 trainer: rounding only).
    for r in steps:
        assert abs(r["train/mismatch_kl"]) < 1e-5, r["train/mismatch_kl"]
        assert r["train/mismatch_out_of_band"] == 0.0
    # rl.env.debug.delay_median_s reached the environment: every task carries a drawn delay.
    with open(tmp_path / "samples.jsonl") as f:
        episodes = [json.loads(line) for line in f]
    assert episodes and all(e["metadata"]["delay_s"] > 0 for e in episodes)


def _loss_run(workdir, steps: int, ppo_epochs: int = 1, **loss):
    """The test config with batch-std advantages, a bf16 KL reference and every sample logged, run (or
    resumed) to `steps` with `loss` changes (a loss change resumes: only the model config is checked);
    returns the last step's record."""
    from rl import train

    cfg = _cfg(steps=steps, checkpoint_every=1, log_samples=8, advantage_std="batch", ppo_epochs=ppo_epochs)
    cfg.rl.reference_dtype = "bfloat16"
    cfg.rl.loss.update(kl_kind="k3", kl_coef=0.05, **loss)
    train.train(cfg, str(workdir), run_eval=False)
    return [r for r in _records(workdir) if r["step"] == steps and "pipeline/train_s" in r][-1]


def test_loss_options_each_change_the_update(tmp_path, capsys):
    """One main job, resumed under each loss option, each asserting what the option changes:
    advantage_std=batch (the logged advantages are (r - group mean) / (batch std + 1e-6), by hand),
    reference_dtype=bfloat16 (the first update's KL is > 0: the reference is the policy rounded to bf16; an
    f32 reference gives exactly 0), the corrections icepop / seq-mask / seq-reject with the band [1, 1]
    (only sampler/trainer ratios of exactly 1 kept: the engine's and the trainer's programs round apart, so
    tokens, and whole rows for the sequence corrections, are dropped) and none (weight 1 on every token), and
    GSPO's ratio=sequence with seq-mean-token-mean over two PPO epochs: from one checkpoint, the same first
    update, then the mean ratio is the token ratios' geometric mean per row, below their arithmetic mean
    (AM-GM) at the same log-probs (same approx_kl)."""
    run = tmp_path / "run"
    first = _loss_run(run, 2)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    by_step = {}
    for s in samples:  # the kept samples are the batch (8 rows, all logged); dropped ones have none
        if s["kept"]:
            by_step.setdefault(s["step"], []).append(s)
        else:
            assert s["advantage"] is None, s
    assert by_step
    for step, rows in by_step.items():
        rewards = np.array([s["reward"] for s in rows], np.float64)
        groups = {}
        for s in rows:
            groups.setdefault(s["group"], []).append(s["reward"])
        for s in rows:
            expected = (s["reward"] - np.mean(groups[s["group"]])) / (rewards.std() + 1e-6)
            assert s["advantage"] == pytest.approx(expected, rel=1e-5, abs=1e-6), (step, s)
    assert "train/tis_weight_mean" in first  # the default correction (tis) weighs the first run
    kl_first = [r["train/kl"] for r in _records(run) if "train/kl" in r][0]
    assert 0 < kl_first < 1e-2, kl_first

    band = dict(correction_low=1.0, correction_high=1.0)
    for steps, correction in ((3, "icepop"), (4, "seq-mask"), (5, "seq-reject")):
        r = _loss_run(run, steps, correction=correction, **band)
        assert "train/loss" in r, (correction, r)
        assert r["train/correction_kept_fraction"] < 1.0, (correction, r)
    branch = tmp_path / "branch"
    shutil.copytree(run, branch)  # checkpoint 5, for the ratio comparison below
    gspo = dict(ppo_epochs=2, correction="none", aggregation="seq-mean-token-mean", **band)
    token = _loss_run(run, 6, ratio="token", **gspo)
    # none: weight 1 on every trained token, whatever the band.
    assert token["train/is_weight_mean"] == token["train/correction_kept_fraction"] == 1.0, token
    capsys.readouterr()
    sequence = _loss_run(branch, 6, ratio="sequence", **gspo)
    assert "GSPO" in capsys.readouterr().err  # the published clip ranges are named
    assert token["train/updates"] == sequence["train/updates"] == 2.0
    assert sequence["train/approx_kl"] == pytest.approx(token["train/approx_kl"], rel=1e-3)
    assert sequence["train/ratio_mean"] < token["train/ratio_mean"]


def test_gradient_projection_between_domains_with_the_model_drafter(tmp_path):
    """rl.gradient_projection: rows carry their domain to the step, which reports the projection of every
    step (the arithmetic of the projection is checked in tests/rl/test_projection.py). The same run drafts
    with a draft model (rl.engine.draft="model"), distilled from the policy after each update."""
    from rl import train

    cfg = _cfg(steps=2, checkpoint_every=2, domains=("debug", "arith"), gradient_projection=True)
    cfg.rl.engine.draft = "model"
    out = train.train(cfg, str(tmp_path), run_eval=False)
    assert out["steps"] == 2 and out["engine"]["compiles_after_warmup"] == 0
    records = _steps(tmp_path)
    # The model drafter: its drafts are taken, and it is kept in step with the policy (distillation).
    assert out["engine"]["accepted_tokens"] > 0, out["engine"]
    assert "engine/acceptance_rate" in records[-1]
    assert all(np.isfinite(r["draft/cross_entropy"]) for r in records)
    steps = [r for r in records if r["train/loss"] is not None]
    assert steps
    for r in steps:
        assert np.isfinite(r["train/loss"]) and np.isfinite(r["train/grad_norm"])
        cosine = r["train/projection/cosine/debug|arith"]
        assert -1.0 - 1e-6 <= cosine <= 1.0 + 1e-6
        assert r["train/projection/conflicts"] in (0.0, 1.0, 2.0)
        # Rows of both domains kept: both gradients are non-zero, so their cosine is defined and non-zero;
        # rows of debug alone: arith's gradient is zero, its cosine 0 and nothing projected.
        both = r.get("rollout/samples/arith", 0) > 0 and r.get("rollout/samples/debug", 0) > 0
        assert (cosine != 0.0) == both, r
        assert both or r["train/projection/kept"] == 1.0


def test_disaggregated_sampler_with_delta_weight_sync(tmp_path):
    """rl.sampler_devices=4: the trainer's mesh takes 4 of the 8 fake devices, the engine the other 4; the
    weights go device to device after every update, only the changed leaves (weight_sync_delta=0)."""
    from rl import train

    cfg = _cfg(sampler_devices=4, weight_sync_delta=0.0)
    out = train.train(cfg, str(tmp_path), run_eval=False)
    assert out["steps"] == 3 and out["engine"]["compiles_after_warmup"] == 0
    steps = [r for r in _steps(tmp_path) if r["train/loss"] is not None]
    assert steps
    for r in steps:
        # Every trained leaf changed (AdamW moves every parameter), so every leaf was sent, across devices.
        assert r["sync/leaves_sent"] == r["sync/leaves"] > 0 and r["sync/bytes"] > 0
        assert r["sync/max_unsent_change"] == 0.0
        # The engine samples with exactly the trainer's weights: the log-probs agree to f32 rounding.
        assert abs(r["train/mismatch_kl"]) < 1e-5, r["train/mismatch_kl"]


def test_routing_replay_with_group_drafter(tmp_path):
    from rl import train

    cfg = _cfg(routing_replay=True)
    cfg.rl.engine.draft = "group"
    out = train.train(cfg, str(tmp_path), run_eval=False)
    assert out["steps"] == 3 and out["engine"]["compiles_after_warmup"] == 0
    steps = _steps(tmp_path)
    # The replayed forward matches the sampler's routing: on the f32 tiny model the sampler's and the
    # trainer's log-probs agree up to rounding.
    assert all(abs(r["train/mismatch_kl"]) < 1e-5 for r in steps)
    # The group drafter proposes from sibling samples ("Reply with: ok": the samples share their text).
    assert out["engine"]["accepted_tokens"] > 0
    assert max(r["engine/tokens_per_target_forward"] for r in steps) > 1.0


# The model drafter runs in test_gradient_projection_between_domains_with_the_model_drafter. The MTP
# drafter's main-job run compiles every program anew for the model with an MTP module (~44 s of a
# loaded suite); tests/rl/test_hf_main_job.py's DeepSeek run drafts with its checkpoint's MTP module in the
# default run (accepted drafts, the acceptance logged); tests/inference/test_mtp_drafter.py checks the
# drafter.
@pytest.mark.parametrize("draft", ["ngram", pytest.param("mtp", marks=pytest.mark.slow)])
def test_drafters_in_the_rollout(tmp_path, draft):
    from rl import train

    cfg = _cfg(async_rollout=draft == "ngram")
    cfg.rl.engine.draft = draft
    if draft == "mtp":  # the model's own MTP head, trained by the warm start's MTP loss
        cfg.model.mtp_layers, cfg.rl.sft.mtp_weight = 1, 1.0
    out = train.train(cfg, str(tmp_path), run_eval=False)
    assert out["steps"] == 3 and out["engine"]["compiles_after_warmup"] == 0
    steps = _steps(tmp_path)
    assert out["engine"]["accepted_tokens"] > 0, out["engine"]
    assert "engine/acceptance_rate" in steps[-1]


def test_config_error_before_any_work(tmp_path):
    """A bad field is refused by name before the pool, the model or the SFT exist: nothing is written."""
    from rl import train

    for field, value, match in [
        ("loss.clip_low", -0.1, "rl.loss.clip_low"),
        ("advantage_std", "grp", "rl.advantage_std"),
        ("max_staleness", -1, "rl.max_staleness"),
        ("mini_batches", 3, "rl.mini_batches"),
        ("engine.draft", "medusa", "rl.engine.draft"),
        ("engine.draft", "mtp", "rl.engine.draft='mtp' needs multi-token-prediction modules"),
        ("temperature", 0.0, "rl.temperature"),
    ]:
        cfg = _cfg()
        node, leaf = cfg.rl, field
        if "." in field:
            block, leaf = field.split(".")
            node = cfg.rl[block]
        node[leaf] = value
        workdir = tmp_path / field
        start = time.perf_counter()
        with pytest.raises(ConfigError, match=match):
            train.train(cfg, str(workdir), run_eval=False)
        assert time.perf_counter() - start < 5.0, field  # no SFT, no pool, no compile first
        assert not workdir.exists(), field
    cfg = _cfg()  # several speculative steps per device call: only the draft model runs them
    cfg.rl.engine.draft, cfg.rl.engine.decode_steps = "ngram", 4
    with pytest.raises(
        ConfigError, match=r"rl\.engine\.decode_steps=4 must be 0 or 1 with rl\.engine\.draft='ngram'"
    ):
        train.train(cfg, str(tmp_path / "steps"), run_eval=False)
    assert not (tmp_path / "steps").exists()
    cfg = _cfg()
    cfg.rl.env.debug = {"delay_mediansecs": 1.0}
    with pytest.raises(ConfigError, match=r"rl\.env\.debug.*delay_mediansecs.*delay_median_s"):
        train.train(cfg, str(tmp_path / "env"), run_eval=False)


def test_a_run_without_learning_signal_stops_and_a_refused_rerun_changes_nothing(tmp_path):
    """Without the warm start the tiny model never answers "ok": every group has reward 0 and is dropped, so
    after rl.max_skipped_steps=2 steps without an update the run stops, saved, naming the cause and counts,
    with the dropped samples in samples.jsonl. A rerun with another model config is refused
    (ConfigMismatch) and leaves the run's config.json as it was."""
    from rl import checkpoint, run_log, train

    cfg = _cfg(steps=5, checkpoint_every=5, max_skipped_steps=2)
    cfg.rl.sft.steps = 0
    with pytest.raises(run_log.NoLearningSignal) as stop:
        train.train(cfg, str(tmp_path), run_eval=False)
    message = str(stop.value)
    assert message.startswith("no update in 2 steps in a row (rl.max_skipped_steps=2")
    groups = 2 * cfg.rl.prompts_per_step * cfg.rl.max_attempts  # 2 steps, every back-fill round dropped
    assert f"no reward variance: {groups} groups had equal rewards (mean reward 0.000)" in message
    assert "rl.sft.steps" in message and "Checkpoint 2 is saved" in message
    ckpt = checkpoint.Checkpointer(tmp_path / "checkpoints", save_every=1)
    assert ckpt.latest_step() == 2
    ckpt.close()
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples and all(not s["kept"] and s["reward"] == 0.0 for s in samples)
    assert sorted({s["step"] for s in samples}) == [1, 2]

    config_json = (tmp_path / "config.json").read_text()
    changed = _cfg(steps=6, checkpoint_every=1)
    changed.model.rope.theta = 5000.0  # same shapes, another model
    with pytest.raises(checkpoint.ConfigMismatch, match="rope.theta"):
        train.train(changed, str(tmp_path), run_eval=False)
    assert (tmp_path / "config.json").read_text() == config_json


def _wait_for(proc, path, count: int, key: str, timeout_s: float = 300) -> None:
    """Until `path` (metrics.jsonl) has `count` records with `key`; the process must still be running."""
    deadline = time.time() + timeout_s
    while not (path.exists() and path.read_text().count(f'"{key}"') >= count):
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read().decode()[-3000:]
        time.sleep(0.05)


def test_signals_save_the_current_step_and_resume(tmp_path):
    """SIGTERM in the warm start saves the SFT progress (exit 143) and the next start continues it; Ctrl-C
    (SIGINT) in the GRPO loop at a step that is no multiple of rl.checkpoint_every saves that step (exit 130):
    a restart resumes there (before, only checkpoint 0 was left and the rerun logged steps 1-6 again)."""
    from rl import checkpoint

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_env.child_flags(1))
    env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(ROOT, ".jax_cache")
    command = [sys.executable, "-m", "rl.train", "--config=configs/grpo.py:test", f"--workdir={tmp_path}"]
    command += ["--eval=false", "--config.rl.checkpoint_every=50"]
    popen = dict(cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    metrics = tmp_path / "metrics.jsonl"

    def latest_meta():
        ckpt = checkpoint.Checkpointer(tmp_path / "checkpoints", save_every=1)
        try:
            return ckpt.latest_step(), ckpt.read_meta()
        finally:
            ckpt.close()

    proc = subprocess.Popen(command + ["--config.rl.sft.steps=100000", "--config.rl.steps=1"], **popen)
    _wait_for(proc, metrics, 5, "sft/cross_entropy")
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 143, output[-3000:]
    step, meta = latest_meta()
    done = meta["sft_step"]
    assert 5 <= done < 100000 and step == meta["step"] == 0
    assert f"stopped by SIGTERM: saved SFT step {done} of 100000" in output
    # The console stays quiet: library INFO lines went to log.txt.
    assert "checkpoint_manager.py" not in output and (tmp_path / "log.txt").exists()

    proc = subprocess.Popen(
        command + [f"--config.rl.sft.steps={done + 3}", "--config.rl.steps=1000"], **popen
    )
    _wait_for(proc, metrics, 3, "pipeline/train_s")
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 130, output[-3000:]
    assert f"resumed the SFT warm start at step {done} of {done + 3}" in output
    sft_steps = [r["step"] for r in _records(tmp_path) if "sft/cross_entropy" in r]
    assert sft_steps[-3:] == [done, done + 1, done + 2]  # continued, not restarted
    stopped, meta = latest_meta()
    logged = [r["step"] for r in _records(tmp_path) if "pipeline/train_s" in r]
    assert stopped == meta["step"] == logged[-1] >= 3 and stopped % 50, (stopped, logged)
    assert f"stopped by SIGINT: saved GRPO step {stopped} in" in output
    # The next start restores that checkpoint (the resume itself: test_train's kill -9 test), and says so.
    from rl import run_log

    assert run_log.resume_note({"step": stopped}, grpo.get_config("test").rl) == (
        f"resumed from checkpoint {stopped} (GRPO step {stopped} of 4)"
    )


def test_rl_evaluate_reproduces_the_runs_eval_after(tmp_path):
    """`rl.evaluate` on a saved run scores the run's own held-out tasks (levels, prompt-length filter, seed):
    its numbers are those of the run's eval_after.json."""
    from rl import evaluate, train

    cfg = _cfg(steps=1, checkpoint_every=1, domains=("arith",), max_prompt_len=12, max_new_tokens=8)
    cfg.rl.levels = {"arith": (1, 2)}
    cfg.rl.eval.n_tasks, cfg.rl.eval.k = 6, 2
    cfg.rl.loss.update(kl_kind="k3", kl_coef=0.01)  # the checkpoint holds the reference too
    train.train(cfg, str(tmp_path), run_eval=True)
    after = json.loads((tmp_path / "eval_after.json").read_text())
    report = evaluate.run(str(tmp_path))
    assert report["step"] == 1
    # The same samples: statuses and generated lengths agree, not only the (here small) pass rates.
    for key in ("tasks", "samples", "pass@1", "pass@k", "reward", "status", "generated_tokens_per_task"):
        assert report["results"]["arith"][key] == after["arith"][key], key


@pytest.mark.parametrize(
    "counts, reward, cause",
    [
        (
            {"dropped_zero_variance_groups": 4},
            0.0,
            "no reward variance: 8 groups had equal rewards (mean "
            "reward 0.000); the policy never solves the tasks",
        ),
        ({"dropped_zero_variance_groups": 4}, 1.0, "(mean reward 1.000); the policy solves every task"),
        (
            {"dropped_zero_variance_groups": 4},
            0.5,
            "(mean reward 0.500); every sample of a prompt gets the same",
        ),
        (
            {"excluded_crash": 5, "excluded_timeout": 1},
            0.0,
            "the environment failed on 12 of 16 samples ({'crash': 10, 'timeout': 2})",
        ),
        ({"dropped_small_groups": 2}, 0.0, "groups left with fewer than 2 scored samples: 4"),
    ],
)
def test_no_update_report_names_the_cause(counts, reward, cause):
    """Two skipped steps, each with these filter counts out of 8 samples: the causes, by hand."""
    from rl import pipeline, run_log

    idle = run_log.NoUpdates(2)
    metrics = {"rollout/samples_in": 8.0, "reward": reward} | {
        f"rollout/{k}": float(v) for k, v in counts.items()
    }
    for _ in range(2):
        assert not idle.stuck
        idle.observe(pipeline.RolloutBatch(None, 0, dict(metrics)))
    assert idle.stuck
    report = idle.report(7)
    assert report.startswith("no update in 2 steps in a row (rl.max_skipped_steps=2") and cause in report, (
        report
    )
    idle.observe(pipeline.RolloutBatch({"tokens_BT": None}, 0, {}))  # an update resets the count
    assert not idle.stuck and idle.steps == 0
