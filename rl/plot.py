"""python -m rl.plot --workdir=runs/tiny [--out=runs/tiny/curves.png]

Training curves from `<workdir>/metrics.jsonl` (key names in `rl/metrics.py`) as a PNG with three panels
against the step: the mean reward per domain (`reward/<domain>`, with held-out `eval/<domain>/pass@1` as
markers when the run logged them); the curriculum's domain weights (`weight/<domain>`) with the targets they
move towards (`curriculum/<domain>/target`, dashed); and each domain's reward-gain estimate, the evidence the
weights follow (`curriculum/<domain>/gain` per step, in a band of +-2 standard errors `gain_se`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rl import metrics

_REWARD = re.compile(r"^reward/(?P<domain>[^/]+)$")
_WEIGHT = re.compile(r"^weight/(?P<domain>[^/]+)$")
_EVAL = re.compile(r"^eval/(?P<domain>[^/]+)/pass@1$")
_TARGET = re.compile(r"^curriculum/(?P<domain>[^/]+)/target$")
_GAIN = re.compile(r"^curriculum/(?P<domain>[^/]+)/gain$")
_GAIN_SE = re.compile(r"^curriculum/(?P<domain>[^/]+)/gain_se$")
BAND_Z = 2.0  # the gain panel's band: gain +- BAND_Z standard errors


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


def gain_bands(
    records: Sequence[Mapping[str, Any]], z: float = BAND_Z
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """domain -> (steps, gain, gain - z se, gain + z se) over the steps that logged both the gain and its
    standard error (a domain's error is logged once it is finite)."""
    gains, errors = series(records, _GAIN), series(records, _GAIN_SE)
    out = {}
    for domain, (steps, gain) in gains.items():
        se_at = dict(zip(*errors.get(domain, ([], []))))
        keep = [i for i, s in enumerate(steps) if s in se_at]
        if keep:
            step_N = np.array([steps[i] for i in keep])
            gain_N = np.array([gain[i] for i in keep], np.float64)
            se_N = np.array([se_at[s] for s in step_N], np.float64)
            out[domain] = (step_N, gain_N, gain_N - z * se_N, gain_N + z * se_N)
    return out


def plot(records: Sequence[Mapping[str, Any]], out_path: str | os.PathLike) -> dict[str, int]:
    """Draws the three panels to `out_path` (PNG); returns the number of reward, eval and weight curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rewards, weights, evals = series(records, _REWARD), series(records, _WEIGHT), series(records, _EVAL)
    targets, bands = series(records, _TARGET), gain_bands(records)
    fig, (ax_r, ax_w, ax_g) = plt.subplots(3, 1, figsize=(8, 10), sharex=True)
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
            (line,) = ax_w.plot(steps, values, label=domain, color=colors.get(domain))
            colors.setdefault(domain, line.get_color())
        for domain, (steps, values) in targets.items():
            ax_w.plot(steps, values, "--", lw=0.8, color=colors.get(domain), label=f"{domain} target")
        ax_w.set_ylabel("sampling weight")
        ax_w.set_ylim(0.0, 1.0)
        ax_w.set_title("curriculum domain weights (dashed: the target they move towards)")
        for domain, (steps, gain, lo, hi) in bands.items():
            ax_g.plot(steps, gain, label=domain, color=colors.get(domain))
            ax_g.fill_between(steps, lo, hi, alpha=0.2, color=colors.get(domain), lw=0)
        if bands:
            ax_g.axhline(0.0, color="black", lw=0.6)
            ax_g.set_ylim(*_robust_limits(bands))
        ax_g.set_ylabel("reward gain per step")
        ax_g.set_xlabel("step")
        ax_g.set_title(f"curriculum gain estimates (band: +-{BAND_Z:g} standard errors)")
        for ax, curves in ((ax_r, rewards or evals), (ax_w, weights), (ax_g, bands)):
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


def _robust_limits(bands: Mapping[str, tuple[np.ndarray, ...]]) -> tuple[float, float]:
    """y-limits holding 90% of the band's edges: the first observations' errors are huge and would flatten
    everything else."""
    lo = float(np.quantile(np.concatenate([b[2] for b in bands.values()]), 0.05))
    hi = float(np.quantile(np.concatenate([b[3] for b in bands.values()]), 0.95))
    pad = 0.05 * (hi - lo) or 1e-3
    return float(lo - pad), float(hi + pad)


def main() -> None:
    from absl import flags

    from configs import cli
    from configs.errors import UserError, require

    workdir = flags.DEFINE_string("workdir", None, "Run directory holding metrics.jsonl.")
    out = flags.DEFINE_string("out", None, "PNG to write (default: <workdir>/curves.png).")
    flags.mark_flag_as_required("workdir")

    def _main(argv: Sequence[str]) -> None:
        if len(argv) > 1:
            raise UserError(f"unexpected arguments {list(argv[1:])}; flags look like --workdir=DIR")
        require("matplotlib", "python -m rl.plot")
        if not os.path.isfile(os.path.join(workdir.value, metrics.METRICS_FILE)):
            raise UserError(
                f"--workdir={workdir.value} holds no {metrics.METRICS_FILE}: not a run of rl.train"
            )
        path = out.value or os.path.join(workdir.value, "curves.png")
        counts = plot(metrics.read_metrics(workdir.value), path)
        print(f"wrote {path} ({counts['reward']} reward curves, {counts['weight']} weight curves)")

    cli.run(_main)


if __name__ == "__main__":
    main()
