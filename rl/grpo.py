"""GRPO as small pure functions, registered by name so a config picks each variant with a string.

Variants: GRPO (group-std advantages, token ratio), Dr. GRPO (`std="none"`, `seq-mean-token-sum-norm`),
DAPO (clip-higher: separate `clip_low`/`clip_high`, `token-mean`), GSPO (`ratio="sequence"`), truncated
importance sampling for batches sampled by an older policy, and k1/k3 KL penalties to a reference policy.

Dimension key:
  B: sequences in the batch (B = G * n)
  T: token positions
  V: vocabulary
  G: groups (one prompt each)
  N: samples per group (n, `group_size`)

Every `*_BT` array is aligned to token positions: `logp_BT[:, t]` is the log-prob of token t, and `mask_BT`
(bool or float) is 1 on the completion tokens that are trained on. All math is f32.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

Array = jax.Array

ADVANTAGES: dict[str, Callable[..., Array]] = {}
RATIOS: dict[str, Callable[..., Array]] = {}
AGGREGATIONS: dict[str, Callable[..., Array]] = {}
KL: dict[str, Callable[..., Array]] = {}
REGISTRIES = {"advantages": ADVANTAGES, "ratio": RATIOS, "aggregation": AGGREGATIONS, "kl": KL}


def register(kind: str, name: str) -> Callable[[Callable], Callable]:
    """Decorator: `@register("aggregation", "my-mean")` makes the function selectable by that name."""
    registry = lookup(REGISTRIES, kind, "kind")

    def decorate(fn: Callable) -> Callable:
        if name in registry:
            raise ValueError(f"{kind} {name!r} is already registered")
        registry[name] = fn
        return fn

    return decorate


def lookup(registry: dict[str, Any], name: str, arg: str) -> Any:
    """`registry[name]`, or a ValueError naming the argument and the valid options."""
    if name not in registry:
        raise ValueError(f"{arg}={name!r} is unknown; choose one of {sorted(registry)}")
    return registry[name]


def _f32(x: Array) -> Array:
    return jnp.asarray(x).astype(jnp.float32)


# --- Advantages: (rewards_GN, eps) -> scaled advantages_GN -------------------------------------------------


@register("advantages", "group")
def _std_group(rewards_GN: Array, eps: float) -> Array:
    centred_GN = rewards_GN - rewards_GN.mean(axis=1, keepdims=True)
    return centred_GN / (rewards_GN.std(axis=1, keepdims=True) + eps)


@register("advantages", "batch")
def _std_batch(rewards_GN: Array, eps: float) -> Array:
    centred_GN = rewards_GN - rewards_GN.mean(axis=1, keepdims=True)
    return centred_GN / (rewards_GN.std() + eps)


@register("advantages", "none")
def _std_none(rewards_GN: Array, eps: float) -> Array:
    del eps  # Dr. GRPO: dividing by the std up-weights too-easy and too-hard prompts.
    return rewards_GN - rewards_GN.mean(axis=1, keepdims=True)


def group_advantages(rewards_B: Array, group_size: int, *, std: str = "group", eps: float = 1e-6) -> Array:
    """Reward minus its group's mean, scaled by `std`; groups are `group_size` consecutive rows."""
    (batch,) = rewards_B.shape
    if group_size <= 0 or batch % group_size:
        raise ValueError(f"rewards_B has {batch} rows, not a multiple of group_size={group_size}")
    fn = lookup(ADVANTAGES, std, "std")
    return fn(_f32(rewards_B).reshape(batch // group_size, group_size), eps).reshape(batch)


def token_logprobs(logits_BTV: Array, tokens_BT: Array, *, temperature: float = 1.0) -> Array:
    """logp_BT[:, t] = log p(tokens[:, t] | tokens[:, <t]) from logits[:, t - 1] / temperature; 0 at t = 0."""
    logits_BTV = _f32(logits_BTV) / temperature
    # Position t predicts token t + 1; rolling the [B, T] targets avoids slicing (copying) [B, T, V] logits.
    next_BT = jnp.roll(tokens_BT, -1, axis=1)
    picked_BT = jnp.take_along_axis(logits_BTV, next_BT[:, :, None], axis=-1)[:, :, 0]
    logp_next_BT = picked_BT - jax.nn.logsumexp(logits_BTV, axis=-1)
    logp_BT = jnp.roll(logp_next_BT, 1, axis=1)  # The wrapped-around value lands on t = 0 and is zeroed.
    return logp_BT.at[:, 0].set(0.0)


# --- Ratios: (logp_BT, old_logp_BT, mask_BT) -> ratio_BT --------------------------------------------------


@register("ratio", "token")
def _token_ratio(logp_BT: Array, old_logp_BT: Array, mask_BT: Array) -> Array:
    del mask_BT
    return jnp.exp(logp_BT - old_logp_BT)


@register("ratio", "sequence")
def _sequence_ratio(logp_BT: Array, old_logp_BT: Array, mask_BT: Array) -> Array:
    # GSPO-token: the value is the sequence's geometric-mean ratio s_B, the gradient s_B * d logp per token.
    num_B = mask_BT.sum(axis=1)
    log_s_B = ((logp_BT - old_logp_BT) * mask_BT).sum(axis=1) / jnp.maximum(num_B, 1.0)
    s_B = jax.lax.stop_gradient(jnp.exp(log_s_B))
    return s_B[:, None] * jnp.exp(logp_BT - jax.lax.stop_gradient(logp_BT))


# --- Aggregations: (x_BT, mask_BT, max_tokens) -> scalar ---------------------------------------------------


@register("aggregation", "token-mean")
def _token_mean(x_BT: Array, mask_BT: Array, max_tokens: int | None) -> Array:
    del max_tokens
    return (x_BT * mask_BT).sum() / jnp.maximum(mask_BT.sum(), 1.0)


@register("aggregation", "seq-mean-token-mean")
def _seq_mean_token_mean(x_BT: Array, mask_BT: Array, max_tokens: int | None) -> Array:
    del max_tokens
    num_B = mask_BT.sum(axis=1)
    seq_B = (x_BT * mask_BT).sum(axis=1) / jnp.maximum(num_B, 1.0)
    has_B = (num_B > 0).astype(jnp.float32)  # Sequences without trained tokens are left out of the mean.
    return (seq_B * has_B).sum() / jnp.maximum(has_B.sum(), 1.0)


@register("aggregation", "seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(x_BT: Array, mask_BT: Array, max_tokens: int | None) -> Array:
    # Dr. GRPO: a constant denominator, so a token's weight does not depend on its sequence's length.
    if not max_tokens or max_tokens <= 0:
        raise ValueError(
            f"max_tokens={max_tokens!r}: aggregation='seq-mean-token-sum-norm' needs a positive max_tokens"
        )
    return ((x_BT * mask_BT).sum(axis=1) / max_tokens).mean()


def aggregate(
    x_BT: Array, mask_BT: Array, *, aggregation: str = "token-mean", max_tokens: int | None = None
) -> Array:
    """Reduce per-token values over the masked tokens to a scalar with the named aggregation."""
    return lookup(AGGREGATIONS, aggregation, "aggregation")(_f32(x_BT), _f32(mask_BT), max_tokens)


def policy_loss(
    logp_BT: Array,
    old_logp_BT: Array,
    advantages_B: Array,
    mask_BT: Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    ratio: str = "token",
    aggregation: str = "token-mean",
    is_weights_BT: Array | None = None,
    max_tokens: int | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Clipped surrogate -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), aggregated over masked tokens."""
    ratio_fn = lookup(RATIOS, ratio, "ratio")
    logp_BT, old_logp_BT, mask_BT = _f32(logp_BT), _f32(old_logp_BT), _f32(mask_BT)
    adv_B1 = _f32(advantages_B)[:, None]
    ratio_BT = ratio_fn(logp_BT, old_logp_BT, mask_BT)
    unclipped_BT = ratio_BT * adv_B1
    clipped_BT = jnp.clip(ratio_BT, 1.0 - clip_low, 1.0 + clip_high) * adv_B1
    loss_BT = -jnp.minimum(unclipped_BT, clipped_BT)  # The clipped branch has zero gradient when it is taken.
    if is_weights_BT is not None:
        loss_BT = loss_BT * jax.lax.stop_gradient(_f32(is_weights_BT))
    loss = aggregate(loss_BT, mask_BT, aggregation=aggregation, max_tokens=max_tokens)

    sg = jax.lax.stop_gradient
    r_BT, is_clipped_BT = sg(ratio_BT), sg(clipped_BT < unclipped_BT)
    log_r_BT = sg(logp_BT - old_logp_BT)
    mean = lambda x_BT: _token_mean(_f32(x_BT), mask_BT, None)
    metrics = {
        "clip_fraction": mean(is_clipped_BT),
        "clip_fraction_low": mean(is_clipped_BT & (r_BT < 1.0)),
        "clip_fraction_high": mean(is_clipped_BT & (r_BT > 1.0)),
        "ratio_mean": mean(r_BT),
        "approx_kl": mean(jnp.expm1(log_r_BT) - log_r_BT),
    }
    return loss, metrics


# --- KL estimators: (logp_BT, ref_logp_BT) -> per-token estimate of KL(policy || ref) --------------------


@register("kl", "k1")
def _k1(logp_BT: Array, ref_logp_BT: Array) -> Array:
    return logp_BT - ref_logp_BT


@register("kl", "k3")
def _k3(logp_BT: Array, ref_logp_BT: Array) -> Array:
    # Schulman's estimator: unbiased like k1 but never negative, with lower variance.
    d_BT = ref_logp_BT - logp_BT
    return jnp.expm1(d_BT) - d_BT


def kl_penalty(
    logp_BT: Array,
    ref_logp_BT: Array,
    mask_BT: Array,
    *,
    kind: str = "k3",
    aggregation: str = "token-mean",
    max_tokens: int | None = None,
) -> Array:
    """KL(policy || ref) estimated per token with `kind`, aggregated like the policy loss."""
    kl_BT = lookup(KL, kind, "kind")(_f32(logp_BT), _f32(ref_logp_BT))
    return aggregate(kl_BT, mask_BT, aggregation=aggregation, max_tokens=max_tokens)


def truncated_importance_weights(
    proximal_logp_BT: Array, behaviour_logp_BT: Array, mask_BT: Array, *, cap: float = 2.0
) -> Array:
    """min(pi_proximal / pi_behaviour, cap) on masked tokens, 0 elsewhere; a constant (no gradient)."""
    if isinstance(cap, (int, float)) and cap <= 0:
        raise ValueError(f"cap={cap!r} must be positive")
    w_BT = jnp.minimum(jnp.exp(_f32(proximal_logp_BT) - _f32(behaviour_logp_BT)), cap)
    return jax.lax.stop_gradient(jnp.where(_f32(mask_BT) > 0, w_BT, 0.0))


# --- Config ------------------------------------------------------------------------------------------------


def default_loss_config() -> ml_collections.ConfigDict:
    """The `rl.loss` config block read by `loss_from_config`."""
    return ml_collections.ConfigDict(
        {
            "clip_low": 0.2,
            "clip_high": 0.28,
            "ratio": "token",
            "aggregation": "token-mean",
            "max_tokens": 0,  # Only read by aggregation="seq-mean-token-sum-norm", which needs it > 0.
            "kl_kind": "none",
            "kl_coef": 0.0,
            "tis_cap": 2.0,  # 0 turns truncated importance sampling off.
        }
    )


def validate_loss_config(cfg: ml_collections.ConfigDict) -> None:
    """Raise a ValueError naming the `rl.loss` field that is missing or out of range."""
    for field in default_loss_config():
        if field not in cfg:
            raise ValueError(f"rl.loss.{field} is missing; see rl.grpo.default_loss_config()")
    options = {"ratio": RATIOS, "aggregation": AGGREGATIONS, "kl_kind": {"none": None, **KL}}
    for field, registry in options.items():
        lookup(registry, cfg[field], f"rl.loss.{field}")
    for field in ("clip_low", "clip_high", "kl_coef", "tis_cap", "max_tokens"):
        if cfg[field] < 0:
            raise ValueError(f"rl.loss.{field}={cfg[field]!r} must be >= 0")
    if cfg.aggregation == "seq-mean-token-sum-norm" and cfg.max_tokens <= 0:
        raise ValueError(
            f"rl.loss.max_tokens={cfg.max_tokens!r} must be > 0 for aggregation='seq-mean-token-sum-norm'"
        )


def loss_from_config(
    logp_BT: Array,
    old_logp_BT: Array,
    advantages_B: Array,
    mask_BT: Array,
    *,
    cfg: ml_collections.ConfigDict,
    behaviour_logp_BT: Array | None = None,
    ref_logp_BT: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Policy loss (+ kl_coef * KL to the reference) as `cfg` (see `default_loss_config`) selects."""
    validate_loss_config(cfg)
    max_tokens = cfg.max_tokens or None
    is_weights_BT = None
    if behaviour_logp_BT is not None and cfg.tis_cap > 0:
        is_weights_BT = truncated_importance_weights(old_logp_BT, behaviour_logp_BT, mask_BT, cap=cfg.tis_cap)
    loss, metrics = policy_loss(
        logp_BT,
        old_logp_BT,
        advantages_B,
        mask_BT,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        ratio=cfg.ratio,
        aggregation=cfg.aggregation,
        is_weights_BT=is_weights_BT,
        max_tokens=max_tokens,
    )
    metrics["policy_loss"] = loss
    if is_weights_BT is not None:
        metrics["tis_weight_mean"] = _token_mean(is_weights_BT, _f32(mask_BT), None)
    if cfg.kl_kind != "none":
        if ref_logp_BT is None:
            raise ValueError(f"rl.loss.kl_kind={cfg.kl_kind!r} needs ref_logp_BT")
        kl = kl_penalty(
            logp_BT,
            ref_logp_BT,
            mask_BT,
            kind=cfg.kl_kind,
            aggregation=cfg.aggregation,
            max_tokens=max_tokens,
        )
        metrics["kl"] = kl
        loss = loss + cfg.kl_coef * kl
    metrics["loss"] = loss
    return loss, metrics
