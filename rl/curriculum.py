"""Per-domain sampling weights for RL post-training (`DomainScheduler`); the env gate (`admit_domains`).

Adaptive mode spends compute where reward rises fastest per unit of compute, and moves the weights only as far
as the evidence carries. Every step each domain drawn reports the mean reward of all its samples (kept or
filtered), how many there were (n) and the compute they used. For each domain d:

    gain_d, se_d   slope of d's mean reward against the step, and its standard error: least squares over d's
                   last `window` observations, observation i weighted by w_i = delta_i * n_i with the discount
                   delta_i = 2 ** (-age_i / half_life) (age in steps behind d's latest observation), so that
                   the estimate follows a bending learning curve. The residuals r_i give the per-sample noise,
                   sigma^2 = N / (N - 2) * sum_i delta_i n_i r_i^2 / sum_i delta_i with N = (sum delta)^2 /
                   sum delta^2 (the discounted number of observations), and se^2 = sigma^2 * sum_i delta_i^2
                   n_i dx_i^2 / Sxx^2 (the sandwich variance: the discount makes the weights no longer inverse
                   variances). Unweighted and undiscounted this is the textbook OLS slope and its error.
                   Unknown (se = inf) with fewer than 3 distinct steps.
    cost_d         compute per step: the discounted mean over the same observations of token_cost * tokens +
                   sandbox_second_cost * sandbox_seconds, at least 1; with no observation the mean over the
                   domains that have one (1 if none).
    score_d        gain_d / cost_d, reward gained per unit of compute, with the standard error se_d / cost_d.
                   A domain's score counts once it has `warmup` observations; before that it is unknown.

The target weights follow from the scores and their errors, never from the bare estimates (z-levels below are
in standard errors; the lead of e over d, score_e - score_d, has the error hypot(se_e, se_d)):
    gaining        score_d > saturation_z * se_d: a gain shown.
    saturated      (`saturated`) d is not gaining while a gaining domain leads it by more than saturation_z;
                   once saturated it stays so while it is not gaining and a gaining domain still leads it at
                   all (lead > 0), so that one lucky stretch of its noisy estimate does not bring it back.
                   Its share is 0: it keeps only the floor.
    shares         (`target_shares`) equal while no domain is gaining (a ratio of gains indistinguishable from
                   0 means nothing). Otherwise over the known domains that are not saturated, with m the mean
                   of their scores, each score's deviation from m is shrunk by z standard errors of that
                   deviation, s_d = m + sign(dev_d) * max(|dev_d| - z * sd_d, 0) (two domains: their
                   difference shrinks by z * hypot(se_a, se_b), to 0 when it is within that), where
                   sd_d^2 = se_d^2 (1 - 2 / k) + sum_e se_e^2 / k^2 over those k domains; unknown domains
                   get m. share_d = max(s_d, 0) ** (1 / T) / sum_e max(s_e, 0) ** (1 / T), T the temperature
                   (equal over the unsaturated domains when every s_d <= 0).
    target_d       floor + (1 - floor * D) * share_d.

`advance()` (once per step, after its updates; `observe` does both) moves the weights a bounded step towards
the target: w <- w + a (target - w) with a = min(1, max_step / max_d |target_d - w_d|), so no weight moves
more than `max_step` per step, they sum to 1 and each stays >= floor. They start equal. Static mode uses the
normalised `static_weights` (uniform when None) and never moves them, but still measures every domain.
Everything is deterministic, and `state_dict()` (JSON) resumes a run exactly.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from configs.errors import UserError

MODES = ("adaptive", "static")
_CONFIG = ("domains", "mode", "static_weights", "floor", "window", "half_life", "warmup", "z", "saturation_z",
           "max_step", "temperature", "token_cost", "sandbox_second_cost", "seed")  # fmt: skip


class DomainRefused(UserError, ValueError):
    """Domains that failed the environment quality gate; `.reasons` maps each refused domain to why."""

    def __init__(self, reasons: dict[str, str]):
        self.reasons = dict(reasons)
        super().__init__("\n".join(self.reasons.values()))


class Estimate(NamedTuple):
    """One domain's reward gain per step and its standard error, its compute per step, and the score (gain per
    unit of compute) with its standard error. gain is NaN below 2 observations, the errors inf below 3."""

    gain: float
    gain_se: float
    cost: float
    score: float
    score_se: float


def discounted_slope(
    steps: Sequence[float],
    values: Sequence[float],
    samples: Sequence[float] | None = None,
    *,
    half_life: float = math.inf,
) -> tuple[float, float]:
    """(slope, standard error) of `values` against `steps`, each value the mean of `samples[i]` samples (1
    when None) and discounted by its age behind the last step (the module docstring gives the formulas). The
    slope is NaN with fewer than 2 distinct steps, the error inf with fewer than 3."""
    t_N, y_N = np.asarray(steps, np.float64), np.asarray(values, np.float64)
    n_N = np.ones_like(t_N) if samples is None else np.asarray(samples, np.float64)
    if len(np.unique(t_N)) < 2:
        return math.nan, math.inf
    delta_N = np.exp2(-(t_N.max() - t_N) / half_life)
    w_N = delta_N * n_N
    dx_N = t_N - (w_N @ t_N) / w_N.sum()
    sxx = w_N @ (dx_N * dx_N)
    ym = (w_N @ y_N) / w_N.sum()
    gain = float(w_N @ (dx_N * (y_N - ym)) / sxx)
    count = delta_N.sum() ** 2 / (delta_N @ delta_N)
    if len(np.unique(t_N)) < 3 or count <= 2:
        return gain, math.inf
    r_N = y_N - ym - gain * dx_N
    sigma2 = count / (count - 2) * (delta_N * n_N) @ (r_N * r_N) / delta_N.sum()
    var = sigma2 * (delta_N * delta_N * n_N) @ (dx_N * dx_N) / sxx**2
    return gain, float(math.sqrt(var))


def _known(score: Sequence[float], se: Sequence[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(known, score, se) as arrays, unknown domains (se inf) given score 0 and se 0."""
    score_D, se_D = np.asarray(score, np.float64), np.asarray(se, np.float64)
    known_D = np.isfinite(se_D)
    return known_D, np.where(known_D, score_D, 0.0), np.where(known_D, se_D, 0.0)


def saturated(
    score: Sequence[float],
    se: Sequence[float],
    previous: Sequence[bool],
    *,
    saturation_z: float = 3.0,
) -> np.ndarray:
    """Which domains are saturated now, given their scores, standard errors (inf: unknown) and which were
    saturated at the last step (the rule in the module docstring)."""
    known_D, score_D, se_D = _known(score, se)
    gaining_D = known_D & (score_D > saturation_z * se_D)
    lead_DD = score_D[:, None] - score_D[None, :]  # [e, d]: e's lead over d
    se_DD = np.hypot(se_D[:, None], se_D[None, :])  # the standard error of that lead
    enter_D = (gaining_D[:, None] & (lead_DD > saturation_z * se_DD)).any(axis=0)
    stay_D = np.asarray(previous, bool) & (gaining_D[:, None] & (lead_DD > 0)).any(axis=0)
    return known_D & ~gaining_D & (enter_D | stay_D)


def target_shares(
    score: Sequence[float],
    se: Sequence[float],
    is_saturated: Sequence[bool],
    *,
    z: float = 1.0,
    saturation_z: float = 3.0,
    temperature: float = 1.0,
) -> np.ndarray:
    """Shares (summing to 1) from each domain's score and standard error (inf: unknown) by the rule in the
    module docstring: saturated domains get 0; the others equal shares while no gain is shown, else their
    scores shrunk towards their mean."""
    known_D, score_D, se_D = _known(score, se)
    sat_D = np.asarray(is_saturated, bool)
    rest_D = known_D & ~sat_D
    s_D = np.ones_like(score_D)
    if (known_D & (score_D > saturation_z * se_D)).any():
        k = rest_D.sum()
        mean = score_D[rest_D].mean()
        dev_D = np.where(rest_D, score_D - mean, 0.0)
        var_D = np.where(rest_D, se_D, 0.0) ** 2 * (1.0 - 2.0 / k) + (se_D[rest_D] ** 2).sum() / k**2
        s_D = mean + np.sign(dev_D) * np.maximum(np.abs(dev_D) - z * np.sqrt(np.maximum(var_D, 0.0)), 0.0)
        s_D = np.maximum(s_D, 0.0) ** (1.0 / temperature)
    s_D = np.where(sat_D, 0.0, s_D)
    if s_D.sum() == 0:  # every shrunk score <= 0 (the others regress, noisily): nothing to choose between
        s_D = (~sat_D).astype(np.float64)
    return s_D / s_D.sum()


class DomainScheduler:
    """Sampling weights over `domains`, moved step by step towards the domains whose reward demonstrably rises
    fastest per unit of compute."""

    def __init__(
        self,
        domains: Sequence[str],
        *,
        mode: str = "adaptive",
        static_weights: dict[str, float] | None = None,
        floor: float = 0.05,
        window: int = 192,
        half_life: float = 48.0,
        z: float = 1.0,
        warmup: int = 16,
        saturation_z: float = 3.0,
        max_step: float = 0.01,
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
        if int(window) != window or window < 3:
            raise ValueError(
                f"window={window}: a slope's standard error needs 3 observations; use window >= 3"
            )
        if not half_life > 0:
            raise ValueError(f"half_life={half_life}: use a half-life > 0 steps (inf: no discount)")
        if not (z >= 0 and math.isfinite(z)):
            raise ValueError(f"z={z}: use a finite z >= 0 (standard errors a difference must exceed)")
        if not (saturation_z >= 0 and math.isfinite(saturation_z)):
            raise ValueError(f"saturation_z={saturation_z}: use a finite saturation_z >= 0")
        if int(warmup) != warmup or not 0 <= warmup <= window:
            raise ValueError(
                f"warmup={warmup}: use an integer in [0, window={window}] (observations before a score "
                "counts; the history holds at most `window`)"
            )
        if not 0 < max_step <= 1:
            raise ValueError(
                f"max_step={max_step}: use 0 < max_step <= 1 (the largest change of a weight per step)"
            )
        if not temperature > 0:
            raise ValueError(f"temperature={temperature}: use a temperature > 0 (1 = proportional to score)")
        if token_cost < 0 or sandbox_second_cost < 0:
            raise ValueError(
                f"token_cost={token_cost}, sandbox_second_cost={sandbox_second_cost}: costs must be >= 0"
            )
        if static_weights is not None and mode != "static":
            raise ValueError("static_weights is only used with mode='static'; drop it or set mode='static'")
        self.domains, self.mode, self.floor, self.window = domains, mode, float(floor), int(window)
        self.half_life, self.z, self.max_step = float(half_life), float(z), float(max_step)
        self.warmup, self.saturation_z = int(warmup), float(saturation_z)
        self.temperature, self.token_cost = float(temperature), float(token_cost)
        self.sandbox_second_cost, self.seed = float(sandbox_second_cost), int(seed)
        self.static_weights = (
            None if static_weights is None else {k: float(v) for k, v in static_weights.items()}
        )
        self._static = self._normalised_static() if mode == "static" else None
        # Largest-remainder ties go to the lower rank: a seeded order, the same in every numpy version.
        digest = {d: hashlib.sha256(f"{self.seed}:{d}".encode()).hexdigest() for d in domains}
        self._tie_rank = np.argsort(np.argsort([digest[d] for d in domains], kind="stable"))
        # domain -> its last `window` observations [step, mean_reward, samples, tokens, sandbox_seconds]
        self.history: dict[str, list[list[float]]] = {d: [] for d in domains}
        self._weights_D = np.full(num, 1.0 / num)  # adaptive mode's current weights, moved by `advance`
        self._saturated_D = np.zeros(num, bool)  # which domains `advance` last found saturated

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
        samples: int = 1,
    ) -> None:
        """Records `domain`'s observation for `step`: the mean reward of its `samples` episodes and the
        compute they used in total (tokens generated, sandbox seconds). One observation per domain per step;
        the weights move only in `advance`."""
        if domain not in self.history:
            raise ValueError(f"update({domain!r}): unknown domain; the scheduler has {self.domains}")
        if not math.isfinite(mean_reward):
            raise ValueError(f"update({domain!r}, mean_reward={mean_reward}): the reward must be finite")
        if not (tokens_generated >= 0 and sandbox_seconds >= 0):
            raise ValueError(
                f"update({domain!r}): tokens_generated={tokens_generated} and "
                f"sandbox_seconds={sandbox_seconds} must be >= 0"
            )
        if int(samples) != samples or samples < 1:
            raise ValueError(f"update({domain!r}, samples={samples}): a mean needs an integer >= 1 samples")
        hist = self.history[domain]
        if hist and step <= hist[-1][0]:
            raise ValueError(
                f"update({domain!r}, step={step}): already observed step {hist[-1][0]}; "
                "give one observation per domain per step, in increasing steps"
            )
        hist.append(
            [int(step), float(mean_reward), int(samples), float(tokens_generated), float(sandbox_seconds)]
        )
        del hist[: -self.window]

    def observe(self, step: int, draws: Mapping[str, Any]) -> None:
        """One step: `update` with each domain's draw (anything with `samples`, `mean_reward`, `tokens` and
        `sandbox_seconds`, as `rl.rollout.DomainDraw`; draws of no sample are skipped), then `advance`."""
        for d, draw in draws.items():
            if draw.samples:
                self.update(
                    d,
                    step=step,
                    mean_reward=draw.mean_reward,
                    tokens_generated=float(draw.tokens),
                    sandbox_seconds=draw.sandbox_seconds,
                    samples=draw.samples,
                )
        self.advance()

    def stats(self) -> dict[str, Estimate]:
        """domain -> its `Estimate`; a domain not yet observed costs the mean of the others' costs."""
        gain, cost = {}, {}
        for d, hist in self.history.items():
            if hist:
                step_N, reward_N, n_N, tokens_N, seconds_N = np.asarray(hist, np.float64).T
                gain[d] = discounted_slope(step_N, reward_N, n_N, half_life=self.half_life)
                delta_N = np.exp2(-(step_N[-1] - step_N) / self.half_life)
                per_step_N = self.token_cost * tokens_N + self.sandbox_second_cost * seconds_N
                cost[d] = max(1.0, float(delta_N @ per_step_N / delta_N.sum()))
        out = {}
        for d in self.domains:
            g, se = gain.get(d, (math.nan, math.inf))
            others = [v for e, v in cost.items() if e != d]
            c = cost.get(d, float(np.mean(others)) if others else 1.0)
            out[d] = Estimate(g, se, c, g / c, se / c)
        return out

    def _target(self) -> tuple[np.ndarray, np.ndarray]:
        """(target weights, saturated) from the estimates and the domains saturated at the last step."""
        stats = self.stats()
        score_D = [stats[d].score for d in self.domains]
        se_D = [stats[d].score_se if len(self.history[d]) >= self.warmup else math.inf for d in self.domains]
        sat_D = saturated(score_D, se_D, self._saturated_D, saturation_z=self.saturation_z)
        share_D = target_shares(
            score_D, se_D, sat_D, z=self.z, saturation_z=self.saturation_z, temperature=self.temperature
        )
        return self.floor + (1.0 - self.floor * len(self.domains)) * share_D, sat_D

    def target(self) -> dict[str, float]:
        """domain -> the weight the evidence so far asks for (the module docstring gives the rule); static
        mode: the static weights."""
        if self._static is not None:
            return dict(self._static)
        return {d: float(x) for d, x in zip(self.domains, self._target()[0])}

    def advance(self) -> None:
        """Moves the adaptive weights towards `target()` by at most `max_step` per domain and records which
        domains are saturated (static: no-op)."""
        if self._static is not None:
            return
        target_D, self._saturated_D = self._target()
        gap = float(np.abs(target_D - self._weights_D).max())
        if gap > 0:
            a = min(1.0, self.max_step / gap)
            self._weights_D = (1.0 - a) * self._weights_D + a * target_D

    def weights(self) -> dict[str, float]:
        """domain -> sampling weight; they sum to 1 and (adaptive mode) each is at least `floor`."""
        if self._static is not None:
            return dict(self._static)
        return {d: float(x) for d, x in zip(self.domains, self._weights_D)}

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
        """Flat logging dict: `weight/<domain>` and `curriculum/<domain>/{target,saturated,gain,gain_se,cost,
        score,score_se}` (a gain once known, its errors once finite; saturated 1 or 0, as of `advance`)."""
        out = {f"weight/{d}": w for d, w in self.weights().items()}
        target = self.target()
        for d, est, sat in zip(self.domains, self.stats().values(), self._saturated_D):
            out[f"curriculum/{d}/target"] = target[d]
            out[f"curriculum/{d}/saturated"] = float(sat)
            for name, value in est._asdict().items():
                if math.isfinite(value):
                    out[f"curriculum/{d}/{name}"] = float(value)
        return out

    # ------------------------------------------------------------------------------------------------------
    # Checkpointing

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable: the configuration, each domain's windowed history, weights and saturation."""
        state = {k: getattr(self, k) for k in _CONFIG}
        state["domains"] = list(self.domains)
        state["history"] = {d: [list(o) for o in h] for d, h in self.history.items()}
        state["weights"] = [float(x) for x in self._weights_D]
        state["saturated"] = [d for d, s in zip(self.domains, self._saturated_D) if s]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what `state_dict` saved; the configuration must be the saved one."""
        differ = [f"{k}: saved {state.get(k)!r}, here {getattr(self, k)!r}" for k in _CONFIG
                  if state.get(k) != getattr(self, k)]  # fmt: skip
        if differ:
            raise ValueError(
                f"load_state_dict: the configuration differs ({'; '.join(differ)}); resume the saved one "
                "with DomainScheduler.from_state_dict(state)"
            )
        saved = state["history"]
        self.history = {d: [[int(o[0]), float(o[1]), int(o[2]), *map(float, o[3:])] for o in saved[d]]
                        for d in self.domains}  # fmt: skip
        self._weights_D = np.array(state["weights"], np.float64)
        self._saturated_D = np.array([d in state["saturated"] for d in self.domains])

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> DomainScheduler:
        sched = cls(**{k: state[k] for k in _CONFIG})
        sched.load_state_dict(state)
        return sched


#  config field of rl (configs/grpo.py) -> DomainScheduler argument; rl.curriculum is the mode
CONFIG_FIELDS = {
    "curriculum_floor": "floor",
    "curriculum_window": "window",
    "curriculum_half_life": "half_life",
    "curriculum_warmup": "warmup",
    "curriculum_z": "z",
    "curriculum_saturation_z": "saturation_z",
    "curriculum_max_step": "max_step",
    "curriculum_temperature": "temperature",
    "curriculum_token_cost": "token_cost",
    "curriculum_sandbox_second_cost": "sandbox_second_cost",
}


def from_config(rl_cfg: Any, domains: Sequence[str], *, seed: int = 0) -> DomainScheduler:
    """The one place the main job's config becomes a `DomainScheduler` (rl.train, rl.validate): rl.curriculum
    (the mode), rl.static_weights (static mode; empty: uniform) and the `CONFIG_FIELDS`. A bad value raises
    ValueError naming its field (`rl.curriculum_half_life=0.0: ...`)."""
    kwargs = {arg: rl_cfg[field] for field, arg in CONFIG_FIELDS.items()}
    if rl_cfg.curriculum == "static":
        kwargs["static_weights"] = dict(rl_cfg.static_weights) or None
    try:
        return DomainScheduler(domains, mode=rl_cfg.curriculum, seed=seed, **kwargs)
    except ValueError as e:
        msg = str(e)
        for field, arg in {**CONFIG_FIELDS, "curriculum": "mode"}.items():
            if msg.startswith(f"{arg}="):
                raise ValueError(f"rl.{field}{msg[len(arg) :]}") from None
        raise


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
        # imported here: the gate loads the domains, the scheduler alone needs none
        from envs.qa import gate as qa

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
