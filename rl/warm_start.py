"""Supervised warm start on reference solutions: each example is the task's prompt (as the sampler sees it,
`rl.rollout.format_prompt`) followed by `Environment.reference_solution(task)` and the end-of-sequence
token; the loss is the cross-entropy of the solution tokens only (`rl.train_step.make_sft_step`, the same
state and optimizer as GRPO), plus rl.sft.mtp_weight times the multi-token-prediction modules' loss on the
same tokens. Multi-turn domains are trained on their action lines as one completion.

`warm_start` is the main job's SFT phase (rl.sft.*), the draft model trained on the same batches;
`python -m rl.sft` runs it alone.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping

import ml_collections
import numpy as np

from envs import Task, registry
from rl import distributed, rollout, train_state, train_step
from rl.batch import sft_batch


def corrupt(text: str, rng: np.random.Generator) -> str:
    """`text` with one digit replaced by another (a noisy teacher's miss); a text without digits has one
    lowercase letter replaced instead. Digits first: in "\\boxed{55}" a miss is a wrong answer, not a
    misspelt format (the answers of `arith` are all digits, those of `strings` all letters)."""
    spots = [i for i, c in enumerate(text) if c.isdigit()]
    spots = spots or [i for i, c in enumerate(text) if "a" <= c <= "z"]
    if not spots:
        return text
    i = spots[rng.integers(len(spots))]
    pool = "0123456789" if text[i].isdigit() else "abcdefghijklmnopqrstuvwxyz"
    return text[:i] + rng.choice([c for c in pool if c != text[i]]) + text[i + 1 :]


def sft_example(
    task: Task, env, tokenizer, *, chat: bool, noise: float = 0.0, rng: np.random.Generator | None = None
) -> tuple[list[int], list[int]]:
    """(tokens, mask): prompt + reference solution + eos; mask 1 on the solution and eos tokens. With
    `noise` > 0 that fraction of solutions has one character wrong (`corrupt`): a noisy teacher."""
    prompt = rollout.format_prompt(task, tokenizer, chat=chat)
    text = env.reference_solution(task)
    if noise and rng.random() < noise:
        text = corrupt(text, rng)
    solution = tokenizer.encode(text) + [tokenizer.eos_id]
    return prompt + solution, [0] * len(prompt) + [1] * len(solution)


def run_sft(
    cfg,
    model_def,
    state,
    next_tasks: Callable[[int], list[Task]],
    tokenizer,
    *,
    steps: int,
    rows: int,
    length: int,
    log: Callable[[int, dict], None] | None = None,
    chat: bool = False,
    noise: float = 0.0,
    seed: int = 0,
    start: int = 0,
    should_stop: Callable[[], bool] | None = None,
    env_kwargs: Mapping[str, Mapping] | None = None,
    mtp_weight: float = 0.0,
    mesh=None,
):
    """SFT updates `start`..`steps - 1` on fresh tasks each step; returns (state, steps done). Stops early
    when `should_stop()` turns true (a preemption: the caller saves and resumes from the count). Step i's
    noise draws come from (seed, i), so a resumed run makes the same examples. `mtp_weight` > 0 adds the
    MTP modules' loss (rl.sft.mtp_weight; metric `sft/mtp_loss`)."""
    step_fn = train_step.make_sft_step(cfg, model_def, mtp_weight=mtp_weight, mesh=mesh)
    envs_by_domain: dict[str, object] = {}
    env_kwargs = env_kwargs or {}
    for i in range(start, steps):
        if should_stop is not None and should_stop():
            return state, i
        rng = np.random.default_rng([seed, i])
        tasks = next_tasks(rows)
        examples = []
        for task in tasks:
            if task.domain not in envs_by_domain:
                envs_by_domain[task.domain] = registry.make(task.domain, **env_kwargs.get(task.domain, {}))
            env = envs_by_domain[task.domain]
            examples.append(sft_example(task, env, tokenizer, chat=chat, noise=noise, rng=rng))
        t0 = time.perf_counter()
        state, metrics = step_fn(state, sft_batch(examples, rows, length))
        if log is not None:
            metrics = {f"sft/{k}": float(v) for k, v in metrics.items()}
            metrics["sft/step_s"] = time.perf_counter() - t0
            log(i, metrics)
    return state, steps


def warm_start(cfg, state, draft, source, tokenizer, logger, handle, *, start, resumed, env_kwargs, mesh):
    """The warm start: rl.sft.steps supervised steps from `start` (the policy, and the draft model on the
    same batches). Returns (state, draft_state, steps done); fewer than rl.sft.steps when preempted."""
    rl = cfg.rl
    draft_cfg, draft_def, draft_state = draft
    sft_cfg = ml_collections.ConfigDict(cfg.to_dict())
    sft_cfg.rl.optim.update(dict(rl.sft.optim))
    if not resumed:  # a fresh state: SFT has its own optimizer settings (the selection biases stay)
        _, state = train_state.sft_state(
            cfg, rl.seed, params=state.params, model_state=state.model_state, mesh=mesh
        )
    sft_def, _ = train_state.sft_state(cfg, rl.seed, params=state.params, mesh=mesh)
    weights = {d: float(w) for d, w in rl.sft.weights.items()} or None
    t0 = time.perf_counter()

    def log(i: int, m: dict) -> None:
        logger.log(i, m, progress=False)
        if distributed.is_primary() and ((i + 1) % 100 == 0 or i + 1 == rl.sft.steps):
            ce = m.get("sft/cross_entropy", float("nan"))
            print(f"sft {i + 1}/{rl.sft.steps} | cross-entropy {ce:.4f}", file=sys.stderr, flush=True)

    common = dict(
        steps=rl.sft.steps,
        rows=rl.sft.rows,
        length=cfg.seq_len,
        chat=rl.chat,
        noise=rl.sft.noise,
        seed=rl.seed,
        start=start,
        should_stop=lambda: distributed.any_process(handle.requested),
        env_kwargs=env_kwargs,
        mesh=mesh,
    )
    batches = []  # the draft model learns from the same tasks: record them for it
    next_tasks = lambda n: _recorded(batches, source.next_tasks(n, weights))
    state, done = run_sft(
        sft_cfg, sft_def, state, next_tasks, tokenizer, log=log, mtp_weight=rl.sft.mtp_weight, **common
    )
    if draft_state is not None:
        replay = iter(batches)
        draft_sft = ml_collections.ConfigDict(draft_cfg.to_dict())
        draft_sft.rl.optim.update(dict(rl.sft.optim))
        draft_state, _ = run_sft(
            draft_sft,
            draft_def,
            draft_state,
            lambda n: next(replay),
            tokenizer,
            **{**common, "steps": done, "should_stop": None},
        )
    logger.log(0, {"sft/seconds": time.perf_counter() - t0}, progress=False)
    return state, draft_state, done


def _recorded(batches: list, tasks: list) -> list:
    batches.append(tasks)
    return tasks
