"""GRPO as small pure functions, registered by name so a config picks each variant with a string.

Variants: GRPO (group-std advantages, token ratio), Dr. GRPO (`std="none"`, `seq-mean-token-sum-norm`),
DAPO (clip-higher: separate `clip_low`/`clip_high`, `token-mean`), GSPO (`ratio="sequence"`), k1/k3 KL
penalties to a reference policy, and corrections for the train-inference mismatch (the sampler's log-probs
differ from the trainer's: another policy version, other kernels, other numerics): truncated importance
sampling, IcePop token masking, sequence masking and rejection (`correction`), measured by `mismatch_metrics`.

Dimension key:
  B: sequences in the batch (B = G * n)
  T: token positions
  V: vocabulary
  G: groups (one prompt each)
  N: samples per group (n, `group_size`)

Every `*_BT` array is aligned to token positions: `logp_BT[:, t]` is the log-prob of token t, and `mask_BT`
(bool or float) is 1 on the completion tokens that are trained on. All math is f32. Values at masked-out
positions never reach a result or a gradient, even when they are -inf (a prompt token outside the sampler's
top-k, say): the losses and metrics read them through `jnp.where`, not a product with the mask.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from configs import schema
from configs.fields import LOSS
from inference import sampling
from model import logprobs

Array = jax.Array

ADVANTAGES: dict[str, Callable[..., Array]] = {}
RATIOS: dict[str, Callable[..., Array]] = {}
AGGREGATIONS: dict[str, Callable[..., Array]] = {}
KL: dict[str, Callable[..., Array]] = {}
CORRECTIONS: dict[str, Callable[..., Array]] = {}
REGISTRIES = {
    "advantages": ADVANTAGES,
    "ratio": RATIOS,
    "aggregation": AGGREGATIONS,
    "kl": KL,
    "correction": CORRECTIONS,
}

# The log-prob of a token that the sampler's filters (top-k, top-p, min-p) drop: it cannot be sampled, its
# true log-prob is -inf. A finite floor keeps 0 * logp, logp - logp and their gradients free of NaN.
LOGP_FLOOR = -1e9


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


def _on_mask(x_BT: Array, mask_BT: Array) -> Array:
    """f32 x on masked tokens, 0 elsewhere: a padded -inf or NaN goes no further, in value or gradient."""
    return jnp.where(_f32(mask_BT) > 0, _f32(x_BT), 0.0)


def _masked_max(x_BT: Array, mask_BT: Array) -> Array:
    """Max over masked tokens of a nonnegative x; 0 (the identity for a max over micro-batches) if none."""
    return jnp.max(x_BT, where=_f32(mask_BT) > 0, initial=0.0)


def _masked_min(x_BT: Array, mask_BT: Array) -> Array:
    """Min over masked tokens; inf (the identity for a min over micro-batches) if none."""
    return jnp.min(x_BT, where=_f32(mask_BT) > 0, initial=jnp.inf)


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
    """Reward minus its group's mean, scaled by `std`; groups are `group_size` consecutive rows. A numpy
    array stays on the host (the rollout's per-step advantages: no device programs, nothing to compile)."""
    (batch,) = rewards_B.shape
    if group_size <= 0 or batch % group_size:
        raise ValueError(f"rewards_B has {batch} rows, not a multiple of group_size={group_size}")
    fn = lookup(ADVANTAGES, std, "std")
    rewards = rewards_B.astype(np.float32) if isinstance(rewards_B, np.ndarray) else _f32(rewards_B)
    return fn(rewards.reshape(batch // group_size, group_size), eps).reshape(batch)


def token_logprobs(
    logits_BTV: Array,
    tokens_BT: Array,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    positions_BK: Array | None = None,
) -> Array:
    """logp_BT[:, t] = log p(tokens[:, t] | tokens[:, <t]) from logits[:, t - 1]; 0 at t = 0.

    p is the distribution the sampler draws from: logits / temperature, then (when any is on) the top-k,
    top-p and min-p filters and renormalisation of `inference.sampling.processed_logprobs`. A token the
    filters drop gets LOGP_FLOOR (its true log-prob is -inf). The keep-mask is a constant: the gradient flows
    through the renormalised kept logits only. With every filter off this is the plain tempered softmax.
    The arguments after `tokens_BT` are static Python numbers; temperature 0 (greedy) is refused: it has no
    log-prob to train on.

    `positions_BK`: the logits are logits_BKV of those positions only (`window_positions`); logp_BT then
    holds the log-probs of the tokens after them (t = position + 1) and 0 everywhere else.
    """
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0 (greedy decoding has no log-probs)")
    sampling.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)  # Validates.
    if positions_BK is not None:
        length = tokens_BT.shape[1]
        valid_BK = positions_BK <= length - 2  # the last position predicts nothing
        index_BK = jnp.clip(positions_BK, 0, length - 2) + 1
        next_BK = jnp.take_along_axis(tokens_BT, index_BK, axis=1)
        logp_BK = _next_logprobs(logits_BTV, next_BK, temperature, top_k, top_p, min_p)
        rows_B1 = jnp.arange(tokens_BT.shape[0])[:, None]
        # Clipped positions all land on t = T - 1 and add 0 there.
        logp_BT = jnp.zeros(tokens_BT.shape, logp_BK.dtype)
        return logp_BT.at[rows_B1, index_BK].add(jnp.where(valid_BK, logp_BK, 0.0))
    next_BT = logprobs.shifted(tokens_BT)  # position t predicts token t + 1
    return logprobs.at_tokens(_next_logprobs(logits_BTV, next_BT, temperature, top_k, top_p, min_p))


def window_positions(mask_BT: Array, size: int) -> Array:
    """[B, size] positions whose logits score each row's trained tokens when they all lie within `size`
    tokens from its first one (a single-turn completion): from the position before that token on. A row
    without trained tokens (padding) gets 0 ... size - 1."""
    first_B = jnp.argmax(mask_BT > 0, axis=1)
    return jnp.maximum(first_B - 1, 0)[:, None] + jnp.arange(size, dtype=jnp.int32)[None, :]


def _next_logprobs(
    logits_BKV: Array, next_BK: Array, temperature: float, top_k: int, top_p: float, min_p: float
) -> Array:
    """log p(next_BK) under the processed distribution of each logits row."""
    if top_k or top_p < 1.0 or min_p:
        return _processed_logprobs(logits_BKV, next_BK, temperature, top_k, top_p, min_p)
    logits_BKV = _f32(logits_BKV) / temperature
    picked_BK = logprobs.pick(logits_BKV, next_BK)
    return picked_BK - jax.nn.logsumexp(logits_BKV, axis=-1)


def _processed_logprobs(
    logits_BTV: Array, next_BT: Array, temperature: float, top_k: int, top_p: float, min_p: float
) -> Array:
    """Log-probs of next_BT under the sampler's processed distribution, floored at LOGP_FLOOR."""
    batch, length, vocab = logits_BTV.shape
    rows = batch * length
    arrays = sampling.SamplingArrays(
        temperature_B=jnp.full((rows,), temperature, jnp.float32),
        top_k_B=jnp.full((rows,), top_k, jnp.int32),
        top_p_B=jnp.full((rows,), top_p, jnp.float32),
        min_p_B=jnp.full((rows,), min_p, jnp.float32),
    )
    logp_RV = sampling.processed_logprobs(logits_BTV.reshape(rows, vocab), arrays)
    picked_R = logprobs.pick(logp_RV[:, None], next_BT.reshape(rows, 1))[:, 0]
    # maximum() sends no cotangent to the -inf it replaces: the dropped token's gradient is 0, not NaN.
    return jnp.maximum(picked_R, LOGP_FLOOR).reshape(batch, length)


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
    """Clipped surrogate -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), aggregated over masked tokens.

    Metrics over masked tokens: clip_fraction (_low: r < 1, _high: r > 1), ratio_mean, ratio_max (0 when no
    token is masked in), approx_kl (k3 of KL(old || new)).
    """
    ratio_fn = lookup(RATIOS, ratio, "ratio")
    logp_BT, old_logp_BT = _on_mask(logp_BT, mask_BT), _on_mask(old_logp_BT, mask_BT)
    mask_BT = _f32(mask_BT)
    adv_B1 = _f32(advantages_B)[:, None]
    ratio_BT = ratio_fn(logp_BT, old_logp_BT, mask_BT)
    unclipped_BT = ratio_BT * adv_B1
    clipped_BT = jnp.clip(ratio_BT, 1.0 - clip_low, 1.0 + clip_high) * adv_B1
    loss_BT = -jnp.minimum(unclipped_BT, clipped_BT)  # The clipped branch has zero gradient when it is taken.
    if is_weights_BT is not None:
        loss_BT = loss_BT * jax.lax.stop_gradient(_on_mask(is_weights_BT, mask_BT))
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
        "ratio_max": _masked_max(r_BT, mask_BT),
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
    kl_BT = lookup(KL, kind, "kind")(_on_mask(logp_BT, mask_BT), _on_mask(ref_logp_BT, mask_BT))
    return aggregate(kl_BT, mask_BT, aggregation=aggregation, max_tokens=max_tokens)


# --- Train-inference mismatch: corrections and metrics ----------------------------------------------------
#
# Corrections: (proximal_logp_BT, behaviour_logp_BT, mask_BT, *, low, high, cap) -> weights_BT, constant
# (no gradient) per-token weights that multiply the per-token loss, 0 on masked-out tokens. The ratio is
# pi_proximal / pi_behaviour: the trainer's policy (before this batch's first update) over the sampler's.


def truncated_importance_weights(
    proximal_logp_BT: Array, behaviour_logp_BT: Array, mask_BT: Array, *, cap: float = 2.0
) -> Array:
    """min(pi_proximal / pi_behaviour, cap) on masked tokens, 0 elsewhere; a constant (no gradient)."""
    if isinstance(cap, (int, float)) and cap <= 0:
        raise ValueError(f"cap={cap!r} must be positive")
    w_BT = jnp.minimum(jnp.exp(_log_ratio(proximal_logp_BT, behaviour_logp_BT, mask_BT)), cap)
    return jnp.where(_f32(mask_BT) > 0, w_BT, 0.0)


def _log_ratio(proximal_logp_BT: Array, behaviour_logp_BT: Array, mask_BT: Array) -> Array:
    """log(pi_proximal / pi_behaviour) on masked tokens, 0 elsewhere; a constant."""
    return jax.lax.stop_gradient(_on_mask(_f32(proximal_logp_BT) - _f32(behaviour_logp_BT), mask_BT))


def _in_band(x: Array, low: float, high: float) -> Array:
    return (x >= low) & (x <= high)


def _sequence_in_band_B(log_r_BT: Array, mask_BT: Array, low: float, high: float, *, mean: bool) -> Array:
    """Whether exp(mean (or sum) over a row's masked tokens of log r) is in [low, high]."""
    log_r_B = log_r_BT.sum(axis=1)
    if mean:
        log_r_B = log_r_B / jnp.maximum(_f32(mask_BT).sum(axis=1), 1.0)
    return _in_band(jnp.exp(log_r_B), low, high)


@register("correction", "none")
def _no_correction(proximal_logp_BT, behaviour_logp_BT, mask_BT, *, low, high, cap) -> Array:
    del proximal_logp_BT, behaviour_logp_BT, low, high, cap
    return (_f32(mask_BT) > 0).astype(jnp.float32)


@register("correction", "tis")
def _tis(proximal_logp_BT, behaviour_logp_BT, mask_BT, *, low, high, cap) -> Array:
    del low, high  # Truncated importance sampling: min(r, cap).
    return truncated_importance_weights(proximal_logp_BT, behaviour_logp_BT, mask_BT, cap=cap)


@register("correction", "icepop")
def _icepop(proximal_logp_BT, behaviour_logp_BT, mask_BT, *, low, high, cap) -> Array:
    # IcePop (Ring-1T): the masked ratio M(r) = r inside [low, high], 0 outside; no cap (high bounds it).
    del cap
    r_BT = jnp.exp(_log_ratio(proximal_logp_BT, behaviour_logp_BT, mask_BT))
    return jnp.where((_f32(mask_BT) > 0) & _in_band(r_BT, low, high), r_BT, 0.0)


@register("correction", "seq-mask")
def _seq_mask(proximal_logp_BT, behaviour_logp_BT, mask_BT, *, low, high, cap) -> Array:
    # A row whose geometric-mean ratio is out of band gets 0; the others keep min(r, cap) per token
    # (cap 0: weight 1, sequence masking alone).
    log_r_BT = _log_ratio(proximal_logp_BT, behaviour_logp_BT, mask_BT)
    keep_B = _sequence_in_band_B(log_r_BT, mask_BT, low, high, mean=True)
    tokens_BT = _no_correction(proximal_logp_BT, behaviour_logp_BT, mask_BT, low=low, high=high, cap=cap)
    if cap > 0:
        tokens_BT = _tis(proximal_logp_BT, behaviour_logp_BT, mask_BT, low=low, high=high, cap=cap)
    return jnp.where(keep_B[:, None], tokens_BT, 0.0)


@register("correction", "seq-reject")
def _seq_reject(proximal_logp_BT, behaviour_logp_BT, mask_BT, *, low, high, cap) -> Array:
    # Rejection sampling on the sequence ratio prod_t r_t: 1 in band, 0 out. On long sequences the product
    # drifts far from 1 even for a small per-token mismatch; "seq-mask" is the length-normalised form.
    del cap
    log_r_BT = _log_ratio(proximal_logp_BT, behaviour_logp_BT, mask_BT)
    keep_B = _sequence_in_band_B(log_r_BT, mask_BT, low, high, mean=False)
    return jnp.where(keep_B[:, None] & (_f32(mask_BT) > 0), 1.0, 0.0)


def correction_weights(
    proximal_logp_BT: Array,
    behaviour_logp_BT: Array,
    mask_BT: Array,
    *,
    kind: str = "tis",
    low: float = 0.5,
    high: float = 2.0,
    cap: float = 2.0,
) -> Array:
    """The named correction's constant per-token loss weights (0 on masked-out tokens), f32 [B, T].

    none: 1. tis: min(r, cap). icepop: r if low <= r <= high else 0. seq-mask: 0 on rows whose
    exp(mean log r) is outside [low, high], else min(r, cap) (1 when cap is 0). seq-reject: 0 on rows whose
    exp(sum log r) is outside [low, high], else 1. Here r = pi_proximal / pi_behaviour per token.
    """
    fn = lookup(CORRECTIONS, kind, "kind")
    w_BT = fn(proximal_logp_BT, behaviour_logp_BT, mask_BT, low=low, high=high, cap=cap)
    return jax.lax.stop_gradient(_f32(w_BT))


def mismatch_metrics(
    train_logp_BT: Array, behaviour_logp_BT: Array, mask_BT: Array, *, band: float
) -> dict[str, Array]:
    """How far the sampler's distribution is from the trainer's, over the masked (sampled) tokens.

    With r = train_logp - behaviour_logp per token (the sampled tokens come from the sampler):
      mismatch_kl_k1       mean(-r): the k1 estimate of KL(sampler || trainer); unbiased, can be negative.
      mismatch_kl          mean(exp(r) - 1 - r): the k3 estimate of the same KL; unbiased and never negative.
      mismatch_out_of_band fraction of tokens with exp(r) outside [1 / band, band].
      mismatch_ratio_max   max exp(r) (0 when no token is masked in).
      mismatch_ratio_min   min exp(r) (inf when no token is masked in).
    A sampled token the trainer's filters drop (train_logp = LOGP_FLOOR) has ratio 0 and KL terms ~1e9.
    """
    if isinstance(band, (int, float)) and not band >= 1:
        raise ValueError(f"band={band!r} must be >= 1 (the band is [1/band, band])")
    log_r_BT = jax.lax.stop_gradient(_on_mask(_f32(train_logp_BT) - _f32(behaviour_logp_BT), mask_BT))
    r_BT = jnp.exp(log_r_BT)
    mean = lambda x_BT: _token_mean(_f32(x_BT), _f32(mask_BT), None)
    return {
        "mismatch_kl_k1": mean(-log_r_BT),
        "mismatch_kl": mean(jnp.expm1(log_r_BT) - log_r_BT),
        "mismatch_out_of_band": mean(~_in_band(r_BT, 1.0 / band, band)),
        "mismatch_ratio_max": _masked_max(r_BT, mask_BT),
        "mismatch_ratio_min": _masked_min(r_BT, mask_BT),
    }


# --- Config ------------------------------------------------------------------------------------------------


def default_loss_config() -> ml_collections.ConfigDict:
    """The `rl.loss` config block read by `loss_from_config`."""
    return schema.build(LOSS)


def validate_loss_config(cfg: ml_collections.ConfigDict) -> None:
    """Raises a ConfigError (a ValueError) naming the `rl.loss` field missing, unknown or out of range."""
    schema.check(cfg, LOSS, "rl.loss")
    registered = {"ratio": RATIOS, "aggregation": AGGREGATIONS, "kl_kind": {**KL, "none": None}}
    for name, names in {**registered, "correction": CORRECTIONS}.items():
        if cfg[name] not in names:
            known = sorted(names)
            raise schema.ConfigError(f"rl.loss.{name}={cfg[name]!r} is unknown; choose one of {known}")
    if cfg.aggregation == "seq-mean-token-sum-norm" and cfg.max_tokens <= 0:
        raise schema.ConfigError(
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
    kl_logp_BT: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Policy loss (+ kl_coef * KL to the reference) as `cfg` (see `default_loss_config`) selects.

    The KL term compares `kl_logp_BT` (default `logp_BT`) with `ref_logp_BT`: with top-k / top-p sampling
    the trainer passes the unfiltered (tempered) log-probs of both models there, since a token outside one
    model's kept set has log-prob ~LOGP_FLOOR and would make k3 overflow.

    With behaviour log-probs, the per-token loss is weighted by `cfg.correction` (ratio old / behaviour),
    unless that is "tis" with tis_cap 0; metrics is_weight_mean and correction_kept_fraction (the share of
    masked tokens with a nonzero weight), and tis_weight_mean (the same mean) for "tis".
    """
    validate_loss_config(cfg)
    max_tokens = cfg.max_tokens or None
    is_weights_BT = None
    if behaviour_logp_BT is not None and not (cfg.correction == "tis" and cfg.tis_cap == 0):
        is_weights_BT = correction_weights(
            old_logp_BT,
            behaviour_logp_BT,
            mask_BT,
            kind=cfg.correction,
            low=cfg.correction_low,
            high=cfg.correction_high,
            cap=cfg.tis_cap,
        )
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
        metrics["is_weight_mean"] = _token_mean(is_weights_BT, _f32(mask_BT), None)
        metrics["correction_kept_fraction"] = _token_mean(_f32(is_weights_BT > 0), _f32(mask_BT), None)
        if cfg.correction == "tis":
            metrics["tis_weight_mean"] = metrics["is_weight_mean"]
    if cfg.kl_kind != "none":
        if ref_logp_BT is None:
            raise ValueError(f"rl.loss.kl_kind={cfg.kl_kind!r} needs ref_logp_BT")
        kl = kl_penalty(
            logp_BT if kl_logp_BT is None else kl_logp_BT,
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
