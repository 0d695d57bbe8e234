"""python -m benchmarks learning --seeds=0,1,2 --out=benchmarks/results/learning.jsonl

Does the adaptive curriculum pay? Multi-domain runs of the main job (`rl.train.train` on
`configs/grpo.py:demo` with `--domains`), one per (arm, seed): arm `adaptive` (rl.curriculum=adaptive, the
gain-per-compute weights of rl/curriculum.py) against arm `static` (uniform static weights), every other
field equal. Each run checkpoints every `--eval_every` steps (the SFT warm start is step 0); afterwards every
checkpoint is scored on the run's held-out split (`rl.evaluate.run`: `rl.data.heldout_tasks`, k samples at
the run's temperature), and its compute read off metrics.jsonl: generated tokens plus
rl.curriculum_sandbox_second_cost per sandbox second, summed over domains and steps.

Printed and written as JSON lines (`--out`):

- `{"kind": "point", arm, seed, step, compute, heldout: {domain: pass@1}, mean}` per checkpoint;
- `{"kind": "interference", arm, seed, step, cosine: {"a|b": cos}}` per checkpoint: the cosine between
  two domains' gradients, each the gradient of the cross-entropy of that domain's reference solutions
  (`--grad_rows` train-split tasks, the warm start's loss) at that checkpoint's parameters. It is a proxy:
  the GRPO gradient needs the rollout of the moment; this one asks whether making one domain's right
  answers likelier makes the other's less likely (cosine < 0) as training goes on;
- `{"kind": "projection", arm, seed, steps, conflicts_mean, kept_mean, "cosine/a|b": {mean, min, max}}`
  per run of the `pcgrad` arm: what the projection did, from the run's per-step metrics;
- `{"kind": "summary", arm, target, compute_to_target: [per seed, null if never reached], mean, std,
  reached}`: compute until the mean held-out pass@1 over domains first reaches `--target` (linear
  interpolation between checkpoints), and the A/B difference with its spread over seeds.

Arm `pcgrad` is `static` with `rl.gradient_projection=True`: the train step splits each batch's gradient by
domain and removes each domain's component that conflicts with another's (PCGrad, rl/projection.py) before
the optimizer step; its runs log `train/projection/{conflicts,kept,cosine/a|b}` per step, the cosine of
the GRPO gradients themselves.

`--plot` draws held-out mean pass@1 against compute, one line per arm (mean over seeds), the seeds' range
shaded.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import numpy as np

from benchmarks import record
from benchmarks.record import portable, portable_list
from rl import run as run_dir

ARMS = ("adaptive", "static", "pcgrad")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[2])
    p.add_argument("--domains", default="math:-1;strings:2,3", help="domain:levels;... (levels optional)")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=150, help="GRPO steps per run")
    p.add_argument("--sft_steps", type=int, default=800)
    p.add_argument("--eval_every", type=int, default=25, help="steps between scored checkpoints")
    p.add_argument("--eval_n", type=int, default=100, help="held-out prompts per domain")
    p.add_argument("--target", type=float, default=0.8, help="held-out mean pass@1 to reach")
    p.add_argument("--grad_rows", type=int, default=32, help="tasks per domain of the gradient cosine")
    p.add_argument("--workdir", default="runs/learning", help="run directories go under here")
    p.add_argument("--out", default="", help="JSON lines file (default: stdout only)")
    p.add_argument("--plot", default="", help="PNG of held-out accuracy against compute")
    p.add_argument(
        "--from_jsonl",
        default="",
        help="no runs: the summary and plot from the point lines of earlier --out files (comma-separated; "
        "a repeated (arm, seed, step) keeps its last line)",
    )
    return p.parse_args(argv)


def run_config(args, arm: str, seed: int):
    import ml_collections

    from configs import grpo

    cfg = grpo.get_config("demo")
    rl = cfg.rl
    specs = [s.partition(":") for s in args.domains.split(";")]
    rl.domains = tuple(name for name, _, _ in specs)
    rl.levels = ml_collections.ConfigDict(
        {name: tuple(int(x) for x in lv.split(",")) for name, _, lv in specs if lv}
    )
    # pcgrad: static uniform weights, the domains' gradients projected (rl.gradient_projection).
    rl.curriculum = "static" if arm == "pcgrad" else arm
    rl.gradient_projection = arm == "pcgrad"
    rl.seed = seed
    rl.steps, rl.optim.total_steps = args.steps, args.steps
    rl.optim.warmup_steps = min(rl.optim.warmup_steps, max(args.steps // 10, 1))
    rl.sft.steps, rl.sft.optim.total_steps = args.sft_steps, args.sft_steps
    rl.sft.optim.warmup_steps = min(5, args.sft_steps)
    rl.checkpoint_every = args.eval_every
    rl.max_to_keep = args.steps // args.eval_every + 2
    rl.eval.n_tasks = args.eval_n
    rl.curriculum_floor = min(rl.curriculum_floor, 1.0 / len(rl.domains))
    cfg.batch_size = rl.prompts_per_step * rl.group_size
    return cfg


def compute_by_step(workdir: str, cfg) -> dict[int, float]:
    """Cumulative compute (tokens + sandbox seconds at the curriculum's price) after each GRPO step."""
    per_second = float(cfg.rl.curriculum_sandbox_second_cost)
    steps = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "reward" not in r:  # SFT and evaluation lines
                continue
            steps[int(r["step"])] = sum(
                r.get(f"tokens/{d}", 0.0) + per_second * r.get(f"sandbox_seconds/{d}", 0.0)
                for d in cfg.rl.domains
            )
    total, out = 0.0, {0: 0.0}
    for step in sorted(steps):
        total += steps[step]
        out[step] = total
    return out


def gradient_cosines(cfg, workdir: str, step: int, rows: int) -> dict[str, float]:
    """{"a|b": cosine} of per-domain cross-entropy gradients on reference solutions at checkpoint `step`."""
    import jax
    import jax.numpy as jnp

    from envs import registry
    from model.io.tokenizer import load_tokenizer
    from model.transformer import next_token_loss
    from rl import data, losses, train_state, warm_start

    state, _ = run_dir.restore_state(cfg, workdir, step)
    graphdef, _ = train_state.init_state(cfg, seed=cfg.rl.seed)
    tokenizer = load_tokenizer(cfg.rl.tokenizer or None, vocab_size=cfg.model.vocab_size)
    grads = {}
    for d in cfg.rl.domains:
        env = registry.make(d)
        stream = data.domain_stream(cfg, d, "train")
        tasks = stream.next_tasks(rows)
        stream.close()
        examples = [warm_start.sft_example(t, env, tokenizer, chat=cfg.rl.chat) for t in tasks]
        batch = {k: jnp.asarray(v) for k, v in warm_start.sft_batch(examples, rows, cfg.seq_len).items()}

        def loss(params, batch=batch):
            logits_BTV, _ = losses.policy_forward(cfg, graphdef, params, batch, replay=False)
            return next_token_loss(logits_BTV, batch["tokens_BT"], batch["mask_BT"])

        g = jax.grad(loss)(state.params)
        grads[d] = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(g)])
    out = {}
    for a, b in itertools.combinations(cfg.rl.domains, 2):
        ga, gb = grads[a], grads[b]
        out[f"{a}|{b}"] = float(ga @ gb / max(np.linalg.norm(ga) * np.linalg.norm(gb), 1e-30))
    return out


def reach(points: list[tuple[float, float]], target: float) -> float | None:
    """The compute at which the (compute, accuracy) curve first reaches `target`, interpolated linearly."""
    for (c0, a0), (c1, a1) in zip(points, points[1:]):
        if a0 >= target:
            return c0
        if a1 >= target:
            return c0 + (c1 - c0) * (target - a0) / (a1 - a0)
    return points[-1][0] if points and points[-1][1] >= target else None


def one_run(args, arm: str, seed: int, emit) -> list[tuple[float, float]]:
    from rl import evaluate, train

    cfg = run_config(args, arm, seed)
    workdir = os.path.join(args.workdir, f"{arm}-seed{seed}")
    t0 = time.perf_counter()
    train.train(cfg, workdir, run_eval=False)
    train_s = time.perf_counter() - t0
    compute = compute_by_step(workdir, cfg)
    steps = sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints")) if s.isdigit())
    points = []
    for step in steps:
        report = evaluate.run(workdir, cfg=cfg, step=step, out=os.path.join(workdir, f"eval_{step}.json"))
        heldout = {d: r["pass@1"] for d, r in report["results"].items()}
        mean = float(np.mean(list(heldout.values())))
        points.append((compute[step], mean))
        emit(
            {"kind": "point", "arm": arm, "seed": seed, "step": step, "compute": compute[step]}
            | {"heldout": heldout, "mean": mean, "train_s": round(train_s, 1)}
        )
        if len(cfg.rl.domains) > 1:
            cos = gradient_cosines(cfg, workdir, step, args.grad_rows)
            emit({"kind": "interference", "arm": arm, "seed": seed, "step": step, "cosine": cos})
    if cfg.rl.gradient_projection:
        emit({"kind": "projection", "arm": arm, "seed": seed} | projection_summary(workdir))
    _release_executables()
    return points


def projection_summary(workdir: str) -> dict:
    """Per-step projection metrics of a run (metrics.jsonl): mean conflicts and kept norm fraction, and the
    GRPO gradients' cosine per domain pair (mean, min, max over steps that trained)."""
    rows = []
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("train/projection/conflicts") is not None:
                rows.append(r)
    if not rows:
        return {"steps": 0}
    out = {
        "steps": len(rows),
        "conflicts_mean": float(np.mean([r["train/projection/conflicts"] for r in rows])),
        "kept_mean": float(np.mean([r["train/projection/kept"] for r in rows])),
    }
    for name in sorted(k for k in rows[0] if k.startswith("train/projection/cosine/")):
        values = [r[name] for r in rows]
        pair = name.rsplit("/", 1)[1]
        out[f"cosine/{pair}"] = {"mean": float(np.mean(values)), "min": min(values), "max": max(values)}
    return out


def _release_executables() -> None:
    """Frees the run's compiled programs. Each XLA:CPU executable holds memory mappings and JAX's caches keep
    them all alive: the seventh run of this loop in one process passed vm.max_map_count (65,530) and LLVM
    failed ("Cannot allocate memory", then a segfault)."""
    import gc

    import jax

    gc.collect()
    jax.clear_caches()
    gc.collect()


def curves_from_jsonl(paths: list[str]) -> dict[str, dict[int, list[tuple[float, float]]]]:
    """arm -> seed -> [(compute, mean held-out pass@1)] by step, from the point lines of `paths`."""
    points: dict[tuple[str, int, int], tuple[float, float]] = {}
    for path in paths:
        with open(path) as f:
            for r in map(json.loads, f):
                if r.get("kind") == "point":
                    points[(r["arm"], r["seed"], r["step"])] = (r["compute"], r["mean"])
    curves: dict[str, dict[int, list[tuple[float, float]]]] = {}
    for (arm, seed, _), point in sorted(points.items()):
        curves.setdefault(arm, {}).setdefault(seed, []).append(point)
    return curves


def plot(curves: dict[str, dict[int, list[tuple[float, float]]]], path: str, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, by_seed in curves.items():
        grid = np.linspace(0, min(max(c for c, _ in pts) for pts in by_seed.values()), 50)
        ys = np.array([np.interp(grid, *zip(*pts)) for pts in by_seed.values()])
        ax.plot(grid, ys.mean(axis=0), label=f"{arm} ({len(by_seed)} seeds)")
        ax.fill_between(grid, ys.min(axis=0), ys.max(axis=0), alpha=0.2)
    ax.axhline(target, color="gray", linestyle=":", label=f"target {target}")
    ax.set_xlabel("compute (generated tokens + sandbox seconds x cost)")
    ax.set_ylabel("held-out pass@1 (mean over domains)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    lines: list[dict] = []

    def emit(fields: dict) -> None:
        lines.append(record.emit(fields, out=args.out))

    paths = {k: portable(getattr(args, k)) for k in ("workdir", "out", "plot")}  # no machine's paths
    paths["from_jsonl"] = portable_list(args.from_jsonl)
    emit({"kind": "args", **vars(args), **paths})
    curves: dict[str, dict[int, list[tuple[float, float]]]] = {}
    if args.from_jsonl:
        curves = curves_from_jsonl(args.from_jsonl.split(","))
    else:
        for arm in args.arms.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                curves.setdefault(arm, {})[seed] = one_run(args, arm, seed, emit)
    reached = {}
    for arm, by_seed in curves.items():
        per_seed = [reach(pts, args.target) for pts in by_seed.values()]
        hit = [c for c in per_seed if c is not None]
        reached[arm] = hit
        emit(
            {"kind": "summary", "arm": arm, "target": args.target, "compute_to_target": per_seed}
            | {"mean": float(np.mean(hit)) if hit else None, "std": float(np.std(hit)) if hit else None}
            | {"reached": f"{len(hit)}/{len(per_seed)}"}
        )
    if args.plot:
        plot(curves, args.plot, args.target)
    emit({"kind": "end"})
    return lines


if __name__ == "__main__":
    main()
