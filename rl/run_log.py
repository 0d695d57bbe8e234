"""What the main job writes beside its checkpoints and tells its user, apart from the metrics (`rl.metrics`):
`config.json` (written atomically, for a new or compatible run only), `samples.jsonl` (the episodes of a step,
kept and dropped), the console's phase lines, what a restart resumed, where a signal saved the run, and the
report of a run that stopped learning (`NoUpdates`: steps in a row without an update, and why)."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from typing import Any

import numpy as np

from configs.errors import UserError


class NoLearningSignal(UserError):
    """rl.max_skipped_steps steps in a row updated nothing; the message gives the cause and the counts."""


def say(message: str) -> None:
    """A phase line on the console (process 0): what the run does now, while it compiles and warms up."""
    print(f"rl.train: {message}", file=sys.stderr, flush=True)
    logging.getLogger("rl.train").info(message)


def write_config(workdir: str, cfg) -> None:
    """`<workdir>/config.json`, atomically (a reader never sees half of it), for a new or compatible run."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "config.json")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(cfg.to_json_best_effort(indent=2))
    os.replace(tmp, path)


def resume_note(meta: dict, rl) -> str:
    """What a restart resumes, from its checkpoint's meta."""
    sft_done = meta.get("sft_step", rl.sft.steps)
    if sft_done < rl.sft.steps:
        return f"resumed the SFT warm start at step {sft_done} of {rl.sft.steps}"
    return f"resumed from checkpoint {meta['step']} (GRPO step {meta['step']} of {rl.steps})"


def stopped(say, workdir: str, handle, where: str, **result) -> dict[str, Any]:
    """The result of a run stopped by SIGINT / SIGTERM after saving `where`; says how to go on."""
    name = signal.Signals(handle.signum).name if handle.signum else "a signal on another process"
    say(
        f"stopped by {name}: saved {where} in {os.path.join(workdir, 'checkpoints')}; the same command "
        "resumes"
    )
    return {**result, "preempted": True, "signal": handle.signum}


def results_note(workdir: str, step: int, run_eval: bool) -> str:
    files = ["metrics.jsonl", "samples.jsonl", "checkpoints/"] + (["eval_after.json"] if run_eval else [])
    return (
        f"done at step {step}: results in {workdir} ({', '.join(files)}); "
        f"python -m rl.evaluate --workdir={workdir} scores it again, python -m rl.export exports it"
    )


class NoUpdates:
    """Counts the steps in a row that updated nothing (every group filtered out) and why: reward without
    variance, samples the environment failed on (env_error / crash / timeout), groups left too small."""

    def __init__(self, limit: int):
        self.limit, self.steps, self.counts = limit, 0, {}
        self.rewards: list[float] = []

    def observe(self, item) -> None:
        if item.batch is not None:
            self.steps, self.counts, self.rewards = 0, {}, []
            return
        self.steps += 1
        for key, value in item.metrics.items():
            if key.startswith(("rollout/excluded_", "rollout/dropped_")) or key == "rollout/samples_in":
                self.counts[key] = self.counts.get(key, 0.0) + value
        if "reward" in item.metrics:
            self.rewards.append(item.metrics["reward"])

    @property
    def stuck(self) -> bool:
        return self.limit > 0 and self.steps >= self.limit

    def report(self, step: int) -> str:
        c = lambda key: int(self.counts.get(f"rollout/{key}", 0))  # noqa: E731
        samples = c("samples_in")
        excluded = {k[len("rollout/excluded_") :]: int(v) for k, v in self.counts.items() if "excluded_" in k}
        failed = sum(excluded.values())
        reward = float(np.mean(self.rewards)) if self.rewards else float("nan")
        if failed and failed >= samples / 2:
            cause = (
                f"the environment failed on {failed} of {samples} samples ({excluded}); see "
                "samples.jsonl and log.txt, and python -m envs.qa --domain=<domain>"
            )
        elif c("dropped_zero_variance_groups"):
            if reward <= 0:
                fix = (
                    "the policy never solves the tasks: warm-start it (rl.sft.steps), pick easier rl.levels "
                    "or raise rl.max_new_tokens"
                )
            elif reward >= 1:
                fix = "the policy solves every task: pick harder rl.levels or other rl.domains"
            else:
                fix = "every sample of a prompt gets the same reward: raise rl.temperature or rl.group_size"
            cause = (
                f"no reward variance: {c('dropped_zero_variance_groups')} groups had equal rewards "
                f"(mean reward {reward:.3f}); {fix}"
            )
        else:
            cause = f"groups left with fewer than 2 scored samples: {c('dropped_small_groups')}"
        return (
            f"no update in {self.steps} steps in a row (rl.max_skipped_steps={self.limit}; 0 never stops): "
            f"{cause}. Checkpoint {step} is saved; samples of the dropped groups are in samples.jsonl"
        )


def log_samples(workdir: str, step: int, samples, *, kept: bool) -> None:
    """Episodes of a step into samples.jsonl; `kept`: whether the filters kept them for the update."""
    if not samples:
        return
    with open(os.path.join(workdir, "samples.jsonl"), "a") as f:
        for s in samples:
            record = {
                "step": step,
                "kept": kept,
                "domain": s.task.domain,
                "task_id": s.task.id,
                "group": s.group,
                "advantage": s.advantage,
                "prompt": s.task.prompt,
                "text": s.text,
                "reward": s.reward,
                "status": s.status,
                "metadata": s.task.metadata,
            }
            f.write(json.dumps(record, default=str) + "\n")
