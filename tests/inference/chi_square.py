"""Pearson's chi-square of sampled token tuples against their exact law, and the engine runs it checks,
shared by the engine's exactness tests (tests/inference/test_engine.py, tests/inference/test_mtp_drafter.py).

Each test samples once with exact verification (a rejected draft resamples from the residual) and once with
the biased variant (it resamples from p), whose power against the exact law it computes first: the exact
run must pass the test and the biased run must fail it."""

import numpy as np
import scipy.stats

from inference.engine import Engine


def chi_square(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """(statistic, degrees of freedom) over the cells with expected count >= 5, the rest pooled into one."""
    cells = sorted(probs, key=probs.get, reverse=True)
    big = [c for c in cells if probs[c] * n >= 5]
    rest = [c for c in cells if c not in big]
    obs = [counts.get(c, 0) for c in big] + [sum(counts.get(c, 0) for c in rest)]
    exp = [probs[c] * n for c in big] + [sum(probs[c] for c in rest) * n]
    assert sum(counts.values()) == n and set(counts) <= set(probs), "a sample outside the support"
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    return stat, len(big) - (0 if rest else 1)


def check_fits(counts: dict, probs: dict, n: int, alpha: float) -> None:
    """The level-`alpha` test accepts `counts` as `n` samples of `probs`."""
    stat, dof = chi_square(counts, probs, n)
    assert stat < scipy.stats.chi2.ppf(1 - alpha, dof), (stat, dof)


def check_rejects(counts: dict, probs: dict, n: int, alpha: float) -> None:
    """The level-`alpha` test rejects `counts` as `n` samples of `probs`."""
    stat, dof = chi_square(counts, probs, n)
    assert stat > scipy.stats.chi2.ppf(1 - alpha, dof), (stat, dof)


def power_against(p: np.ndarray, biased: np.ndarray, n: int, alpha: float) -> tuple[float, float]:
    """(power, noncentrality) of the level-`alpha` test of the law `p` against `n` samples of the law
    `biased` (arrays over the same cells), over p's support."""
    support = p > 0
    lam = n * np.sum((biased[support] - p[support]) ** 2 / p[support])
    df = int(support.sum()) - 1
    return 1 - scipy.stats.ncx2.cdf(scipy.stats.chi2.ppf(1 - alpha, df), df, lam), lam


def first_tokens(counts: dict) -> dict:
    """The counts of the first tokens alone, keyed by 1-tuples."""
    first = {}
    for (a, _), k in counts.items():
        first[(a,)] = first.get((a,), 0) + k
    return first


def sample_counts(cfg, params, ecfg, make_draft, prompt, sp, resample_from: str) -> tuple[dict, float]:
    """({completion tokens: count}, acceptance rate) of `prompt` sampled under `sp` by an engine on `ecfg`
    drafting with `make_draft()`, whose verification resamples a rejected draft from `resample_from`
    ("residual": exact, "p": the biased variant)."""
    eng = Engine(cfg, params, ecfg, draft=make_draft())
    eng._resample_from = resample_from
    eng._build_steps()
    counts = {}
    for c in eng.generate([prompt], sp):
        counts[tuple(c.tokens)] = counts.get(tuple(c.tokens), 0) + 1
    return counts, eng.stats()["acceptance_rate"]
