"""python -m rl.train --config=configs/grpo.py:tiny --workdir=runs/tiny

The main job: GRPO post-training over task domains, one step as in ../DESIGN.md ("One GRPO step, as data").

Start: the environment pool starts first (worker processes, before JAX touches a device); the domains pass
the quality gate or are refused; the train state is restored from `<workdir>/checkpoints` when one exists,
else built and warm-started by SFT on reference solutions (`rl.sft`); the held-out evaluation runs once.

Each step: the curriculum splits `rl.prompts_per_step` prompts over the domains; their task streams give
the tasks; the engine samples `rl.group_size` completions each (with log-probs); the pool scores them;
errored episodes and zero-variance groups are filtered out and back-filled; the batch trains one
`rl.train_step` update; the new weights go to the engine (`update_params`, policy version + 1); the
curriculum sees each domain's reward and compute. In async mode (`rl.async_rollout`) a producer thread
samples ahead (`rl.pipeline`), at most `rl.max_staleness` versions behind.

Every `rl.checkpoint_every` steps (and on SIGTERM) an orbax checkpoint stores the train state, the task
streams' iterator states, the curriculum, the policy version and the step; a run killed with `kill -9` and
restarted resumes from the last one (bit-identical in sync mode). Metrics go to `<workdir>/metrics.jsonl`
(and TensorBoard); the run ends with a before/after table of held-out accuracy per domain.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import ml_collections
import numpy as np
from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/grpo.py:tiny", "GRPO config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, eval).")
_SFT_ONLY = flags.DEFINE_boolean("sft_only", False, "Run the SFT warm start, save it, and stop.")
_EVAL = flags.DEFINE_boolean("eval", True, "Evaluate held-out tasks before and after training.")


def pad_batch(batch: dict[str, np.ndarray], rows: int, length: int) -> dict[str, np.ndarray]:
    """Pads (or left-trims, keeping the completion end) every [B, T] array to [rows, length] and [B] to
    [rows], so the train step compiles once. Padding rows have mask 0 and advantage 0."""
    out = {}
    for key, a in batch.items():
        if a.ndim == 1:
            out[key] = np.zeros((rows,), a.dtype)
            out[key][: min(len(a), rows)] = a[:rows]
        elif a.ndim == 2:
            a = a[:rows, -length:] if a.shape[1] > length else a[:rows]
            out[key] = np.zeros((rows, length), a.dtype)
            out[key][: a.shape[0], : a.shape[1]] = a
        else:
            out[key] = a
    if "positions_BT" in out:
        out["positions_BT"] = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy()
    return out


class Run:
    """The parts of one training run, built in start order (see the module docstring)."""

    def __init__(self, cfg, workdir: str):
        import envs
        from rl import curriculum, data

        self.cfg, self.workdir, rl = cfg, workdir, cfg.rl
        # Derived sizes follow the rl fields (command-line overrides change those, not these).
        with cfg.unlocked():
            cfg.batch_size = rl.prompts_per_step * rl.group_size
            cfg.seq_len = rl.max_prompt_len + rl.max_new_tokens
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(cfg.to_json_best_effort(indent=2))
        domains = list(rl.domains)
        if rl.quality_gate:
            from envs import qa

            domains = curriculum.admit_domains(domains, gate=lambda d: qa.run_checks(d, n=rl.quality_gate_n))
        self.domains = domains
        self.pool = envs.EnvPool(rl.env_workers, domains=domains, timeout_s=rl.env_timeout_s)
        self.streams = data.TaskMixer({d: self._stream(d, "train") for d in domains})
        kwargs = {"static_weights": dict(rl.static_weights) or None} if rl.curriculum == "static" else {}
        self.scheduler = curriculum.DomainScheduler(
            domains, mode=rl.curriculum, floor=rl.curriculum_floor, seed=rl.seed, **kwargs
        )
        self.lock = threading.Lock()  # streams and scheduler: producer thread vs trainer thread
        self.skipped_long = 0

    def start_model(self, *, sft_only: bool = False):
        """Train state (restored or fresh + SFT) and the engine over its params."""
        from inference import Engine, EngineConfig
        from model.tokenizer import load_tokenizer
        from rl import checkpoint, metrics, train_step

        cfg, rl = self.cfg, self.cfg.rl
        self.tokenizer = load_tokenizer(rl.tokenizer or None, vocab_size=cfg.model.vocab_size)
        self.model_def, self.state = train_step.init_state(cfg, seed=rl.seed)
        self.logger = metrics.MetricsLogger(
            self.workdir, tensorboard=rl.tensorboard or False, total_steps=rl.steps
        )
        self.ckpt = checkpoint.Checkpointer(
            os.path.join(self.workdir, "checkpoints"),
            save_every=rl.checkpoint_every,
            max_to_keep=rl.max_to_keep,
        )
        restored = self.ckpt.restore(target_state=self.state)
        self.start_step, self.version = 0, 0
        if restored is not None:
            self.state, meta = restored
            self.streams.set_state(meta["streams"])
            self.scheduler.load_state_dict(meta["curriculum"])
            self.start_step, self.version = meta["step"], meta["version"]
        elif rl.sft.steps:
            self._sft()
        if sft_only:
            return
        ecfg = EngineConfig.from_config(dict(rl.engine, max_seq_len=cfg.seq_len))
        self.engine = Engine(cfg, self.state.params, ecfg)
        self.engine.version = self.version
        self.engine.warmup()

    def _sft(self) -> None:
        from rl import sft

        rl = self.cfg.rl
        t0 = time.perf_counter()

        from rl import train_step

        weights = {d: float(w) for d, w in rl.sft.weights.items()} or None

        def next_tasks(n):
            return self.fitting_tasks(n, weights)

        # SFT has its own optimizer settings (rl.sft.optim overrides rl.optim); GRPO then starts from the
        # SFT parameters with a fresh optimizer state.
        sft_cfg = ml_collections.ConfigDict(self.cfg.to_dict())
        sft_cfg.rl.optim.update(dict(rl.sft.optim))
        sft_def, sft_state = train_step.init_state(sft_cfg, seed=rl.seed, params=self.state.params)
        sft_state = sft.run_sft(
            sft_cfg,
            sft_def,
            sft_state,
            next_tasks,
            self.tokenizer,
            steps=rl.sft.steps,
            rows=rl.sft.rows,
            length=self.cfg.seq_len,
            log=self._log_sft,
            chat=rl.chat,
            noise=rl.sft.noise,
            seed=rl.seed,
        )
        self.model_def, self.state = train_step.init_state(self.cfg, seed=rl.seed, params=sft_state.params)
        self.logger.log(0, {"sft/seconds": time.perf_counter() - t0})
        self.save(0, force=True)

    def _stream(self, domain: str, split: str):
        from rl import data

        levels = self.cfg.rl.levels.get(domain)
        return data.DomainTasks(
            domain, seed=self.cfg.rl.seed, split=split, levels=tuple(levels) if levels else None
        )

    def _fits(self, task) -> bool:
        from rl import rollout

        prompt = rollout.format_prompt(task, self.tokenizer, chat=self.cfg.rl.chat)
        return len(prompt) <= self.cfg.rl.max_prompt_len

    def fitting_tasks(self, n: int, weights: dict[str, float] | None = None) -> list:
        """n tasks split over the domains by the curriculum, skipping (and counting) tasks whose prompt is
        longer than rl.max_prompt_len tokens."""
        out = []
        for _ in range(64):
            want = n - len(out)
            allocation = _split(want, weights) if weights else self.scheduler.allocate(want)
            for task in self.streams.next_tasks(allocation):
                if self._fits(task):
                    out.append(task)
                else:
                    self.skipped_long += 1
            if len(out) == n:
                return out
        raise ValueError(
            f"rl.max_prompt_len={self.cfg.rl.max_prompt_len} is shorter than nearly every prompt of "
            f"{self.domains}; raise it (seq_len = max_prompt_len + max_new_tokens follows)."
        )

    def _log_sft(self, i: int, metrics: dict) -> None:
        self.logger.log(i, metrics, progress=False)
        if (i + 1) % 100 == 0 or i + 1 == self.cfg.rl.sft.steps:
            loss = metrics.get("sft/cross_entropy", float("nan"))
            print(
                f"sft {i + 1}/{self.cfg.rl.sft.steps} | cross-entropy {loss:.4f}", file=sys.stderr, flush=True
            )

    def save(self, step: int, *, force: bool = False) -> None:
        if self.ckpt.latest_step() == step:
            return
        with self.lock:
            meta = {
                "step": step,
                "version": self.version,
                "streams": self.streams.get_state(),
                "curriculum": self.scheduler.state_dict(),
            }
        self.ckpt.save(step, self.state, meta, force=force)

    def make_batch(self):
        """Producer: sample, score, filter and assemble one train batch (see the module docstring)."""
        from inference import SamplingParams
        from rl import pipeline, rollout

        cfg, rl = self.cfg, self.cfg.rl
        with self.lock:
            seed = rl.seed * 1_000_003 + self._batches
            self._batches += 1

        def next_tasks(n):
            with self.lock:
                return self.fitting_tasks(n)

        sampling = SamplingParams(
            temperature=rl.temperature,
            top_k=rl.top_k,
            top_p=rl.top_p,
            max_new_tokens=rl.max_new_tokens,
            n=rl.group_size,
            seed=seed,
            stop_tokens=tuple(self.tokenizer.stop_ids),
        )
        samples, counts = rollout.collect(
            self.engine,
            self.pool,
            next_tasks,
            self.tokenizer,
            groups=rl.prompts_per_step,
            n=rl.group_size,
            sampling=sampling,
            max_attempts=rl.max_attempts,
            max_turns=rl.max_turns,
            chat=rl.chat,
            reward_tol=rl.reward_tol,
        )
        if not samples:  # every group filtered out (e.g. all wrong): nothing to learn from this round
            stats, batch = {}, None
        else:
            batch, stats = rollout.make_batch(
                samples, adv_std=rl.advantage_std, length_bucket=rl.length_bucket, max_len=cfg.seq_len
            )
            batch = pad_batch(batch, cfg.batch_size, cfg.seq_len)
        version = min((min(s.policy_versions, default=self.version) for s in samples), default=self.version)
        metrics = {f"rollout/{k}": float(v) for k, v in {**counts, **stats}.items() if _is_number(v)}
        metrics.update(_domain_metrics(samples))
        total = sum(counts.get(f"all_samples/{d}", 0) for d in self.domains)
        if total:
            metrics["reward"] = sum(counts.get(f"all_reward_sum/{d}", 0.0) for d in self.domains) / total
        for d in self.domains:  # the curriculum's view: every sample drawn this step, filtered or not
            n = counts.get(f"all_samples/{d}", 0)
            if n:
                metrics[f"reward/{d}"] = counts[f"all_reward_sum/{d}"] / n
                metrics[f"tokens/{d}"] = float(counts[f"all_tokens/{d}"])
                metrics[f"sandbox_seconds/{d}"] = float(counts[f"all_sandbox_seconds/{d}"])
        metrics["rollout/skipped_long_prompts"] = float(self.skipped_long)
        return pipeline.RolloutBatch(batch, version, metrics)

    def update_curriculum(self, step: int, metrics: dict[str, float]) -> None:
        with self.lock:
            for d in self.domains:
                if f"reward/{d}" in metrics:
                    self.scheduler.update(
                        d,
                        step=step,
                        mean_reward=metrics[f"reward/{d}"],
                        tokens_generated=metrics.get(f"tokens/{d}", 0.0),
                        sandbox_seconds=metrics.get(f"sandbox_seconds/{d}", 0.0),
                    )
            return {f"weight/{d}": w for d, w in self.scheduler.weights().items()}

    def _eval_tasks(self, stream) -> list:
        """The first rl.eval.n_tasks held-out tasks whose prompt fits rl.max_prompt_len (the same tasks
        before and after training)."""
        out = []
        for _ in range(64 * self.cfg.rl.eval.n_tasks):
            task = stream.next_tasks(1)[0]
            if self._fits(task):
                out.append(task)
                if len(out) == self.cfg.rl.eval.n_tasks:
                    break
        return out

    def evaluate(self, tag: str) -> dict[str, Any]:
        from inference import SamplingParams
        from rl import evaluate

        rl = self.cfg.rl
        tasks = {d: self._eval_tasks(self._stream(d, "eval")) for d in self.domains}
        sampling = SamplingParams(
            temperature=rl.temperature,
            top_k=rl.top_k,
            top_p=rl.top_p,
            max_new_tokens=rl.max_new_tokens,
            stop_tokens=tuple(self.tokenizer.stop_ids),
            seed=12345,
        )
        results = evaluate.evaluate(
            self.engine,
            self.pool,
            self.tokenizer,
            tasks,
            k=rl.eval.k,
            sampling=sampling,
            max_turns=rl.max_turns,
            chat=rl.chat,
        )
        with open(os.path.join(self.workdir, f"eval_{tag}.json"), "w") as f:
            json.dump(results, f, indent=2, default=float)
        self.logger.log(self.start_step if tag == "before" else self.cfg.rl.steps, evaluate.flatten(results))
        return results

    def close(self) -> None:
        for name in ("ckpt", "logger"):
            part = getattr(self, name, None)
            if part is not None:
                part.close()
        self.pool.close()


def _split(n: int, weights: dict[str, float]) -> dict[str, int]:
    """n split by weights, largest remainders first (sums to n)."""
    total = sum(weights.values())
    exact = {d: n * w / total for d, w in weights.items()}
    out = {d: int(x) for d, x in exact.items()}
    for d in sorted(exact, key=lambda d: exact[d] - out[d], reverse=True)[: n - sum(out.values())]:
        out[d] += 1
    return out


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def _domain_metrics(samples) -> dict[str, float]:
    """Over the kept (trained) samples: kept_reward, kept_ok/<domain>; the per-domain reward and compute
    the curriculum reads come from every sample drawn (see make_batch)."""
    metrics = {"kept_reward": float(np.mean([s.reward for s in samples]))} if samples else {}
    for d in sorted({s.task.domain for s in samples}):
        metrics[f"kept_ok/{d}"] = float(np.mean([s.status == "ok" for s in samples if s.task.domain == d]))
    return metrics


def format_comparison(before: dict[str, Any], after: dict[str, Any]) -> str:
    """Held-out accuracy per domain before and after training, as a text table."""
    rows = [("domain", "pass@1 before", "pass@1 after", "pass@k before", "pass@k after")]
    for d in sorted(after):
        b, a = before.get(d, {}), after[d]
        rows.append(
            (
                d,
                f"{b.get('pass@1', float('nan')):.3f}",
                f"{a['pass@1']:.3f}",
                f"{b.get('pass@k', float('nan')):.3f}",
                f"{a['pass@k']:.3f}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def train(cfg, workdir: str, *, sft_only: bool = False, run_eval: bool = True) -> dict[str, Any]:
    """Runs (or resumes) the job; returns {"before": eval, "after": eval, "steps": n}."""
    from rl import checkpoint, pipeline, train_step

    rl = cfg.rl
    run = Run(cfg, workdir)
    handle = checkpoint.install_preemption_handler()
    try:
        run._batches = 0
        run.start_model(sft_only=sft_only)
        run._batches = run.start_step
        if sft_only:
            return {"steps": 0}
        before = run.evaluate("before") if run_eval and run.start_step == 0 else None
        step_fn = train_step.make_train_step(cfg, run.model_def)
        pipe = pipeline.Pipeline(
            run.make_batch,
            asynchronous=rl.async_rollout,
            max_staleness=rl.max_staleness,
            max_queue=rl.max_queue,
        )
        step = run.start_step
        try:
            while step < rl.steps:
                if handle.requested:
                    run.save(step, force=True)
                    run.ckpt.wait()
                    return {"steps": step, "preempted": True}
                item, pmetrics = pipe.get(run.engine.version)
                t0 = time.perf_counter()
                if item.batch is None:  # no group with a reward signal: the step makes no update
                    metrics = {"train/skipped": 1.0}
                else:
                    run.state, metrics = step_fn(run.state, item.batch)
                    metrics = {f"train/{k}": float(v) for k, v in metrics.items()}
                    run.version = run.engine.update_params(run.state.params)
                metrics["pipeline/train_s"] = time.perf_counter() - t0
                step += 1
                metrics.update(item.metrics, **pmetrics, **run.update_curriculum(step, item.metrics))
                if step % rl.log_every == 0 or step == rl.steps:
                    run.logger.log(step, metrics)
                if run.ckpt.should_save(step):
                    run.save(step)
        finally:
            pipe.close()
        run.save(step, force=True)
        run.ckpt.wait()
        after = run.evaluate("after") if run_eval else None
        if before is not None and after is not None:
            print(format_comparison(before, after), flush=True)
        return {"before": before, "after": after, "steps": step, "engine": run.engine.stats()}
    finally:
        handle.close()
        run.close()


def main(argv: Sequence[str]) -> int:
    del argv
    if not _WORKDIR.value:
        raise app.UsageError("--workdir is required (checkpoints, metrics and eval results go there).")
    train(_CONFIG.value, _WORKDIR.value, sft_only=_SFT_ONLY.value, run_eval=_EVAL.value)
    return 0


if __name__ == "__main__":
    sys.exit(app.run(main))
