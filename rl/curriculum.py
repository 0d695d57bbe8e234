"""Per-domain sampling weights for RL post-training (`DomainScheduler`); the env gate (`admit_domains`).

Adaptive mode spends compute where reward rises fastest per unit of compute. For each domain d:

    gain_d    slope of d's mean reward against the step: least squares over its last `window` observations,
              clipped at 0 below (a domain that stalls or regresses gets only the floor). With fewer than 2
              observations it is unknown, so optimistic: the largest known gain of the other domains (or 1).
    cost_d    mean over the same window of what d used *per step* (all of its tasks together), in tokens:
              token_cost * tokens_generated + sandbox_second_cost * sandbox_seconds, at least 1. With no
              observation yet: the mean cost of the domains that have one (1 if none).
    score_d   gain_d / cost_d. Both are per step, so the ratio is reward gained per unit of compute: a domain
              given more tasks must show a proportionally faster rise to keep its weight.
    weight_d  floor + (1 - floor * D) * share_d,   share_d = s_d ** (1 / T) / sum_e s_e ** (1 / T),
              s_d = score_d / max_e score_e, T the temperature (uniform shares when every score is 0).

Shares are proportional, not a softmax, so that a zero score earns exactly the floor; a temperature below 1
sharpens them towards the best domain, above 1 flattens them. Static mode uses the normalised
`static_weights` (uniform when None) and `update` never changes them. Everything is deterministic, and
`state_dict()` (JSON) resumes a run exactly.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

MODES = ("adaptive", "static")
_CONFIG = ("domains", "mode", "static_weights", "floor", "window", "temperature", "token_cost",
           "sandbox_second_cost", "seed")  # fmt: skip


class DomainRefused(ValueError):
    """Domains that failed the environment quality gate; `.reasons` maps each refused domain to why."""

    def __init__(self, reasons: dict[str, str]):
        self.reasons = dict(reasons)
        super().__init__("\n".join(self.reasons.values()))


def slope(steps: Sequence[float], values: Sequence[float]) -> float:
    """Least-squares slope of `values` against `steps` (at least 2 distinct steps)."""
    x, y = np.asarray(steps, np.float64), np.asarray(values, np.float64)
    if len(x) < 2:
        raise ValueError(f"slope needs at least 2 points, got {len(x)}")
    dx = x - x.mean()
    return float(dx @ (y - y.mean()) / (dx @ dx))


class DomainScheduler:
    """Sampling weights over `domains`, updated online from each domain's reward gain per unit of compute."""

    def __init__(
        self,
        domains: Sequence[str],
        *,
        mode: str = "adaptive",
        static_weights: dict[str, float] | None = None,
        floor: float = 0.05,
        window: int = 8,
        temperature: float = 1.0,
        token_cost: float = 1.0,
        sandbox_second_cost: float = 1000.0,
        seed: int = 0,
    ):
        domains = list(domains)
        num = len(domains)
        if not domains:
            raise ValueError("DomainScheduler(domains=[]): give at least one domain, e.g. ['math', 'code']")
        if len(set(domains)) != num:
            dup = sorted({d for d in domains if domains.count(d) > 1})
            raise ValueError(f"domains lists {dup} more than once; give each domain once")
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: use one of {MODES}")
        if not (floor >= 0 and floor * num <= 1 + 1e-12):
            raise ValueError(
                f"floor={floor} with {num} domains: need floor >= 0 and floor * num_domains <= 1; "
                f"use floor <= {1 / num:.4g}"
            )
        if int(window) != window or window < 2:
            raise ValueError(f"window={window}: a slope needs 2 observations; use window >= 2")
        if not temperature > 0:
            raise ValueError(f"temperature={temperature}: use a temperature > 0 (1 = proportional to score)")
        if token_cost < 0 or sandbox_second_cost < 0:
            raise ValueError(
                f"token_cost={token_cost}, sandbox_second_cost={sandbox_second_cost}: costs must be >= 0"
            )
        if static_weights is not None and mode != "static":
            raise ValueError("static_weights is only used with mode='static'; drop it or set mode='static'")
        self.domains, self.mode, self.floor, self.window = domains, mode, float(floor), int(window)
        self.temperature, self.token_cost = float(temperature), float(token_cost)
        self.sandbox_second_cost, self.seed = float(sandbox_second_cost), int(seed)
        self.static_weights = (
            None if static_weights is None else {k: float(v) for k, v in static_weights.items()}
        )
        self._static = self._normalised_static() if mode == "static" else None
        # Largest-remainder ties go to the lower rank: a seeded order, the same in every numpy version.
        digest = {d: hashlib.sha256(f"{self.seed}:{d}".encode()).hexdigest() for d in domains}
        self._tie_rank = np.argsort(np.argsort([digest[d] for d in domains], kind="stable"))
        # domain -> its last `window` observations [step, mean_reward, tokens_generated, sandbox_seconds]
        self.history: dict[str, list[list[float]]] = {d: [] for d in domains}

    def _normalised_static(self) -> dict[str, float]:
        if self.static_weights is None:
            return {d: 1.0 / len(self.domains) for d in self.domains}
        given = self.static_weights
        unknown, missing = sorted(set(given) - set(self.domains)), [d for d in self.domains if d not in given]
        if unknown or missing:
            raise ValueError(
                f"static_weights: unknown domains {unknown}, missing {missing}; give each of {self.domains} "
                "a weight (0 is ok) and no other"
            )
        bad = {d: w for d, w in given.items() if not (math.isfinite(w) and w >= 0)}
        if bad:
            raise ValueError(f"static_weights {bad}: weights must be finite and >= 0")
        total = sum(given.values())
        if total <= 0:
            raise ValueError("static_weights are all 0; give at least one domain a positive weight")
        return {d: given[d] / total for d in self.domains}

    # ------------------------------------------------------------------------------------------------------
    # Observations and weights

    def update(
        self,
        domain: str,
        *,
        step: int,
        mean_reward: float,
        tokens_generated: float,
        sandbox_seconds: float = 0.0,
    ) -> None:
        """Records `domain`'s observation for `step`: the mean reward of its episodes and the compute they
        used in total (tokens generated, sandbox seconds). One observation per domain per step."""
        if domain not in self.history:
            raise ValueError(f"update({domain!r}): unknown domain; the scheduler has {self.domains}")
        if not math.isfinite(mean_reward):
            raise ValueError(f"update({domain!r}, mean_reward={mean_reward}): the reward must be finite")
        if not (tokens_generated >= 0 and sandbox_seconds >= 0):
            raise ValueError(
                f"update({domain!r}): tokens_generated={tokens_generated} and "
                f"sandbox_seconds={sandbox_seconds} must be >= 0"
            )
        hist = self.history[domain]
        if hist and step <= hist[-1][0]:
            raise ValueError(
                f"update({domain!r}, step={step}): already observed step {hist[-1][0]}; "
                "give one observation per domain per step, in increasing steps"
            )
        hist.append([int(step), float(mean_reward), float(tokens_generated), float(sandbox_seconds)])
        del hist[: -self.window]

    def stats(self) -> dict[str, tuple[float, float, float]]:
        """domain -> (gain, cost, score), with the optimistic stand-ins for domains not yet observed."""
        gain, cost = {}, {}
        for d, hist in self.history.items():
            if len(hist) >= 2:
                gain[d] = max(0.0, slope([o[0] for o in hist], [o[1] for o in hist]))
            if hist:
                per_step = [self.token_cost * o[2] + self.sandbox_second_cost * o[3] for o in hist]
                cost[d] = max(1.0, float(np.mean(per_step)))
        out = {}
        for d in self.domains:
            g = gain.get(d, max((v for e, v in gain.items() if e != d), default=1.0))
            others = [v for e, v in cost.items() if e != d]
            c = cost.get(d, float(np.mean(others)) if others else 1.0)
            out[d] = (g, c, g / c)
        return out

    def weights(self) -> dict[str, float]:
        """domain -> sampling weight; they sum to 1 and (adaptive mode) each is at least `floor`."""
        if self._static is not None:
            return dict(self._static)
        stats = self.stats()
        score = np.array([stats[d][2] for d in self.domains])
        top = score.max()
        share = (score / top) ** (1.0 / self.temperature) if top > 0 else np.ones_like(score)
        w = self.floor + (1.0 - self.floor * len(self.domains)) * share / share.sum()
        return {d: float(x) for d, x in zip(self.domains, w)}

    def allocate(self, n: int) -> dict[str, int]:
        """Splits `n` tasks by the weights, largest remainder first (ties by a seeded order): the counts sum
        to `n`. When n >= number of domains each domain of positive weight >= floor gets 1 task first, and
        the rest are split so that every count stays as close to n * weight as that allows."""
        if int(n) != n or n < 0:
            raise ValueError(f"allocate(n={n}): n must be an integer >= 0")
        weights = self.weights()
        w = np.array([weights[d] for d in self.domains])
        reserve = np.zeros(len(w), np.int64)
        if n >= len(w):
            reserve = ((w > 0) & (w >= self.floor - 1e-12)).astype(np.int64)
        rest = int(n) - int(reserve.sum())
        quota = np.maximum(n * w - reserve, 0.0)
        if quota.sum() > 0:
            quota *= rest / quota.sum()
        quota = np.round(quota, 9)  # float noise must not decide a remainder tie
        count = np.floor(quota).astype(np.int64)
        order = sorted(range(len(w)), key=lambda i: (count[i] - quota[i], self._tie_rank[i]))
        count[order[: rest - int(count.sum())]] += 1
        return {d: int(c) for d, c in zip(self.domains, reserve + count)}

    def metrics(self) -> dict[str, float]:
        """Flat logging dict: `curriculum/<domain>/{weight,gain,cost,score}`."""
        weights, out = self.weights(), {}
        for d, (gain, cost, score) in self.stats().items():
            for name, value in (("weight", weights[d]), ("gain", gain), ("cost", cost), ("score", score)):
                out[f"curriculum/{d}/{name}"] = float(value)
        return out

    # ------------------------------------------------------------------------------------------------------
    # Checkpointing

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable: the configuration and each domain's windowed history."""
        state = {k: getattr(self, k) for k in _CONFIG}
        state["domains"] = list(self.domains)
        state["history"] = {d: [list(o) for o in h] for d, h in self.history.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the history saved by `state_dict`; the configuration must be the saved one."""
        differ = [f"{k}: saved {state.get(k)!r}, here {getattr(self, k)!r}" for k in _CONFIG
                  if state.get(k) != getattr(self, k)]  # fmt: skip
        if differ:
            raise ValueError(
                f"load_state_dict: the configuration differs ({'; '.join(differ)}); resume the saved one "
                "with DomainScheduler.from_state_dict(state)"
            )
        saved = state["history"]
        self.history = {d: [[int(o[0]), *map(float, o[1:])] for o in saved[d]] for d in self.domains}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> DomainScheduler:
        sched = cls(**{k: state[k] for k in _CONFIG})
        sched.load_state_dict(state)
        return sched


# ----------------------------------------------------------------------------------------------------------
# The environment quality gate


def _failures(report: Any) -> str:
    """The failing checks of an `envs.qa.Report` or alike (`failed()`, `checks` with `name`, `detail`)."""
    details = {c.name: c.detail for c in getattr(report, "checks", [])}
    failed = [f"{name} ({details[name]})" if details.get(name) else name for name in report.failed()]
    return ", ".join(failed) or "no checks ran"


def admit_domains(domains: Sequence[str], *, gate: Callable[[str], Any] | None = None) -> list[str]:
    """`domains` when every one passes `gate(domain)` (default `envs.qa.run_checks`); otherwise raises
    `DomainRefused` naming each refused domain and its failing checks."""
    if gate is None:
        from envs import qa  # imported here: the gate loads the domains, the scheduler alone needs none

        gate = qa.run_checks
    reasons = {}
    for d in domains:
        try:
            why = "" if (report := gate(d)).passed else _failures(report)
        except Exception as e:  # a gate that crashes on a domain refuses it, and says how
            why = f"the gate raised {type(e).__name__}: {e}"
        if why:
            reasons[d] = (
                f"domain {d!r} failed the quality gate: {why}; "
                f"run `python -m envs.qa --domain={d}` for the report"
            )
    if reasons:
        raise DomainRefused(reasons)
    return list(domains)
