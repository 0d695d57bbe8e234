"""python -m benchmarks grpo_job

The GRPO main job's throughput, one JSON line with one entry per section (`--sections`):

async_vs_sync   GRPO steps/s of `rl.train.train` on `configs/grpo.py:test` (tiny model, `debug` domain, SFT
                warm start so groups carry reward variance) in sync mode and in async mode
                (`rl.async_rollout`, max_staleness 2, max_queue 2), on the same task stream. Verifiers are
                slow and long-tailed: every task carries a delay (`envs/domains/debug.py`: lognormal, median
                `--delay_median_ms`, p99 20 x median) that `score` sleeps before scoring, on `--env_workers`
                worker processes. The batch geometry is the `tiny` variant's (4 prompts x 8 samples, 160 + 32
                tokens) rather than the test variant's 8 x 32 tokens, whose 13 ms train step leaves nothing
                to overlap. The warm start is short (the policy answers right about half the time) and the
                learning rate 0 after it, so both modes sample one fixed policy and do the same work per step
                (about one rollout round; a converging policy needs ever more back-fill rounds). Rates are
                read from metrics.jsonl: steps over the time between the record of step `max_queue + 1` and
                the last one, so startup, compiles and the async producer's head start (the queue it filled
                while step 1 compiled) stay out. Also: the fraction of that time the trainer waits for
                batches (async: `pipeline/queue_wait_s`; sync: producing them, `pipeline/generation_s`),
                mean staleness, dropped batches, mean generation (engine + scoring), environment and train
                seconds per step, and `ideal_ratio` = (G + T) / max(G, T) from the sync run's means, the
                most any overlap of generation G with training T can give.
train_step_mfu  MFU of the GRPO train step (`rl.train_step.make_train_step`) on `configs/grpo.py:small`, with
                a synthetic batch (mask on the second half of each row, random advantages, behaviour log-probs
                0): median of `--mfu_steps` timed steps after the compiling and one warm step, FLOPs from
                `model.plan.flops_per_token(cfg, seq_len, training=True)`, peak from `matmul_peak.measure()`
                in this process. The config's 128 x 512 batch takes minutes a step on a 2-core CPU, so
                `--mfu_batch` (default 8: the batch of benchmarks/train_step.py's small rows) replaces it.
peer            The Tunix peer's GRPO step: `--peer_script=PATH` (its tunix_grpo_step_bench.py, not part of
                this repository: required with this section, no default), run by this interpreter, only when
                `tunix` imports; else why not.
ppo             `train/clip_fraction` (low / high), ratio max and approx KL to the proximal policy of the
                main job on `configs/grpo.py:test` with `rl.ppo_epochs=2` (`--ppo_steps` steps).
drafters        Rollout tokens per target forward and acceptance of each drafter (`rl.engine.draft`: none,
                ngram, group, model) in the main job on `configs/grpo.py:demo`, each after the same shortened
                warm start (`--draft_sft_steps`), over `--draft_steps` GRPO steps (means of the step records).

Routing replay's train-inference mismatch is measured paired, on the same batches with and without the
recorded experts, by benchmarks/routing_replay.py.

The machine may be shared: compare the two modes (and MFU with its own peak) within one run.

    python -m benchmarks grpo_job --sections=async --steps=12
    python -m benchmarks grpo_job --quick
    python -m benchmarks grpo_job --sections=ppo,drafters
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(ROOT, ".jax_cache"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import matmul_peak  # noqa: E402
from benchmarks.common import chosen_sections  # noqa: E402
from benchmarks.record import emit  # noqa: E402
from configs import grpo  # noqa: E402
from envs.domains import debug  # noqa: E402
from model import plan  # noqa: E402

SECTIONS = ("async", "mfu", "peer", "ppo", "drafters")
ASYNC_TARGET = 1.5
SFT_STEPS = 4


# --- async vs sync ------------------------------------------------------------------------------------------


def pipeline_config(steps: int, env_workers: int, asynchronous: bool):
    cfg = grpo.get_config("test")
    rl = cfg.rl
    rl.steps = steps
    rl.checkpoint_every = steps + 1  # only the final save, after the timed window
    rl.prompts_per_step, rl.group_size = 4, 8
    rl.max_prompt_len, rl.max_new_tokens = 160, 32
    rl.env_workers = env_workers
    # A constant workload: a short warm start leaves the policy right about half the time, and the learning
    # rate is 0 from then on (cosine to 0 at the end of SFT), so every step of both modes samples the same
    # policy, groups keep their reward variance (about one rollout round per step, not max_attempts of
    # back-fill as the policy converges) and the train step does the same work as at any learning rate.
    rl.sft.steps = SFT_STEPS
    rl.optim.total_steps, rl.optim.min_lr_ratio = SFT_STEPS, 0.0
    rl.async_rollout = asynchronous
    if asynchronous:
        rl.max_staleness, rl.max_queue = 2, 2
    return cfg


def run_mode(steps: int, env_workers: int, asynchronous: bool) -> dict:
    """One `rl.train.train` run; the step records of its metrics.jsonl, summarised over the timed window."""
    from rl import train

    cfg = pipeline_config(steps, env_workers, asynchronous)
    with tempfile.TemporaryDirectory(prefix="bench_rl_") as workdir:
        t0 = time.perf_counter()
        out = train.train(cfg, workdir, run_eval=False)
        total_s = time.perf_counter() - t0
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            records = [r for r in map(json.loads, f) if "pipeline/train_s" in r]
    first = cfg.rl.max_queue + 1  # the window starts at this step's record (see the module docstring)
    records.sort(key=lambda r: r["step"])
    start = next(r for r in records if r["step"] == first)
    window = [r for r in records if r["step"] > first]
    wall = window[-1]["time"] - start["time"]
    mean = lambda key: statistics.fmean(r.get(key) or 0.0 for r in window)
    total = lambda key: sum(r.get(key) or 0.0 for r in window)
    waited = total("pipeline/generation_s" if not asynchronous else "pipeline/queue_wait_s")
    return {
        "steps_per_s": round(len(window) / wall, 4),
        "timed_steps": len(window),
        "timed_s": round(wall, 2),
        "total_s": round(total_s, 1),
        "batch_wait_fraction": round(waited / wall, 4),
        "queue_wait_fraction": round(total("pipeline/queue_wait_s") / wall, 4),
        "generation_s_mean": round(mean("pipeline/generation_s"), 4),
        "env_s_mean": round(mean("rollout/sandbox_seconds/debug"), 4),
        "train_s_mean": round(mean("pipeline/train_s"), 4),
        "rounds_mean": round(mean("rollout/rounds"), 2),
        "staleness_mean": round(mean("pipeline/staleness"), 3),
        "staleness_max": max(r["pipeline/staleness"] for r in window),
        "dropped_stale_batches": int(records[-1]["pipeline/dropped_stale_batches"]),
        "reward_mean": round(mean("reward"), 3),
        "compiles_after_warmup": out["engine"]["compiles_after_warmup"],
    }


def async_vs_sync(steps: int, delay_median_ms: float, env_workers: int) -> dict:
    previous = os.environ.get(debug.DELAY_ENV_VAR)
    os.environ[debug.DELAY_ENV_VAR] = str(delay_median_ms / 1000)  # read by the trainer's DebugEnvironment
    try:
        sync = run_mode(steps, env_workers, asynchronous=False)
        asyn = run_mode(steps, env_workers, asynchronous=True)
    finally:
        if previous is None:
            del os.environ[debug.DELAY_ENV_VAR]
        else:
            os.environ[debug.DELAY_ENV_VAR] = previous
    g, t = sync["generation_s_mean"], sync["train_s_mean"]
    ratio = asyn["steps_per_s"] / sync["steps_per_s"]
    return {
        "config": "configs/grpo.py:test (batch 4 x 8, 160 + 32 tokens)",
        "steps": steps,
        "delay_median_s": delay_median_ms / 1000,
        "delay_p99_s": round(20 * delay_median_ms / 1000, 3),
        "env_workers": env_workers,
        "sync": sync,
        "async": asyn,
        "ratio": round(ratio, 3),
        "ideal_ratio": round((g + t) / max(g, t), 3),
        "target": ASYNC_TARGET,
        "met": ratio >= ASYNC_TARGET,
    }


# --- train-step MFU -----------------------------------------------------------------------------------------


def synthetic_batch(cfg, seed: int = 0) -> dict[str, np.ndarray]:
    """A GRPO batch of the config's shape: random tokens, mask on the second half, random advantages."""
    rng = np.random.default_rng(seed)
    b, t = cfg.batch_size, cfg.seq_len
    mask_BT = np.zeros((b, t), np.float32)
    mask_BT[:, t // 2 :] = 1.0
    return {
        "tokens_BT": rng.integers(0, cfg.model.vocab_size, (b, t), dtype=np.int32),
        "positions_BT": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
        "mask_BT": mask_BT,
        "advantages_B": rng.standard_normal(b).astype(np.float32),
        "behaviour_logp_BT": np.zeros((b, t), np.float32),
    }


def train_step_mfu(batch: int, seq_len: int | None, steps: int) -> dict:
    from rl import train_state, train_step

    cfg = grpo.get_config("small")
    full = (cfg.batch_size, cfg.seq_len)
    cfg.batch_size, cfg.seq_len = batch, seq_len or cfg.seq_len
    peak = matmul_peak.measure()["peak_flops"]
    model_def, state = train_state.init_state(cfg, seed=0)
    step_fn = train_step.make_train_step(cfg, model_def)
    arrays = {k: jnp.asarray(v) for k, v in synthetic_batch(cfg).items()}
    times = []
    for _ in range(steps + 2):  # the first compiles, the second warms up
        t0 = time.perf_counter()
        state, metrics = step_fn(state, arrays)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    peak = max(peak, matmul_peak.measure()["peak_flops"])  # best figure: a slow moment never inflates MFU
    step_s = statistics.median(times[2:])
    tokens = cfg.batch_size * cfg.seq_len
    flops = plan.flops_per_token(cfg, cfg.seq_len, training=True) * tokens / step_s
    return {
        "config": "configs/grpo.py:small",
        "config_batch": list(full),
        "batch": cfg.batch_size,
        "seq_len": cfg.seq_len,
        "step_s": round(step_s, 3),
        "step_s_min": round(min(times[2:]), 3),
        "compile_s": round(times[0], 1),
        "tokens_per_s": round(tokens / step_s, 1),
        "achieved_gflops": round(flops / 1e9, 1),
        "peak_gflops": round(peak / 1e9, 1),
        "mfu": round(flops / peak, 4),
        "steps": steps,
        "loss": round(float(metrics["loss"]), 4),
    }


# --- options of the main job: PPO epochs, drafters ---------------------------------------------------------


def _main_job(cfg) -> tuple[dict, list[dict]]:
    """`rl.train.train(cfg)` in a temporary workdir: (its result, its GRPO step records)."""
    from rl import train

    with tempfile.TemporaryDirectory(prefix="bench_rl_") as workdir:
        out = train.train(cfg, workdir, run_eval=False)
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            steps = [r for r in map(json.loads, f) if "pipeline/train_s" in r]
    return out, steps


def _mean(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return round(statistics.fmean(values), 6) if values else None


def ppo(steps: int) -> dict:
    cfg = grpo.get_config("test")
    cfg.rl.steps, cfg.rl.checkpoint_every, cfg.rl.ppo_epochs = steps, steps + 1, 2
    _, records = _main_job(cfg)
    keys = ("clip_fraction", "clip_fraction_low", "clip_fraction_high", "approx_kl", "ratio_mean")
    out = {"config": "configs/grpo.py:test, rl.ppo_epochs=2", "steps": steps}
    out.update({k: _mean(records, f"train/{k}") for k in keys})
    out["ratio_max"] = max(r["train/ratio_max"] for r in records if "train/ratio_max" in r)
    return out


def drafters(steps: int, sft_steps: int) -> dict:
    out: dict = {"config": "configs/grpo.py:demo", "steps": steps, "sft_steps": sft_steps}
    for draft in ("none", "ngram", "group", "model"):
        cfg = grpo.get_config("demo")
        cfg.rl.steps, cfg.rl.checkpoint_every = steps, steps + 1
        cfg.rl.sft.steps = sft_steps
        cfg.rl.sft.optim.total_steps = sft_steps
        cfg.rl.engine.draft = draft
        result, records = _main_job(cfg)
        out[draft] = {
            "tokens_per_target_forward": _mean(records, "engine/tokens_per_target_forward"),
            "acceptance_rate": _mean(records, "engine/acceptance_rate"),
            "generation_s_mean": _mean(records[1:], "pipeline/generation_s"),
            "reward_mean": _mean(records, "reward"),
            "compiles_after_warmup": result["engine"]["compiles_after_warmup"],
        }
    return out


# --- peer ---------------------------------------------------------------------------------------------------


def peer(quick: bool, script: str) -> dict:
    if importlib.util.find_spec("tunix") is None:
        return {"skipped": "tunix is not installed in this interpreter (see the peer's docstring for setup)"}
    command = [sys.executable, script, "--arch", "qwen3moe"] + (["--steps", "3"] if quick else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"failed": done.returncode, "stderr_tail": done.stderr[-2000:]}
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    p.add_argument("--sections", default="async,mfu", help=f"comma-separated subset of {SECTIONS}")
    p.add_argument("--peer_script", default="", help="PATH of the Tunix peer's tunix_grpo_step_bench.py")
    p.add_argument("--steps", type=int, default=16, help="GRPO steps per mode (async_vs_sync)")
    p.add_argument("--delay_median_ms", type=float, default=50.0, help="median verifier delay")
    p.add_argument("--env_workers", type=int, default=4, help="environment worker processes")
    p.add_argument("--mfu_batch", type=int, default=8, help="rows of the train_step_mfu batch")
    p.add_argument("--mfu_seq_len", type=int, default=None, help="override the small config's seq_len")
    p.add_argument("--mfu_steps", type=int, default=3, help="timed train steps (median reported)")
    p.add_argument("--ppo_steps", type=int, default=6, help="GRPO steps (ppo)")
    p.add_argument("--draft_steps", type=int, default=6, help="GRPO steps per drafter (drafters)")
    p.add_argument("--draft_sft_steps", type=int, default=400, help="warm-start steps per drafter run")
    p.add_argument("--quick", action="store_true", help="smoke run: 6 steps, MFU on 2 x 128")
    a = p.parse_args()
    chosen = chosen_sections(p, a.sections, SECTIONS)
    if "peer" in chosen and not a.peer_script:
        p.error(
            "--sections=peer needs --peer_script=PATH (tunix_grpo_step_bench.py, outside this repository)"
        )
    if a.peer_script and not os.path.isfile(a.peer_script):
        p.error(f"--peer_script={a.peer_script}: no such file")
    if a.quick:
        a.steps, a.mfu_batch, a.mfu_seq_len, a.mfu_steps = 6, 2, 128, 2
    if a.steps < 6:
        p.error("--steps must be >= 6: the timed window starts after step max_queue + 1 = 3")
    t0 = time.perf_counter()
    line: dict = {"bench": "rl", "backend": jax.default_backend(), "load_avg_1m": os.getloadavg()[0]}
    if "async" in chosen:
        line["async_vs_sync"] = async_vs_sync(a.steps, a.delay_median_ms, a.env_workers)
    if "mfu" in chosen:
        line["train_step_mfu"] = train_step_mfu(a.mfu_batch, a.mfu_seq_len, a.mfu_steps)
    if "peer" in chosen:
        line["peer"] = peer(a.quick, a.peer_script)
    if "ppo" in chosen:
        line["ppo"] = ppo(a.ppo_steps)
    if "drafters" in chosen:
        line["drafters"] = drafters(a.draft_steps, a.draft_sft_steps)
    line["load_avg_1m_end"] = os.getloadavg()[0]
    line["wall_s"] = round(time.perf_counter() - t0, 1)
    emit(line)


if __name__ == "__main__":
    main()
