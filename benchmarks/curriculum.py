"""python -m benchmarks curriculum --workdir=runs/demo-... [--out=benchmarks/results/curriculum.jsonl]
python -m benchmarks curriculum --derive

--workdir   How the curriculum's weights moved in a run, from its metrics.jsonl and config.json: per
            domain the mean and standard deviation of `weight/<domain>`, the mean and largest
            absolute change between consecutive logged steps, the steps at the floor and at the ceiling
            (1 - floor * (D - 1)), the jumps larger than 0.3, and how often the weight turns (the sign of a
            change of more than 0.001 differs from the previous such change): a trend turns a few times,
            noise on every other step. One JSON line, appended to --out when given.
--derive    The failure probabilities that tests/rl/test_curriculum.py's simulated-curve tests quote, derived
            without running the scheduler: every estimate is taken as normal, with the standard error that
            the discounted regression's weights (rl/curriculum.py's docstring) give under the true
            p (1 - p) / n of each step's mean, along the allocation path the rule should follow; then union
            bounds over the steps (and, for the saturated domain, Rice's bound on upcrossings of its
            t-statistic, whose consecutive values correlate at rho).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np

from benchmarks.record import emit, portable
from rl import metrics  # noqa: E402

# ----------------------------------------------------------------------------------------------------------
# Figures of a run


def weight_figures(records, floor: float) -> dict[str, dict[str, float]]:
    """domain -> figures of its logged weight (see the module docstring)."""
    steps = metrics.by_step(records)
    domains = sorted({k.split("/", 1)[1] for r in steps for k in r if k.startswith("weight/")})
    ceiling = 1.0 - floor * (len(domains) - 1)
    out = {}
    for d in domains:
        w = np.array([r[f"weight/{d}"] for r in steps if r.get(f"weight/{d}") is not None], np.float64)
        dw = np.diff(w)
        moves = np.sign(dw[np.abs(dw) > 1e-3])
        out[d] = {
            "steps": len(w),
            "mean": round(float(w.mean()), 4),
            "std": round(float(w.std()), 4),
            "mean_abs_change": round(float(np.abs(dw).mean()), 5),
            "max_abs_change": round(float(np.abs(dw).max()), 5),
            "at_floor": int(np.isclose(w, floor, atol=1e-6).sum()),
            "at_ceiling": int(np.isclose(w, ceiling, atol=1e-6).sum()),
            "jumps_over_0.3": int((np.abs(dw) > 0.3).sum()),
            "turns": int((moves[1:] != moves[:-1]).sum()),
            "first_last": [round(float(w[0]), 4), round(float(w[-1]), 4)],
        }
    return out


# ----------------------------------------------------------------------------------------------------------
# Derived failure probabilities of the simulated tests

HALF_LIFE, WINDOW, SAMPLES, TOKENS, STEPS = 48.0, 192, 128, 8, 300  # the defaults; the demo's batch


def _normal_sf(x: float) -> float:
    return 0.5 * math.erfc(x / math.sqrt(2.0))


def _coef(t: int, n: np.ndarray) -> np.ndarray:
    """The weights c of the discounted slope at step t (observations 0..t-1): slope = c @ y."""
    lo = max(0, t - WINDOW)
    x = np.arange(lo, t, dtype=np.float64)
    w = np.exp2(-(x[-1] - x) / HALF_LIFE) * n[lo:t]
    dx = x - (w @ x) / w.sum()
    c = np.zeros(len(n))
    c[lo:t] = w * dx / (w @ (dx * dx))
    return c


def _se(t: int, n: np.ndarray, p: np.ndarray) -> float:
    c = _coef(t, n)
    return float(math.sqrt((c * c * p * (1 - p) / np.maximum(n, 1)).sum()))


def _path(per_step: float, share: np.ndarray, p0: float = 0.05) -> np.ndarray:
    """p before each step of a curve rising `per_step` a step at an equal share, linear in compute."""
    return np.minimum(p0 + per_step * np.concatenate([[0.0], np.cumsum(share / 0.5)[:-1]]), 1.0)


def derive() -> dict[str, float]:
    out = {}
    # Equal curves, .0028 a step each: a's target leaves [.45, .55] when |d| - SE > .2 (sum of scores) = .4 g.
    g = 0.0028
    share = np.full(STEPS + 1, 0.5)
    n, p = share * SAMPLES, _path(g, share)
    out["equal_union_75_300"] = sum(
        2 * _normal_sf(1 + 0.4 * g / (math.sqrt(2) * _se(t, n, p))) for t in range(75, STEPS + 1)
    )
    # Twice as fast per compute: a .0025, b .00125 a step at an equal share; equal shares to step 60, then a's
    # weight rising .01 a step to 7/12. a's target <= .5 when a's score does not beat b's by SE, or a is not
    # gaining (t < 3).
    w_a = np.array([0.5 if t < 60 else min(0.5 + 0.01 * (t - 60), 7 / 12) for t in range(STEPS + 1)])
    na, nb = w_a * SAMPLES, (1 - w_a) * SAMPLES
    pa, pb = _path(0.0025, w_a), _path(0.00125, 1 - w_a)
    rate_a, rate_b = 0.0025 / (SAMPLES / 2 * TOKENS), 0.00125 / (SAMPLES / 2 * TOKENS)  # reward per token

    def twice(t):
        se_a = _se(t, na, pa) / (na[t - 1] * TOKENS)  # a score's error: the gain's over the cost per step
        se_b = _se(t, nb, pb) / (nb[t - 1] * TOKENS)
        ratio = (rate_a - rate_b) / math.hypot(se_a, se_b)
        return 1 - _normal_sf(1 - ratio) + _normal_sf(rate_a / se_a - 3), ratio

    out["twice_union_100_300"] = sum(twice(t)[0] for t in range(100, STEPS + 1))
    out["twice_d_over_se_at_100"], out["twice_d_over_se_at_150"] = twice(100)[1], twice(150)[1]
    # Saturated: a .002 a step at an equal share, b flat at .8; a's weight rising .01 a step from step 60.
    w_a = np.array([0.5 if t < 60 else min(0.5 + 0.01 * (t - 60), 0.75) for t in range(STEPS + 1)])
    na, nb = w_a * SAMPLES, (1 - w_a) * SAMPLES
    pa, pb = _path(0.002, w_a), np.full(STEPS + 1, 0.8)
    se_a = _se(150, na, pa) / (na[149] * TOKENS)
    se_b = _se(150, nb, pb) / (nb[149] * TOKENS)
    rate = 0.002 / (SAMPLES / 2 * TOKENS)
    out["saturated_lead_over_se_at_150"] = rate / math.hypot(se_a, se_b)
    out["saturated_P_no_entry_at_150"] = 1 - _normal_sf(3 - rate / math.hypot(se_a, se_b)) + _normal_sf(3)
    out["saturated_expected_exit_steps_150_300"] = (STEPS - 149) * _normal_sf(3)
    out["saturated_markov_P_11_exit_steps"] = out["saturated_expected_exit_steps_150_300"] / 11
    # Rice: P(any exit) <= P(t > 3 at 150) + sum of P(t_s <= 3 < t_s+1); for a bivariate normal with
    # correlation rho, P(X <= u < Y) = P(Y > u) - P(X > u, Y > u), the latter by one-dimensional quadrature.
    var = 1.0 / nb
    rho = max(
        float((_coef(t, nb) * _coef(t + 1, nb) * var).sum())
        / math.sqrt(float((_coef(t, nb) ** 2 * var).sum() * (_coef(t + 1, nb) ** 2 * var).sum()))
        for t in range(150, STEPS)
    )
    x = np.linspace(3.0, 12.0, 20001)
    both = np.trapezoid(  # P(X > 3, Y > 3) = int_3^inf phi(x) P(Y > 3 | x) dx
        np.exp(-x * x / 2)
        / math.sqrt(2 * math.pi)
        * np.array([_normal_sf((3 - rho * v) / math.sqrt(1 - rho * rho)) for v in x]),
        x,
    )
    out["saturated_rho"] = rho
    out["saturated_rice_P_any_exit"] = _normal_sf(3) + (STEPS - 150) * (_normal_sf(3) - float(both))
    return {k: float(f"{v:.3g}") for k, v in out.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", help="a run directory holding metrics.jsonl (and config.json)")
    ap.add_argument("--out", help="append the JSON line to this file")
    ap.add_argument("--derive", action="store_true", help="print the tests' derived failure probabilities")
    args = ap.parse_args(argv)
    if args.derive:
        print(json.dumps(derive(), indent=1))
    if args.workdir:
        with open(os.path.join(args.workdir, "config.json")) as f:
            floor = float(json.load(f)["rl"]["curriculum_floor"])
        row = {
            "bench": "curriculum",
            "workdir": portable(args.workdir),
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "floor": floor,
            "weights": weight_figures(metrics.read_metrics(args.workdir), floor),
        }
        emit(row, out=args.out)
    if not (args.derive or args.workdir):
        ap.error("give --workdir and/or --derive")


if __name__ == "__main__":
    main()
