"""python -m rl.plot --workdir=runs/tiny [--out=runs/tiny/curves.png]

Training curves from `<workdir>/metrics.jsonl` (key names in `rl/metrics.py`) as a PNG with two panels:
the mean reward per domain (`reward/<domain>`, with held-out `eval/<domain>/pass@1` as markers when the run
logged them) and the curriculum's domain weights (`weight/<domain>`), both against the step.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from rl import metrics

_REWARD = re.compile(r"^reward/(?P<domain>[^/]+)$")
_WEIGHT = re.compile(r"^weight/(?P<domain>[^/]+)$")
_EVAL = re.compile(r"^eval/(?P<domain>[^/]+)/pass@1$")


def series(records: Sequence[Mapping[str, Any]], pattern: re.Pattern) -> dict[str, tuple[list, list]]:
    """domain -> (steps, values) of the keys matching `pattern`, over records merged per step; null (non-
    finite) values are left out."""
    out: dict[str, tuple[list, list]] = {}
    for record in metrics.by_step(records):
        for key, value in record.items():
            m = pattern.match(key)
            if m and value is not None:
                steps, values = out.setdefault(m["domain"], ([], []))
                steps.append(record["step"])
                values.append(value)
    return dict(sorted(out.items()))


def plot(records: Sequence[Mapping[str, Any]], out_path: str | os.PathLike) -> dict[str, int]:
    """Draws the two panels to `out_path` (PNG); returns how many curves each panel got."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rewards, weights, evals = series(records, _REWARD), series(records, _WEIGHT), series(records, _EVAL)
    fig, (ax_r, ax_w) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    try:
        colors = {}
        for domain, (steps, values) in rewards.items():
            (line,) = ax_r.plot(steps, values, label=domain)
            colors[domain] = line.get_color()
        for domain, (steps, values) in evals.items():
            ax_r.plot(steps, values, "o", color=colors.get(domain), label=f"{domain} eval pass@1")
        ax_r.set_ylabel("mean reward")
        ax_r.set_title("reward per domain")
        for domain, (steps, values) in weights.items():
            ax_w.plot(steps, values, label=domain, color=colors.get(domain))
        ax_w.set_ylabel("sampling weight")
        ax_w.set_ylim(0.0, 1.0)
        ax_w.set_xlabel("step")
        ax_w.set_title("curriculum domain weights")
        for ax, curves in ((ax_r, rewards or evals), (ax_w, weights)):
            ax.grid(alpha=0.3)
            if curves:
                ax.legend(loc="best", fontsize="small")
            else:
                ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        fig.tight_layout()
        fig.savefig(out_path, dpi=100)
    finally:
        plt.close(fig)
    return {"reward": len(rewards), "eval": len(evals), "weight": len(weights)}


def main() -> None:
    from absl import app, flags

    workdir = flags.DEFINE_string("workdir", None, "Run directory holding metrics.jsonl.")
    out = flags.DEFINE_string("out", None, "PNG to write (default: <workdir>/curves.png).")
    flags.mark_flag_as_required("workdir")

    def _main(argv: Sequence[str]) -> None:
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments {argv[1:]}")
        path = out.value or os.path.join(workdir.value, "curves.png")
        counts = plot(metrics.read_metrics(workdir.value), path)
        print(f"wrote {path} ({counts['reward']} reward curves, {counts['weight']} weight curves)")

    app.run(_main)


if __name__ == "__main__":
    main()
