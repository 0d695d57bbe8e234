"""Pearson's chi-square of sampled token tuples against their exact law, shared by the engine's exactness
tests (tests/inference/test_engine.py, tests/inference/test_mtp_drafter.py)."""


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
