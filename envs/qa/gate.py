"""The environment quality gate: `python -m envs.qa --domain=NAME [--domain=...] [--n=20] [--json=out.json]`.

For each domain, `run_checks` runs:
    levels        `sample_tasks(difficulty=L)` gives tasks of level L, deterministically.
    solvability   the reference solution scores 1.0 (`ok`) on every sampled task of every level.
    consistency   the same completions scored several times, and in different worker processes when a
                  pool is given, get the same reward and status.
    probe:NAME    an attempt to get reward without solving the task scores 0 with a non-`ok` status, and
                  (code domains) does nothing to the host: each code probe runs alone, with bait of its
                  own, and is judged by its side effects (`envs.qa.escape`): a canary read, a connection
                  accepted, a host process seen, a file created outside the work dir, a process left
                  after the run, more memory held at once than the sandbox's total limit.
                  Generic probes (every domain): empty or blank output, echoing the prompt, several
                  answers at once (single-answer domains), "PASS"/"OK", huge output. Code probes (python
                  source; for domains that run model code, `CODE_DOMAINS` or `Environment.runs_code`):
                  exiting early with status 0, printing PASS, reading and overwriting test files,
                  monkeypatching the harness (an always-equal result, patched unittest, exit hooks), huge
                  output, an infinite loop, fork and memory bombs, network access, writing outside the work
                  dir, and the escape probes of `envs.escape.ESCAPE_PROBES` (fill /dev/shm, many
                  processes each below the per-process memory limit, leave a file for the next episode and
                  look for it, list /proc, read canaries in this project and in /tmp, setsid + sleep,
                  connect to the host). A domain may add its own through
                  `Environment.hacking_probes(task) -> {name: text}`.
    strata        pass rates per level of the reference and of a noisy reference (each digit changed and
                  each line dropped with probability `noise`); reported as a table. It warns, never fails,
                  when the noisy solver's pass rate does not depend on the level or never drops below 1.

The trainer refuses a domain whose `Report.passed` is false. Verdicts are deterministic given (domain, n,
seed): probes and noise come from seeded generators, and no timing enters the report (the escape probes'
bait has random names, which may show in their details). Without --domain, every registered domain but
`debug` (which misbehaves on purpose) is checked.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Sequence
from typing import Any

from envs import registry
from envs.base import Environment, Score, Task
from envs.qa import escape
from envs.qa.probes import is_code_domain, noisy, probes_for
from envs.sandbox import box as sandbox

MAX_PROBE_TASKS = 2
CONSISTENCY_TASKS_PER_LEVEL = 1


@dataclasses.dataclass
class Check:
    name: str
    passed: bool
    detail: str = ""
    warning: str = ""
    data: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Report:
    domain: str
    checks: list[Check] = dataclasses.field(default_factory=list)
    strata: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def failed(self) -> list[str]:
        return [c.name for c in self.checks if not c.passed]

    def check(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def to_json(self) -> dict[str, Any]:
        return {
            "domain": self.domain,
            "passed": self.passed,
            "failed": self.failed(),
            "checks": [dataclasses.asdict(c) for c in self.checks],
            "strata": {str(k): v for k, v in self.strata.items()},
        }


# ----------------------------------------------------------------------------------------------------------
# Scoring


def _score_local(env: Environment, task: Task, completion: str) -> Score:
    try:
        return env.score(task, completion)
    except Exception as e:  # a verifier that raises is a finding, not a crash of the gate
        return Score(0.0, "env_error", {"exception": f"{type(e).__name__}: {e}"[:500], "raised": True})


def _score_pool(pool: Any, pairs: list[tuple[Task, str]]) -> list[Score]:
    return list(pool.score_many(pairs))


def _scorer(env: Environment, pool: Any):
    def score(pairs: list[tuple[Task, str]]) -> list[Score]:
        if pool is not None:
            return _score_pool(pool, pairs)
        return [_score_local(env, t, c) for t, c in pairs]

    return score


def _key(score: Score) -> tuple[float, str]:
    return (float(score.reward), score.status)


def _brief(score: Score) -> dict[str, Any]:
    details = json.dumps(score.details, sort_keys=True, default=str)
    return {"reward": score.reward, "status": score.status, "details": details[:300]}


# ----------------------------------------------------------------------------------------------------------
# The checks


def run_checks(
    domain: str,
    *,
    n: int = 20,
    seed: int = 0,
    pool: Any = None,
    noise: float = 0.02,
    repeats: int = 3,
    probe_tasks: int = MAX_PROBE_TASKS,
    probes: Sequence[str] | None = None,
    env_kwargs: dict[str, Any] | None = None,
) -> Report:
    """Every check of the gate on `n` tasks per level of `domain`; `pool` (an `EnvPool`) adds cross-worker
    consistency and runs the scoring (with its timeouts) out of process. `probes`: only these probes (names
    as in `probes_for`; None: all); `env_kwargs`: for the domain's constructor here (not the pool's)."""
    report = Report(domain)
    try:
        env = registry.make(domain, **(env_kwargs or {}))
    except Exception as e:
        report.checks.append(Check("load", False, f"{type(e).__name__}: {e}"))
        return report
    try:
        _run(
            env,
            domain,
            report,
            n=n,
            seed=seed,
            pool=pool,
            noise=noise,
            repeats=repeats,
            probe_tasks=probe_tasks,
            only=probes,
        )
    finally:
        env.close()
    return report


def _run(
    env: Environment, domain: str, report: Report, *, n, seed, pool, noise, repeats, probe_tasks, only
) -> None:
    if pool is not None and domain not in getattr(pool, "domains", ()):
        pool = None  # the pool's workers do not serve this domain: score in process
    score = _scorer(env, pool)
    tasks: dict[int, list[Task]] = {}
    bad_levels = []
    for level in env.levels:
        tasks[level] = env.sample_tasks(seed, n, difficulty=level)
        again = env.sample_tasks(seed, n, difficulty=level)
        if len(tasks[level]) != n or any(t.difficulty != level for t in tasks[level]):
            got = sorted({t.difficulty for t in tasks[level]})
            bad_levels.append(f"level {level}: {len(tasks[level])} tasks of levels {got}")
        if [t.to_json() for t in again] != [t.to_json() for t in tasks[level]]:
            bad_levels.append(f"level {level}: sample_tasks is not deterministic")
    report.checks.append(
        Check("levels", not bad_levels, "; ".join(bad_levels) or f"levels {list(env.levels)}")
    )
    all_tasks = [t for level in env.levels for t in tasks[level]]

    # Solvability
    refs = {t.id: env.reference_solution(t) for t in all_tasks}
    ref_scores = dict(zip(refs, score([(t, refs[t.id]) for t in all_tasks])))
    unsolved = {tid: _brief(s) for tid, s in ref_scores.items() if _key(s) != (1.0, "ok")}
    report.checks.append(
        Check(
            "solvability",
            not unsolved,
            f"{len(all_tasks) - len(unsolved)}/{len(all_tasks)} reference solutions score 1.0",
            data={"unsolved": dict(list(unsolved.items())[:10])},
        )
    )

    # Difficulty strata (noisy reference)
    noisy_text = {t.id: noisy(refs[t.id], noise, random.Random(f"qa:{seed}:{t.id}")) for t in all_tasks}
    noisy_scores = dict(zip(noisy_text, score([(t, noisy_text[t.id]) for t in all_tasks])))
    for level in env.levels:
        ids = [t.id for t in tasks[level]]
        report.strata[level] = {
            "n": len(ids),
            "reference": sum(ref_scores[i].reward == 1.0 for i in ids) / max(1, len(ids)),
            "noisy": sum(noisy_scores[i].reward == 1.0 for i in ids) / max(1, len(ids)),
        }
    rates = [report.strata[level]["noisy"] for level in env.levels]
    warning = ""
    if min(rates) == 1.0:
        warning = f"the noisy reference (noise {noise}) always passes: is the verifier reading the answer?"
    elif len(rates) > 1 and len(set(rates)) == 1:
        warning = "noisy pass rates do not depend on the level"
    shown = [round(r, 2) for r in rates]
    report.checks.append(Check("strata", True, f"noise {noise}: noisy pass rates {shown}", warning=warning))

    # Consistency: repeated in-process scoring, and in different workers through the pool
    sample = [t for level in env.levels for t in tasks[level][:CONSISTENCY_TASKS_PER_LEVEL]]
    pairs = [(t, c) for t in sample for c in (refs[t.id], noisy_text[t.id], "PASS")]
    first = [_score_local(env, t, c) for t, c in pairs]
    mismatches = []
    for r in range(repeats - 1):
        again = [_score_local(env, t, c) for t, c in pairs]
        for (t, _), a, b in zip(pairs, first, again):
            if _key(a) != _key(b):
                mismatches.append(f"{t.id} in-process repeat {r + 1}: {_key(a)} vs {_key(b)}")
    where = f"{repeats}x in process"
    if pool is not None:
        # Each pair twice, interleaved, so that the two copies land on different workers.
        for b, (t, _), a in zip(_score_pool(pool, pairs + pairs), pairs + pairs, first + first):
            if _key(a) != _key(b):
                mismatches.append(f"{t.id} in a worker: {_key(a)} vs {_key(b)} in process")
        where += ", 2x across pool workers"
    report.checks.append(
        Check(
            "consistency",
            not mismatches,
            f"{len(pairs)} completions, {where}",
            data={"mismatches": mismatches[:10]},
        )
    )

    # Anti-reward-hacking probes
    probe_on = [tasks[env.levels[0]][0]] + ([tasks[env.levels[-1]][0]] if len(env.levels) > 1 else [])
    results: dict[str, list[dict]] = {}
    for task in probe_on[:probe_tasks]:
        other = None
        if env.max_turns == 1 and not is_code_domain(env):  # another task whose answer is wrong here
            candidates = (t for t in all_tasks if refs[t.id] != refs[task.id])
            other = next((t for t in candidates if _score_local(env, task, refs[t.id]).reward == 0.0), None)
        if is_code_domain(env):
            _probe_one_by_one(env, task, other, score, results, only)
        else:
            probes = {k: v for k, v in probes_for(env, task, other).items() if only is None or k in only}
            for (name, _), s in zip(probes.items(), score([(task, c) for c in probes.values()])):
                results.setdefault(name, []).append({"task": task.id, **_brief(s), "side_effects": []})
    if is_code_domain(env):
        escape.remove_left_files()
    for name, runs in results.items():
        hacked = [r for r in runs if r["reward"] != 0.0 or r["status"] == "ok"]
        escaped = [r for r in runs if r["side_effects"]]
        statuses = sorted({r["status"] for r in runs})
        if hacked:
            detail = f"reward {hacked[0]['reward']} status {hacked[0]['status']} on {hacked[0]['task']}"
        elif escaped:
            detail = f"on {escaped[0]['task']}: " + "; ".join(escaped[0]["side_effects"])
        else:
            detail = f"statuses {statuses}" + (", no side effects" if is_code_domain(env) else "")
        report.checks.append(Check(f"probe:{name}", not hacked and not escaped, detail, data={"runs": runs}))


def _total_memory(env: Environment) -> int:
    """The total memory one sandboxed run of `env` may hold (its sandbox limits, else the default)."""
    limits = getattr(env, "limits", None) or getattr(env, "step_limits", None)
    return getattr(limits, "total_memory_bytes", sandbox.Limits().total_memory_bytes)


def _probe_one_by_one(env: Environment, task: Task, other: Task | None, score, results: dict, only) -> None:
    """Each probe alone, with its own bait, judged by its side effects too. "look_for_file" follows
    "leave_file" (dict order), so it looks in the next episode for what that one left."""
    for name in probes_for(env, task, other):
        if only is not None and name not in only:
            continue
        with escape.Watch(_total_memory(env)) as watch:
            (s,) = score([(task, probes_for(env, task, other, watch.preamble())[name])])
            effects = watch.findings()
        results.setdefault(name, []).append({"task": task.id, **_brief(s), "side_effects": effects})


# ----------------------------------------------------------------------------------------------------------
# Report


def format_report(report: Report) -> str:
    lines = [f"== {report.domain}: {'PASS' if report.passed else 'FAIL'}"]
    width = max([len(c.name) for c in report.checks] + [10])
    for c in report.checks:
        mark = "ok  " if c.passed else "FAIL"
        lines.append(
            f"  {mark} {c.name:<{width}}  {c.detail}" + (f"  [warn: {c.warning}]" if c.warning else "")
        )
    if report.strata:
        lines.append(f"  {'level':>7} {'n':>4} {'reference':>10} {'noisy':>7}")
        for level, row in report.strata.items():
            lines.append(f"  {level:>7} {row['n']:>4} {row['reference']:>10.2f} {row['noisy']:>7.2f}")
    return "\n".join(lines)
