"""python -m rl.evaluate --workdir=runs/tiny --domains=math,code --n_tasks=50 --k=4

Held-out evaluation of a policy: k samples per task, scored in the environment pool, summarised per domain.

`evaluate` rolls out each domain's tasks with `rl.rollout.rollout` (n = k samples per task; multi-turn
domains run up to `max_turns` model turns) and reports, per domain:

    pass@1                       mean success over all samples (success: status "ok")
    pass@k                       the unbiased estimator 1 - C(n-c, k) / C(n, k) (n samples, c successes),
                                 averaged over tasks; with n = k: the fraction of tasks solved at least once
    reward                       mean reward over all samples
    status                       counts of every `envs.STATUSES` value (they sum to tasks * k); the
                                 environment's failures (timeout, crash, env_error) count as no success
                                 for pass@k and are visible here, never hidden in a reward of 0
    generated_tokens_per_task    model tokens sampled per task (all k samples, every turn)
    sandbox_seconds_per_task     environment time per task (`Sample.sandbox_seconds`)
    seconds_per_task             wall time per task (sampling and scoring)
    prefix_cache_hit_rate        engine prefix-cache hits over lookups, counted during this domain's rollout

The CLI reads the run's config (`<workdir>/config.json`, written by `rl.train`) and its latest checkpoint
(or `--step`), scores the run's held-out tasks (`rl.data.heldout_tasks`: the very tasks of the trainer's
`eval_before.json` / `eval_after.json`, with the run's rl.levels, rl.env options and prompt-length filter),
prints `format_table` and writes `<workdir>/eval.json`. With no flag overridden it samples like the
trainer's evaluation (seed `EVAL_SEED`, rl.eval.k, rl.temperature, rl.top_k, rl.top_p, rl.max_new_tokens),
so its numbers are those of the run's `eval_after.json` for the final checkpoint (rl.engine.draft="none":
a speculative drafter keeps the distribution, not the draws). `--domains` / `--n_tasks` change the
selection as they would have changed the trainer's.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from absl import flags

from configs import cli
from configs.errors import UserError
from configs.runs import read_config
from envs import STATUSES, Score, Task
from envs.pool import EnvPool
from inference import Engine
from model.io.tokenizer import load_tokenizer
from rl import data, distributed, rollout, sampler, train_state, validate
from rl import run as run_dir

EVAL_FILE = "eval.json"
EVAL_SEED = 12345  # the sampling seed of the held-out evaluation, here and in rl.train


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c successes: 1 - C(n-c, k) / C(n, k) (Chen et al., 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What the summary needs of one sample."""

    task_id: str
    domain: str
    reward: float
    status: str
    generated_tokens: int = 0
    sandbox_seconds: float = 0.0

    @classmethod
    def from_score(cls, task: Task, score: Score, **kwargs: Any) -> Outcome:
        return cls(task.id, task.domain, float(score.reward), score.status, **kwargs)

    @classmethod
    def from_sample(cls, sample: Any) -> Outcome:
        """From an `rl.rollout.Sample`."""
        return cls(
            sample.task.id,
            sample.task.domain,
            float(sample.reward),
            sample.status,
            int(sample.num_generated),
            float(sample.sandbox_seconds),
        )


def aggregate(outcomes: Iterable[Outcome], *, k: int) -> dict[str, dict[str, Any]]:
    """Per-domain summary of `outcomes` (see the module docstring); every task needs >= k samples."""
    by_task: dict[str, dict[str, list[Outcome]]] = defaultdict(lambda: defaultdict(list))
    for o in outcomes:
        if o.status not in STATUSES:
            raise ValueError(f"task {o.task_id}: status {o.status!r} is not one of {STATUSES}")
        by_task[o.domain][o.task_id].append(o)
    results = {}
    for domain, tasks in by_task.items():
        samples = [o for group in tasks.values() for o in group]
        status = dict.fromkeys(STATUSES, 0)
        for o in samples:
            status[o.status] += 1
        per_task = [pass_at_k(len(g), sum(o.status == "ok" for o in g), k) for g in tasks.values()]
        results[domain] = {
            "tasks": len(tasks),
            "samples": len(samples),
            "k": k,
            "pass@1": status["ok"] / len(samples),
            "pass@k": sum(per_task) / len(per_task),
            "reward": sum(o.reward for o in samples) / len(samples),
            "status": status,
            "generated_tokens_per_task": sum(o.generated_tokens for o in samples) / len(tasks),
            "sandbox_seconds_per_task": sum(o.sandbox_seconds for o in samples) / len(tasks),
        }
    return results


def _prefix_counts(engine: Any) -> tuple[float, float] | None:
    """(hit tokens, looked-up tokens) of the engine's prefix cache so far, None when it reports none."""
    stats = engine.stats() if hasattr(engine, "stats") else {}
    prefix = stats.get("prefix_cache") or {}
    if "hit_tokens" not in prefix or "lookup_tokens" not in prefix:
        return None
    return float(prefix["hit_tokens"]), float(prefix["lookup_tokens"])


def evaluate(
    engine: Any,
    pool: EnvPool,
    tokenizer: Any,
    tasks_by_domain: Mapping[str, Sequence[Task]],
    *,
    k: int = 4,
    sampling: Any,
    max_turns: int = 1,
    chat: bool = False,
    greedy: bool = False,
) -> dict[str, dict[str, Any]]:
    """{domain: summary} for `k` samples of every task (`sampling.n` is replaced by k); domain by domain,
    so each domain's cost (wall time, prefix-cache hit rate) is its own. `greedy`: one greedy completion
    per task instead (temperature 0, k = 1), so pass@1 is the greedy accuracy."""
    if greedy:
        k, sampling = 1, dataclasses.replace(sampling, temperature=0.0)
    results = {}
    for domain, tasks in tasks_by_domain.items():
        if not tasks:
            raise ValueError(f"no tasks to evaluate for domain {domain!r}")
        before = _prefix_counts(engine)
        start = time.monotonic()
        samples = rollout.rollout(
            engine, pool, list(tasks), tokenizer, n=k, sampling=sampling, max_turns=max_turns, chat=chat
        )
        seconds = time.monotonic() - start
        after = _prefix_counts(engine)
        summary = aggregate([Outcome.from_sample(s) for s in samples], k=k)
        row = summary[domain]
        row["seconds_per_task"] = seconds / len(tasks)
        hit_rate = None
        if before is not None and after is not None:
            hit_rate = (after[0] - before[0]) / max(after[1] - before[1], 1.0)
        row["prefix_cache_hit_rate"] = hit_rate
        results[domain] = row
    return results


def heldout(
    cfg, engine, env, tokenizer, tasks_by_domain, *, greedy: bool = False
) -> dict[str, dict[str, Any]]:
    """The main job's held-out evaluation: rl.eval.k samples per task at rl.temperature (seed `EVAL_SEED`),
    or (`greedy`) one at temperature 0."""
    rl = cfg.rl
    return evaluate(
        engine,
        env,
        tokenizer,
        tasks_by_domain,
        k=rl.eval.k,
        sampling=rollout.sampling_params(rl, tokenizer, seed=EVAL_SEED),
        max_turns=rl.max_turns,
        chat=rl.chat,
        greedy=greedy,
    )


def write_heldout(workdir: str, tag: str, greedy: bool, results: Mapping[str, Any]) -> None:
    """`<workdir>/eval_<tag>[_greedy].json` (rl.train's `eval_before.json`, `eval_after_greedy.json`, ...)."""
    name = f"eval_{tag}_greedy.json" if greedy else f"eval_{tag}.json"
    with open(os.path.join(workdir, name), "w") as f:
        json.dump(results, f, indent=2, default=float)


def flatten(results: Mapping[str, Mapping[str, Any]], prefix: str = "eval") -> dict[str, float]:
    """Scalars for `rl.metrics.MetricsLogger`: `eval/<domain>/pass@1`, `eval/<domain>/status/ok`, ..."""
    out: dict[str, float] = {}
    for domain, row in results.items():
        for key, value in row.items():
            if isinstance(value, Mapping):
                out.update({f"{prefix}/{domain}/{key}/{s}": float(v) for s, v in value.items()})
            elif value is not None:
                out[f"{prefix}/{domain}/{key}"] = float(value)
    return out


_STATUS_HEADERS = {"format_error": "format", "sandbox_violation": "violation"}


def format_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """An aligned text table, one row per domain: quality, status counts, then cost per task."""
    k = {row["k"] for row in results.values()}
    pass_k = f"pass@{k.pop()}" if len(k) == 1 else "pass@k"
    header = ["domain", "tasks", "pass@1", pass_k, "reward"]
    header += [_STATUS_HEADERS.get(s, s) for s in STATUSES]
    header += ["tokens/task", "sandbox_s/task", "s/task", "prefix_hit"]
    rows = [header]
    for domain in sorted(results):
        r = results[domain]
        hit = r.get("prefix_cache_hit_rate")
        rows.append(
            [domain, str(r["tasks"]), f"{r['pass@1']:.3f}", f"{r['pass@k']:.3f}", f"{r['reward']:.3f}"]
            + [str(r["status"][s]) for s in STATUSES]
            + [
                f"{r['generated_tokens_per_task']:.1f}",
                f"{r['sandbox_seconds_per_task']:.3f}",
                f"{r['seconds_per_task']:.2f}" if "seconds_per_task" in r else "-",
                "-" if hit is None else f"{hit:.3f}",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    return "\n".join(lines)


def format_before_after(
    before: Mapping[str, Mapping[str, Any]],
    after: Mapping[str, Mapping[str, Any]],
    greedy_before: Mapping[str, Mapping[str, Any]] | None = None,
    greedy_after: Mapping[str, Mapping[str, Any]] | None = None,
) -> str:
    """The before/after table of held-out accuracy, one row per domain of `after`: distinct held-out prompts,
    greedy accuracy (`evaluate(..., greedy=True)`; "-" when not given), pass@1 and pass@k of the sampled
    evaluation before and after, and the pass@1 gain in points."""
    k = {row["k"] for row in after.values()}
    pass_k = f"pass@{k.pop()}" if len(k) == 1 else "pass@k"
    header = ["domain", "prompts", "greedy before", "greedy after", "pass@1 before", "pass@1 after", "gain"]
    header += [f"{pass_k} before", f"{pass_k} after"]
    value = lambda table, d, key: "-" if table is None or d not in table else f"{table[d][key]:.3f}"
    rows = [header]
    for d in sorted(after):
        a, b = after[d], before.get(d)
        gain = "-" if b is None else f"{100 * (a['pass@1'] - b['pass@1']):+.1f}"
        rows.append(
            [d, str(a["tasks"]), value(greedy_before, d, "pass@1"), value(greedy_after, d, "pass@1")]
            + [value(before, d, "pass@1"), value(after, d, "pass@1"), gain]
            + [value(before, d, "pass@k"), value(after, d, "pass@k")]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in rows
    )


# ---------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------


def with_overrides(
    cfg: Any,
    *,
    domains: Sequence[str] | None = None,
    n_tasks: int | None = None,
    k: int | None = None,
    temperature: float | None = None,
    max_new_tokens: int | None = None,
) -> Any:
    """A copy of the run's config with the CLI's overrides (unset ones keep the run's value)."""
    cfg = copy.deepcopy(cfg)
    rl = cfg.rl
    with cfg.unlocked():
        if domains:
            rl.domains = tuple(domains)
        if n_tasks:
            rl.eval.n_tasks = n_tasks
        if k:
            rl.eval.k = k
        if temperature is not None:
            rl.temperature = temperature
        if max_new_tokens:
            rl.max_new_tokens = max_new_tokens
    return cfg


def run(
    workdir: str,
    *,
    cfg: Any = None,
    domains: Sequence[str] | None = None,
    n_tasks: int | None = None,
    k: int | None = None,
    step: int | None = None,
    temperature: float | None = None,
    max_new_tokens: int | None = None,
    seed: int = EVAL_SEED,
    out: str | None = None,
) -> dict[str, Any]:
    """Evaluates the checkpoint of `workdir` (latest, or `step`) on the run's held-out tasks; writes and
    returns {"step", "results"}. Unset arguments come from the run's config (`cfg`, else
    `<workdir>/config.json`)."""
    cfg = cfg if cfg is not None else read_config(workdir)
    cfg = with_overrides(
        cfg, domains=domains, n_tasks=n_tasks, k=k, temperature=temperature, max_new_tokens=max_new_tokens
    )
    rl = cfg.rl
    env_kwargs = data.env_kwargs(cfg)  # checked before any worker starts
    distributed.initialize()
    mesh = distributed.trainer_mesh(cfg)
    # The pool forks its workers before JAX creates any array (envs/pool.py).
    with EnvPool(rl.env_workers, domains=env_kwargs, timeout_s=rl.env_timeout_s) as pool:
        tokenizer = load_tokenizer(rl.tokenizer or None, vocab_size=cfg.model.vocab_size)
        tasks = data.heldout_tasks(cfg, tokenizer)
        state, meta = run_dir.restore_state(cfg, workdir, step, mesh=mesh)
        # The main job's sampler layout (rl.engine.mesh); with the selection biases: the engine refuses a
        # sigmoid-router model's params without them.
        place, engine_cfg = sampler.layout(cfg, mesh), validate.engine_config(cfg)
        weights = place.engine_weights(train_state.weights(state), cfg, engine_cfg)
        del state  # the engine's copy is what evaluates
        engine = Engine(cfg, weights, engine_cfg, mesh=place.mesh, placed=place.placed)
        sampling = rollout.sampling_params(rl, tokenizer, seed=seed)
        results = evaluate(
            engine,
            sampler.SharedPool(pool, place) if place.lockstep else pool,
            tokenizer,
            tasks,
            k=rl.eval.k,
            sampling=sampling,
            max_turns=rl.max_turns,
            chat=rl.chat,
        )
    report = {"step": meta.get("step"), "results": results}
    out = out or os.path.join(workdir, EVAL_FILE)
    if distributed.is_primary():  # every process evaluates every task; process 0 writes
        with open(out, "w") as f:
            json.dump(report, f, indent=2)
    return report


def main() -> None:

    # Before rl.train's --config (its default config file is read, with the overrides, when it is defined).
    # Without --config every override applies to the run's config.json (configs/cli.py), e.g.
    # --config.rl.env.math.test_jsonl=other.jsonl
    cli.take_block_overrides(sys.argv, every=not cli.config_given(sys.argv))
    config, workdir = run_dir.define_flags(
        None,
        config_help="Config file (default: <workdir>/config.json).",
        workdir_help="Run directory (config.json, checkpoints/).",
    )
    domains = flags.DEFINE_list("domains", None, "Domains to evaluate (default: the run's rl.domains).")
    n_tasks = flags.DEFINE_integer("n_tasks", None, "Held-out tasks per domain (default: rl.eval.n_tasks).")
    k = flags.DEFINE_integer("k", None, "Samples per task (default: rl.eval.k).")
    step = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    temperature = flags.DEFINE_float("temperature", None, "Sampling temperature (default: rl.temperature).")
    max_new = flags.DEFINE_integer("max_new_tokens", None, "Tokens per turn (default: rl.max_new_tokens).")
    out = flags.DEFINE_string("out", None, "Output JSON (default: <workdir>/eval.json).")
    flags.mark_flag_as_required("workdir")

    def _main(argv: Sequence[str]) -> None:
        if len(argv) > 1:
            raise UserError(f"unexpected arguments {list(argv[1:])}; flags look like --workdir=DIR")
        cli.quiet_console(workdir.value)
        cfg = config.value
        if cfg is None and cli.taken():
            cfg = read_config(workdir.value)
        report = run(
            workdir.value,
            cfg=cli.with_block_overrides(cfg),
            domains=domains.value,
            n_tasks=n_tasks.value,
            k=k.value,
            step=step.value,
            temperature=temperature.value,
            max_new_tokens=max_new.value,
            out=out.value,
        )
        print(f"step {report['step']}")
        print(format_table(report["results"]))
        print(f"wrote {out.value or os.path.join(workdir.value, EVAL_FILE)}", file=sys.stderr)

    cli.run(_main)


if __name__ == "__main__":
    main()
