"""The objectives one train step differentiates, per micro-batch: GRPO (with its metrics, optionally split by
domain for the gradient projection) and the SFT warm start's cross-entropy.

Dimension key: B sequences, T token positions, K window positions, V vocab, M micro-batches, D domains.

Log-probs everywhere are of the distribution the sampler drew from: logits / rl.temperature, then the
rl.top_k / rl.top_p filters (`token_logprobs`), so on-policy importance weights are exactly 1.

Each loss takes `w`, its micro-batch's share of the aggregation's units (`units_M`: trained tokens for
"token-mean", sequences with tokens for "seq-mean-token-mean", rows otherwise), and returns
`w * loss + moe_loss / M`: summed over micro-batches that is exactly the full-batch loss (the MoE
load-balance loss, a product of batch means, is the one term only averaged under accumulation).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from model.mtp import mtp_loss
from model.transformer import next_token_loss
from rl import grpo, train_state

Batch = dict[str, jax.Array]


def require_replay(batch: Batch) -> None:
    if "expert_indices" not in batch:
        raise ValueError(
            "rl.routing_replay=True needs batch['expert_indices'] ([L_moe, B, T, k], the experts the "
            "sampler chose); pass them or set rl.routing_replay=False"
        )


def policy_forward(
    cfg,
    graphdef,
    params: nnx.State,
    batch: Batch,
    *,
    replay: bool | None = None,
    rest: nnx.State | None = None,
    window: int = 0,
):
    """The training forward: logits_BTV and aux, replaying the sampler's routing when rl.routing_replay.
    `rest`: the model's non-Param state (selection biases); default: the graph definition's. `window` > 0
    (`logit_window`): the logits of `grpo.window_positions(mask_BT, window)` only, logits_BKV, with those
    positions in aux["logit_positions_BK"]."""
    expert_indices = None
    if cfg.rl.routing_replay if replay is None else replay:
        require_replay(batch)
        expert_indices = batch["expert_indices"]
    model = train_state.as_model_def(graphdef).merge(params, rest)
    if not window:
        return model(batch["tokens_BT"], batch["positions_BT"], expert_indices=expert_indices)
    positions_BK = grpo.window_positions(batch["mask_BT"], window)
    logits_BKV, aux = model(
        batch["tokens_BT"], batch["positions_BT"], expert_indices=expert_indices, logit_positions=positions_BK
    )
    return logits_BKV, dict(aux, logit_positions_BK=positions_BK)


def logit_window(cfg, length: int) -> int:
    """Positions per row the GRPO forwards compute logits for, over rows of `length` tokens: with
    rl.max_turns = 1 a row's trained tokens are its completion, at most rl.max_new_tokens right after its
    prompt, so the LM head and its softmax skip the prompt positions (`rl.batch.make_batch(window=...)`
    refuses a row that breaks this). 0: every position (multi-turn rows interleave observations, or the
    window would not be shorter)."""
    rl = cfg.rl
    size = int(rl.max_new_tokens)
    return size if rl.max_turns == 1 and size < length - 1 else 0


def _filtered(cfg) -> bool:
    return bool(cfg.rl.top_k) or cfg.rl.top_p < 1.0


def token_logprobs(
    cfg, logits_BTV: jax.Array, tokens_BT: jax.Array, *, processed: bool = True, positions_BK=None
) -> jax.Array:
    """Log-probs under the sampler's processing (temperature, top-k, top-p): one rule for every caller.
    `processed=False`: tempered but unfiltered (the KL term's distribution). `positions_BK`: the logits
    are those of a window (`policy_forward(window=...)`)."""
    rl = cfg.rl
    if processed and _filtered(cfg):
        return grpo.token_logprobs(
            logits_BTV,
            tokens_BT,
            temperature=rl.temperature,
            top_k=int(rl.top_k),
            top_p=float(rl.top_p),
            positions_BK=positions_BK,
        )
    return grpo.token_logprobs(logits_BTV, tokens_BT, temperature=rl.temperature, positions_BK=positions_BK)


def _policy_loss(cfg, logits_BTV: jax.Array, mb: Batch, mask_BT: jax.Array, positions_BK=None):
    """The GRPO objective (and its metrics) over the tokens of `mask_BT`; `positions_BK`: the logits'
    window (`policy_forward`)."""
    logp_BT = token_logprobs(cfg, logits_BTV, mb["tokens_BT"], positions_BK=positions_BK)
    # One update per batch: the proximal policy is the current one (ratio 1, value and all).
    proximal_BT = mb.get("proximal_logp_BT", jax.lax.stop_gradient(logp_BT))
    return grpo.loss_from_config(
        logp_BT,
        proximal_BT,
        mb["advantages_B"],
        mask_BT,
        cfg=cfg.rl.loss,
        behaviour_logp_BT=mb["behaviour_logp_BT"],
        ref_logp_BT=mb.get("ref_logp_BT"),
        kl_logp_BT=(
            token_logprobs(cfg, logits_BTV, mb["tokens_BT"], processed=False, positions_BK=positions_BK)
            if _filtered(cfg)
            else None
        ),
    )


def _grpo_metrics(cfg, logits_BTV, aux, mb: Batch, w, num_micro: int):
    """(`w * GRPO loss + moe_loss / M` of the micro-batch, its metrics): see `grpo_loss`."""
    positions_BK = aux.get("logit_positions_BK")
    loss, metrics = _policy_loss(cfg, logits_BTV, mb, mb["mask_BT"], positions_BK)
    # Train-inference mismatch: the sampler's log-probs against the trainer's before any update.
    proximal_BT = mb.get("proximal_logp_BT")
    if proximal_BT is None:
        logp_BT = token_logprobs(cfg, logits_BTV, mb["tokens_BT"], positions_BK=positions_BK)
        proximal_BT = jax.lax.stop_gradient(logp_BT)
    metrics.update(
        grpo.mismatch_metrics(proximal_BT, mb["behaviour_logp_BT"], mb["mask_BT"], band=cfg.rl.mismatch_band)
    )
    metrics = {k: v if _is_extreme(k) else w * v for k, v in metrics.items()}
    moe = aux["moe_loss"] / num_micro
    metrics.update(moe_loss=moe, advantage_mean=jnp.mean(mb["advantages_B"]) / num_micro)
    metrics["loss"] = w * loss + moe
    return metrics["loss"], _with_load(metrics, aux, num_micro)


def grpo_loss(cfg, graphdef, params, mb: Batch, w, num_micro: int):
    """`w * GRPO loss + moe_loss / M` of one micro-batch, and its metrics (means weighted by w; extremes,
    `*_max` / `*_min`, unweighted: the step takes their max / min over micro-batches; `expert_load`, for
    the bias update, is popped by the step)."""
    window = logit_window(cfg, mb["tokens_BT"].shape[1])
    logits_BTV, aux = policy_forward(cfg, graphdef, params, mb, window=window)
    return _grpo_metrics(cfg, logits_BTV, aux, mb, w, num_micro)


def grpo_domain_losses(cfg, graphdef, params, mb: Batch, w, num_micro: int, *, units_fn, num_domains: int):
    """([D] per-domain losses whose sum is `grpo_loss`'s loss, the same metrics), for the gradient
    projection: domain d's loss is the objective over its rows' tokens (`domain_B == d`) times its share of
    the micro-batch's units (so each is `w_d * loss_d` with sum_d w_d = w), plus moe_loss / M times the
    domain's share of the micro-batch's trained tokens."""
    window = logit_window(cfg, mb["tokens_BT"].shape[1])
    logits_BTV, aux = policy_forward(cfg, graphdef, params, mb, window=window)
    total, metrics = _grpo_metrics(cfg, logits_BTV, aux, mb, w, num_micro)
    del total
    mask_BT = mb["mask_BT"]
    units = units_fn(mask_BT[None].astype(jnp.float32))[0]
    tokens = mask_BT.sum()
    moe = aux["moe_loss"] / num_micro
    losses = []
    for d in range(num_domains):
        mask_d_BT = mask_BT * (mb["domain_B"] == d)[:, None].astype(mask_BT.dtype)
        loss_d, _ = _policy_loss(cfg, logits_BTV, mb, mask_d_BT, aux.get("logit_positions_BK"))
        share = units_fn(mask_d_BT[None].astype(jnp.float32))[0] / jnp.maximum(units, 1e-30)
        # The MoE loss by token share (shares sum to 1): a domain without rows has no gradient at all.
        moe_share = jnp.where(tokens > 0, mask_d_BT.sum() / jnp.maximum(tokens, 1e-30), 1.0 / num_domains)
        losses.append(w * jnp.where(units > 0, share, 0.0) * loss_d + moe_share * moe)
    return jnp.stack(losses), metrics


def _with_load(metrics: dict, aux: dict, num_micro: int) -> dict:
    """metrics plus, for an MoE model, the per-layer expert loads [L_moe, E] (for the selection-bias update)
    and `moe/dropped_fraction`: the routed assignments dropped (capacity impl, the expert-parallel
    exchange's `model.moe.ep_capacity_factor`), a mean over layers and micro-batches (equal counts each)."""
    if "expert_load" not in aux:
        return metrics
    dropped = {"moe/dropped_fraction": aux["dropped_fraction"] / num_micro}
    return dict(metrics, expert_load=aux["expert_load"], **dropped)


def _is_extreme(name: str) -> bool:
    return name.endswith("_max") or name.endswith("_min")


def sft_loss(cfg, graphdef, params, mb: Batch, w, num_micro: int, *, mtp_weight: float = 0.0):
    """`w * masked next-token cross-entropy + moe_loss / M` of one micro-batch, plus `mtp_weight * w *`
    the MTP modules' loss (`model.mtp.mtp_loss`) on the same masked tokens when mtp_weight > 0."""
    model = train_state.as_model_def(graphdef).merge(params)
    logits_BTV, aux = model(mb["tokens_BT"], mb["positions_BT"])
    ce = w * next_token_loss(logits_BTV, mb["tokens_BT"], mb["mask_BT"])
    moe = aux["moe_loss"] / num_micro
    metrics = {"cross_entropy": ce, "moe_loss": moe}
    loss = ce + moe
    if mtp_weight:
        logits_DBTV = model.mtp_logits(aux["hidden"], mb["tokens_BT"], mb["positions_BT"])
        metrics["mtp_loss"] = w * mtp_loss(logits_DBTV, mb["tokens_BT"], mb["mask_BT"])
        loss = loss + mtp_weight * metrics["mtp_loss"]
    metrics["loss"] = loss
    return loss, _with_load(metrics, aux, num_micro)


def units_M(aggregation: str, mask_MBT: jax.Array) -> jax.Array:
    """How many units each micro-batch's loss is a mean over, for the aggregation in use."""
    if aggregation == "token-mean":
        return mask_MBT.sum(axis=(1, 2))
    if aggregation == "seq-mean-token-mean":
        return (mask_MBT.sum(axis=2) > 0).sum(axis=1).astype(jnp.float32)
    # seq-mean-token-sum-norm is a mean over rows, and micro-batches hold equal rows. Any other registered
    # aggregation is averaged with equal weights too: exact only if it is a mean over rows.
    return jnp.ones(mask_MBT.shape[:1], jnp.float32)
