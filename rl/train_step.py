"""The pure trainer: `step_fn(state, batch) -> (state, metrics)` for GRPO and for SFT warm starts.

Dimension key: B sequences, T token positions, V vocab, L MoE layers, k experts per token, M micro-batches.

Each step is jitted once with the train state donated; with a mesh, `in_shardings`/`out_shardings` come from
the logical axes (parameters and optimizer moments: `model.sharding.state_shardings`; batch: `act_batch`,
`act_length`; step, key and metrics replicated).

Batch (dict of arrays; rows right-padded):
  tokens_BT          int32  prompt + completion
  positions_BT       int32
  mask_BT            f32    1 on the completion tokens trained on
  advantages_B       f32    (GRPO)
  behaviour_logp_BT  f32    the sampler's log-prob of each completion token, 0 elsewhere (GRPO)
  ref_logp_BT        f32    reference log-probs; needed when rl.loss.kl_kind != "none"
  proximal_logp_BT   f32    the policy's log-probs before the first update of this rollout batch; needed
                            when rl.ppo_epochs * rl.mini_batches > 1 (else the current policy is proximal)
  expert_indices     int32  [L, B, T, k] experts the sampler chose; needed when rl.routing_replay
  domain_B           int32  the row's index in rl.domains (-1: padding); needed when rl.gradient_projection

One rollout batch (`make_grpo_update`): reference log-probs of the frozen step-0 policy (when rl.loss.kl_kind
is set), proximal log-probs of the current policy (once, when there is more than one update), then
rl.ppo_epochs passes over the batch of rl.mini_batches optimizer steps each (rows shuffled per pass). From
the second update on the ratio against the proximal policy moves, and clipping engages.

Log-probs everywhere are of the distribution the sampler drew from: logits / rl.temperature, then the
rl.top_k / rl.top_p filters (`_token_logprobs`), so on-policy importance weights are exactly 1.

Gradient accumulation (`rl.micro_batches = M`): row i goes to micro-batch i % M (so every micro-batch spans
every data shard); a `lax.scan` adds the f32 gradients of `w_m * loss_m + moe_loss_m / M`, where `w_m` is the
micro-batch's share of the aggregation's units (trained tokens for "token-mean", sequences with tokens for
"seq-mean-token-mean", rows otherwise). Each loss is a mean over its units, so the sum is exactly the
full-batch loss and gradient. The MoE load-balance loss is a product of batch means and is the one term that
is only averaged, not exact, under accumulation.

Gradient projection (`rl.gradient_projection`, `rl/projection.py`): the loss is split by domain (the rows of
each, `domain_B`, weighted by the domain's share of the units, so the split losses sum to the loss above);
one forward, one backward per domain, accumulated per domain over micro-batches; PCGrad removes each
domain's conflicting component against the others before the optimizer sees the sum. Metrics
`projection/conflicts`, `projection/kept`, `projection/cosine/<a>|<b>`. D backward passes: D times the
backward cost and D gradient buffers.

Aux-loss-free balancing (sigmoid routers, `model.moe.bias_update_rate` > 0): every optimizer step moves each
MoE layer's selection bias (`TrainState.model_state`, not a gradient-trained parameter) by
`model.moe.update_expert_bias` from that layer's expert loads over the step's batch (the mean over
micro-batches). The forward of a step routes with the bias as it was before the step.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

from configs import schema
from configs.schema import Float, Int
from model import seeds, sharding
from model.moe import update_bias_state
from model.mtp import mtp_loss
from model.transformer import Transformer, build, next_token_loss
from rl import distributed, grpo, projection

Batch = dict[str, jax.Array]
BT = ("act_batch", "act_length")
BATCH_AXES = {
    "tokens_BT": BT,
    "positions_BT": BT,
    "mask_BT": BT,
    "advantages_B": ("act_batch",),
    "behaviour_logp_BT": BT,
    "ref_logp_BT": BT,
    "proximal_logp_BT": BT,
    "expert_indices": (None, "act_batch", "act_length", None),
    "domain_B": ("act_batch",),
}
SFT_KEYS = ("tokens_BT", "positions_BT", "mask_BT")
# The row dimension of each batch entry (axis 1 of expert_indices [L, B, T, k], axis 0 of the rest).
ROW_AXIS = {k: axes.index("act_batch") for k, axes in BATCH_AXES.items()}


@struct.dataclass
class TrainState:
    params: nnx.State  # nnx.State of nnx.Param
    opt_state: optax.OptState
    step: jax.Array  # int32 scalar: updates applied so far
    rng: jax.Array  # typed key; `fold_in(rng, step)` is the key of a step that needs randomness
    # The model's non-Param variables, changed by the step outside the gradient: the sigmoid routers'
    # selection biases (`model.moe.ExpertBias`). Empty for softmax routers and dense models.
    model_state: nnx.State = struct.field(default_factory=lambda: nnx.State({}))


def weights(state: TrainState) -> nnx.State:
    """What the sampler runs on: the params with the selection biases (`inference.Engine.update_params`)."""
    return nnx.merge_state(state.params, state.model_state)


def reference_weights(state: TrainState, dtype: str = "") -> nnx.State:
    """The frozen KL reference: a copy of `weights(state)` (the step-0 policy whole: params and the sigmoid
    routers' selection biases, which the steps go on moving), the params in `dtype` ("" keeps theirs; the
    biases keep theirs: routing is chosen by them). For a model without non-Param state it has the params'
    structure. `make_grpo_update`'s `ref_params`; the checkpoint's "reference"."""
    params = jax.tree.map(lambda p: jnp.array(p, dtype=dtype or p.dtype, copy=True), state.params)
    rest = jax.tree.map(lambda x: jnp.array(x, copy=True), state.model_state)
    return nnx.merge_state(params, rest)


class ModelDef(NamedTuple):
    """The static half of the model: graph definition plus the non-parameter state it was built with (its own
    copy; the train state carries the current one, e.g. selection biases the steps move)."""

    graphdef: nnx.GraphDef
    rest: nnx.State

    def merge(self, params: nnx.State, rest: nnx.State | None = None) -> Transformer:
        """The model with `params` and `rest` (the current non-Param state; default: the one kept here)."""
        return nnx.merge(self.graphdef, params, self.rest if rest is None else rest)


def _as_model_def(graphdef: ModelDef | nnx.GraphDef) -> ModelDef:
    return graphdef if isinstance(graphdef, ModelDef) else ModelDef(graphdef, nnx.State({}))


# The rl fields the jitted steps and log-prob functions read (`step_config`); rl.domains too, under
# rl.gradient_projection.
STEP_RL_FIELDS = (
    "micro_batches",
    "optim",
    "loss",
    "routing_replay",
    "top_k",
    "top_p",
    "temperature",
    "max_new_tokens",
    "max_turns",
    "mismatch_band",
    "gradient_projection",
)


def step_config(cfg: ml_collections.ConfigDict) -> ml_collections.FrozenConfigDict:
    """The part of `cfg` the jitted steps read (model, mesh, rl.STEP_RL_FIELDS), frozen: the key of the
    per-process step cache. The steps are built from it alone, so a read of any other field fails rather
    than running a program built for another config; two configs that differ elsewhere (steps, checkpoints,
    evaluation, data) share the traced and compiled steps."""
    rl = {k: cfg.rl[k] for k in STEP_RL_FIELDS if k in cfg.rl}
    if rl.get("gradient_projection"):
        rl["domains"] = tuple(cfg.rl.domains)
    return ml_collections.FrozenConfigDict({"model": cfg.model, "mesh": cfg.mesh, "rl": rl})


# --- Optimizer ----------------------------------------------------------------------------------------------


# The `rl.optim` block (and the overrides of `rl.sft.optim`): AdamW, warmup + cosine schedule, clipping.
OPTIM = {
    "lr": Float(
        3e-4, "peak learning rate (RL on a pretrained model: ~1e-6..1e-5; small: 1e-5)", lo=0, lo_open=True
    ),
    "b1": Float(0.9, "Adam first-moment decay", lo=0, hi=1, hi_open=True),
    "b2": Float(0.999, "Adam second-moment decay", lo=0, hi=1, hi_open=True),
    "eps": Float(1e-8, "Adam denominator epsilon", lo=0, lo_open=True),
    "weight_decay": Float(0.01, "decoupled weight decay (AdamW), scaled by the scheduled lr", lo=0),
    "warmup_steps": Int(10, "linear warmup: step s < warmup_steps uses lr * (s + 1) / warmup_steps", lo=0),
    "total_steps": Int(1000, "cosine decay ends here (> warmup_steps); min_lr_ratio * lr after", lo=1),
    "min_lr_ratio": Float(0.1, "final lr as a fraction of the peak", lo=0, hi=1),
    "max_grad_norm": Float(1.0, "global-norm gradient clipping before AdamW", lo=0, lo_open=True),
}


def _check_optim(o: ml_collections.ConfigDict, prefix: str = "rl.optim") -> None:
    schema.check(o, OPTIM, prefix)
    if not o.total_steps > o.warmup_steps:
        raise schema.ConfigError(
            f"{prefix}.total_steps={o.total_steps!r} must be > {prefix}.warmup_steps={o.warmup_steps}"
        )


def make_schedule(optim_cfg: ml_collections.ConfigDict) -> optax.Schedule:
    """lr * (s + 1) / warmup for s < warmup, then cosine to min_lr_ratio * lr at total_steps, held after."""
    _check_optim(optim_cfg)
    lr, warmup, total = optim_cfg.lr, optim_cfg.warmup_steps, optim_cfg.total_steps
    low = lr * optim_cfg.min_lr_ratio

    def schedule(count):
        s = jnp.asarray(count, jnp.float32)
        warm = lr * jnp.minimum(1.0, (s + 1.0) / max(warmup, 1))
        frac = jnp.clip((s - warmup) / (total - warmup), 0.0, 1.0)
        cosine = low + (lr - low) * 0.5 * (1.0 + jnp.cos(math.pi * frac))
        return jnp.where(s < warmup, warm, cosine)

    return schedule


def make_optimizer(optim_cfg: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on the warmup + cosine schedule of `make_schedule`."""
    o = optim_cfg
    return optax.chain(
        optax.clip_by_global_norm(o.max_grad_norm),
        optax.adamw(make_schedule(o), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay),
    )


# --- Shardings ----------------------------------------------------------------------------------------------


def _tree_shardings(tree: Any, mesh: jax.sharding.Mesh, rules) -> Any:
    """Variables (params, Adam moments) by their logical axes; every other leaf replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(
        lambda x: sharding.state_shardings(x, mesh, rules) if isinstance(x, nnx.Variable) else replicated,
        tree,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def _batch_shardings(keys, mesh, rules, rows: int | None = None) -> dict[str, NamedSharding]:
    """Batch entries by their logical axes; with `rows`, the row dimension keeps only the leading mesh axes
    whose sizes divide it (a mini-batch of 4 rows on 8 data shards is split over what divides 4)."""
    out = {}
    for k in keys:
        spec = sharding.mesh_spec(BATCH_AXES[k], rules, mesh)
        if rows is not None:
            spec = _fit_rows(spec, ROW_AXIS[k], rows, mesh)
        out[k] = NamedSharding(mesh, spec)
    return out


def _fit_rows(spec: PartitionSpec, axis: int, rows: int, mesh) -> PartitionSpec:
    entries = list(spec) + [None] * (axis + 1 - len(spec))
    names = entries[axis]
    names = (names,) if isinstance(names, str) else tuple(names or ())
    kept, size = [], 1
    for name in names:
        if rows % (size * mesh.shape[name]):
            break
        kept.append(name)
        size *= mesh.shape[name]
    entries[axis] = tuple(kept) if len(kept) > 1 else (kept[0] if kept else None)
    return PartitionSpec(*entries)


def batch_shardings(cfg, keys, mesh, rows: int) -> dict[str, NamedSharding]:
    """The shardings the train step takes a batch of `rows` rows in (`rl.distributed.global_batch`)."""
    return _batch_shardings(keys, mesh, tuple(cfg.mesh.rules), rows)


def batch_shard_count(cfg, mesh) -> int:
    """Mesh devices the batch rows are split over (act_batch): rollout batches must divide by it."""
    spec = sharding.mesh_spec(BATCH_AXES["tokens_BT"], tuple(cfg.mesh.rules), mesh)
    names = spec[0] if len(spec) else None
    names = (names,) if isinstance(names, str) else tuple(names or ())
    return int(np.prod([mesh.shape[n] for n in names])) if names else 1


# --- State --------------------------------------------------------------------------------------------------


def init_state(
    cfg: ml_collections.ConfigDict,
    *,
    mesh: jax.sharding.Mesh | None = None,
    seed: int = 0,
    params: nnx.State | None = None,
    model_state: nnx.State | None = None,
) -> tuple[ModelDef, TrainState]:
    """Builds the model (or takes `params`, and `model_state`: its non-Param variables, e.g. trained
    selection biases) and the optimizer state, sharded like the params on `mesh`."""
    make = lambda: Transformer(cfg, rngs=nnx.Rngs(params=seeds.key(seed)))
    if params is None:
        graphdef, params, rest = nnx.split(build(cfg, seed=seed, mesh=mesh), nnx.Param, ...)
    else:
        graphdef, _, rest = nnx.split(nnx.eval_shape(make), nnx.Param, ...)
        if jax.tree.leaves(rest):  # e.g. a sigmoid router's selection bias: its initial value
            rest = jax.jit(lambda: nnx.split(make(), nnx.Param, ...)[2])()
    if model_state is not None:
        rest = model_state
    # The ModelDef keeps its own copy: the train step donates the state, `rest` included.
    model_rest = lambda: jax.tree.map(lambda x: jnp.array(x, copy=True), rest)  # noqa: E731
    optimizer = make_optimizer(cfg.rl.optim)
    step, rng = jnp.zeros((), jnp.int32), seeds.key(seed)
    if mesh is None:
        return ModelDef(graphdef, model_rest()), TrainState(params, optimizer.init(params), step, rng, rest)
    rules = cfg.mesh.rules
    if jax.process_count() > 1:  # one process's arrays (e.g. a loaded checkpoint) cannot move to others
        params, rest = _host_local(params), _host_local(rest)
    with jax.set_mesh(mesh):
        params = jax.device_put(params, _tree_shardings(params, mesh, rules))
        rest = jax.device_put(rest, _tree_shardings(rest, mesh, rules))
        opt_shardings = _tree_shardings(jax.eval_shape(optimizer.init, params), mesh, rules)
        opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
        # Made on the mesh (a typed key has no host form to place on devices of other processes).
        scalars = lambda: (jnp.zeros((), jnp.int32), seeds.key(seed))  # noqa: E731
        step, rng = jax.jit(scalars, out_shardings=NamedSharding(mesh, PartitionSpec()))()
    return ModelDef(graphdef, model_rest()), TrainState(params, opt_state, step, rng, rest)


def _host_local(tree: Any) -> Any:
    """Arrays held by this process alone, as host arrays (every process holds the same values)."""
    local = lambda x: np.asarray(x) if isinstance(x, jax.Array) and x.is_fully_addressable else x  # noqa: E731
    return jax.tree.map(local, tree)


def _abstract_state(cfg, optimizer) -> TrainState:
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0)))
    _, params, rest = nnx.split(model, nnx.Param, ...)
    step, key = jax.ShapeDtypeStruct((), jnp.int32), jax.eval_shape(jax.random.key, 0)
    return TrainState(params, jax.eval_shape(optimizer.init, params), step, key, rest)


# --- Forward and losses -------------------------------------------------------------------------------------


def _require_replay(batch: Batch) -> None:
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
        _require_replay(batch)
        expert_indices = batch["expert_indices"]
    model = _as_model_def(graphdef).merge(params, rest)
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
    prompt, so the LM head and its softmax skip the prompt positions (`rollout.make_batch(window=...)`
    refuses a row that breaks this). 0: every position (multi-turn rows interleave observations, or the
    window would not be shorter)."""
    rl = cfg.rl
    size = int(rl.max_new_tokens)
    return size if rl.max_turns == 1 and size < length - 1 else 0


def _filtered(cfg) -> bool:
    return bool(cfg.rl.top_k) or cfg.rl.top_p < 1.0


def _token_logprobs(
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


def make_logprobs(
    cfg: ml_collections.ConfigDict,
    graphdef,
    *,
    replay: bool | None = None,
    processed: bool = True,
    mesh: jax.sharding.Mesh | None = None,
):
    """Jitted `fn(params, batch, rest=None) -> logp_BT` (teacher-forced, under the sampler's processing),
    for the proximal and reference log-probs; `rest` is the model's current non-Param state (default: the
    graph definition's). `replay` defaults to rl.routing_replay; the reference passes False (it is another
    model: it routes its own way) and `processed=False` (the KL is between the models' unfiltered
    distributions). With a `logit_window` only the window's tokens are scored (every trained token: see
    `rollout.make_batch(window=...)`); prompt positions hold 0. The jitted function is shared by every call
    with the same `step_config`, graph, options and mesh (`_logprobs`)."""
    model_def = _as_model_def(graphdef)
    replay = bool(cfg.rl.routing_replay if replay is None else replay)
    run = _logprobs(step_config(cfg), model_def.graphdef, replay, bool(processed), mesh)
    default = lambda rest: model_def.rest if rest is None else rest  # noqa: E731
    fn = lambda params, batch, rest=None: run(params, batch, default(rest))  # noqa: E731
    # compile(params, batch, rest=None): the executable of that call, compiled and not run
    fn.compile = lambda params, batch, rest=None: run.compile(params, batch, default(rest))
    return fn


@functools.lru_cache(maxsize=16)
def _logprobs(cfg, graphdef: nnx.GraphDef, replay: bool, processed: bool, mesh):
    """`make_logprobs`'s jitted function over `cfg = step_config(...)`, taking `rest` always."""

    def fn(params, batch, rest):
        window = logit_window(cfg, batch["tokens_BT"].shape[1])
        logits, aux = policy_forward(cfg, graphdef, params, batch, replay=replay, rest=rest, window=window)
        window_BK = aux.get("logit_positions_BK")
        return _token_logprobs(cfg, logits, batch["tokens_BT"], processed=processed, positions_BK=window_BK)

    jitted = distributed.Together(jax.jit(fn), "logprobs")
    keys = ("tokens_BT", "positions_BT", "mask_BT") + (("expert_indices",) if replay else ())

    def on_mesh(params, batch, rest, *, run=jitted):
        with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
            return run(params, _select(batch, keys), rest)

    on_mesh.compile = functools.partial(on_mesh, run=jitted.compile)
    return on_mesh


def _policy_loss(cfg, logits_BTV: jax.Array, mb: Batch, mask_BT: jax.Array, positions_BK=None):
    """The GRPO objective (and its metrics) over the tokens of `mask_BT`; `positions_BK`: the logits'
    window (`policy_forward`)."""
    logp_BT = _token_logprobs(cfg, logits_BTV, mb["tokens_BT"], positions_BK=positions_BK)
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
            _token_logprobs(cfg, logits_BTV, mb["tokens_BT"], processed=False, positions_BK=positions_BK)
            if _filtered(cfg)
            else None
        ),
    )


def _grpo_metrics(cfg, logits_BTV, aux, mb: Batch, w, num_micro: int):
    """(`w * GRPO loss + moe_loss / M` of the micro-batch, its metrics): see `_grpo_loss`."""
    positions_BK = aux.get("logit_positions_BK")
    loss, metrics = _policy_loss(cfg, logits_BTV, mb, mb["mask_BT"], positions_BK)
    # Train-inference mismatch: the sampler's log-probs against the trainer's before any update.
    proximal_BT = mb.get("proximal_logp_BT")
    if proximal_BT is None:
        logp_BT = _token_logprobs(cfg, logits_BTV, mb["tokens_BT"], positions_BK=positions_BK)
        proximal_BT = jax.lax.stop_gradient(logp_BT)
    metrics.update(
        grpo.mismatch_metrics(proximal_BT, mb["behaviour_logp_BT"], mb["mask_BT"], band=cfg.rl.mismatch_band)
    )
    metrics = {k: v if _is_extreme(k) else w * v for k, v in metrics.items()}
    moe = aux["moe_loss"] / num_micro
    metrics.update(moe_loss=moe, advantage_mean=jnp.mean(mb["advantages_B"]) / num_micro)
    metrics["loss"] = w * loss + moe
    return metrics["loss"], _with_load(metrics, aux, num_micro)


def _grpo_loss(cfg, graphdef, params, mb: Batch, w, num_micro: int):
    """`w * GRPO loss + moe_loss / M` of one micro-batch, and its metrics (means weighted by w; extremes,
    `*_max` / `*_min`, unweighted: the step takes their max / min over micro-batches; `expert_load`, for
    the bias update, is popped by the step)."""
    window = logit_window(cfg, mb["tokens_BT"].shape[1])
    logits_BTV, aux = policy_forward(cfg, graphdef, params, mb, window=window)
    return _grpo_metrics(cfg, logits_BTV, aux, mb, w, num_micro)


def _grpo_domain_losses(cfg, graphdef, params, mb: Batch, w, num_micro: int, *, units_fn, num_domains: int):
    """([D] per-domain losses whose sum is `_grpo_loss`'s loss, the same metrics), for the gradient
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


def _sft_loss(cfg, graphdef, params, mb: Batch, w, num_micro: int, *, mtp_weight: float = 0.0):
    """`w * masked next-token cross-entropy + moe_loss / M` of one micro-batch, plus `mtp_weight * w *`
    the MTP modules' loss (`model.mtp.mtp_loss`) on the same masked tokens when mtp_weight > 0."""
    model = _as_model_def(graphdef).merge(params)
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


def _units_M(aggregation: str, mask_MBT: jax.Array) -> jax.Array:
    """How many units each micro-batch's loss is a mean over, for the aggregation in use."""
    if aggregation == "token-mean":
        return mask_MBT.sum(axis=(1, 2))
    if aggregation == "seq-mean-token-mean":
        return (mask_MBT.sum(axis=2) > 0).sum(axis=1).astype(jnp.float32)
    # seq-mean-token-sum-norm is a mean over rows, and micro-batches hold equal rows. Any other registered
    # aggregation is averaged with equal weights too: exact only if it is a mean over rows.
    return jnp.ones(mask_MBT.shape[:1], jnp.float32)


# --- Steps --------------------------------------------------------------------------------------------------


def _split(x: jax.Array, axis: int, num_micro: int) -> jax.Array:
    """[..., B, ...] -> [M, ..., B / M, ...]; micro-batch m holds rows m, m + M, m + 2M, ..."""
    b = x.shape[axis]
    x = x.reshape(x.shape[:axis] + (b // num_micro, num_micro) + x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis + 1, 0)


def _make_step(cfg, graphdef, mesh, keys, loss_fn, units_fn, domains: tuple[str, ...] | None = None):
    """The jitted step; with `domains` (rl.gradient_projection) `loss_fn` returns one loss per domain and
    the step projects the domains' gradients (rl/projection.py) before the optimizer sees their sum."""
    num_micro = int(cfg.rl.micro_batches)
    if num_micro < 1:
        raise ValueError(f"rl.micro_batches={num_micro} must be >= 1")
    rules = tuple(cfg.mesh.rules)
    optimizer, schedule = make_optimizer(cfg.rl.optim), make_schedule(cfg.rl.optim)
    bias_rate = float(cfg.model.moe.bias_update_rate)

    def step(state: TrainState, batch: Batch):
        model_def = _as_model_def(graphdef)._replace(rest=state.model_state)
        rows = batch["tokens_BT"].shape[0]
        if rows % num_micro:
            raise ValueError(f"rl.micro_batches={num_micro} does not divide the batch of {rows} rows")
        micro = {k: _split(v, 1 if k == "expert_indices" else 0, num_micro) for k, v in batch.items()}
        units_M = units_fn(micro["mask_BT"].astype(jnp.float32))
        total = units_M.sum()
        w_M = jnp.where(total > 0, units_M / jnp.maximum(total, 1e-30), 1.0 / num_micro)

        def gradient(mb, w):
            if domains is None:
                grad_fn = jax.grad(lambda p: loss_fn(cfg, model_def, p, mb, w, num_micro), has_aux=True)
                return grad_fn(state.params)
            # One forward, then one backward per domain (the one-hot cotangents in turn): g_D, [D, ...]
            # leaves. Not a vmap over the cotangents: jitted on the demo's MoE batch (128 x 52) the vmapped
            # backward gave a domain without rows a gradient of norm 0.28 (its own vjp: 0; eagerly: 0).
            losses_D, vjp_fn, metrics = jax.vjp(
                lambda p: loss_fn(cfg, model_def, p, mb, w, num_micro), state.params, has_aux=True
            )
            eye_DD = jnp.eye(losses_D.shape[0], dtype=losses_D.dtype)
            g_D = [vjp_fn(eye_DD[d])[0] for d in range(losses_D.shape[0])]
            return jax.tree.map(lambda *g: jnp.stack(g), *g_D), metrics

        def body(grads, xs):
            mb, w = xs
            mb = {k: sharding.constrain(v, BATCH_AXES[k], rules) for k, v in mb.items()}
            g, metrics = gradient(mb, w)
            return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g), metrics

        lead = () if domains is None else (len(domains),)
        zeros = jax.tree.map(lambda p: jnp.zeros(lead + p.shape, jnp.float32), state.params)
        if num_micro == 1:  # no loop to compile: the one micro-batch's gradient is the sum
            grads, metrics = body(zeros, jax.tree.map(lambda x: x[0], (micro, w_M)))
            metrics_M = jax.tree.map(lambda x: x[None], metrics)
        else:
            grads, metrics_M = jax.lax.scan(body, zeros, (micro, w_M))
        load_MLE = metrics_M.pop("expert_load", None)
        metrics = {k: _reduce_micro(k, v) for k, v in metrics_M.items()}
        if domains is not None:
            grads, projected = projection.project(grads, domains)
            metrics.update(projected)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        model_state = state.model_state
        if bias_rate > 0 and load_MLE is not None and jax.tree.leaves(model_state):
            model_state = update_bias_state(model_state, jnp.mean(load_MLE, axis=0), bias_rate)
        metrics.update(
            grad_norm=optax.tree.norm(grads),
            lr=schedule(state.step),
            tokens=batch["mask_BT"].astype(jnp.float32).sum(),
            step=state.step,
        )
        new = state.replace(params=params, opt_state=opt_state, step=state.step + 1, model_state=model_state)
        return new, metrics

    if mesh is None:
        jitted = jax.jit(step, donate_argnums=0)
        step_fn = lambda state, batch: jitted(state, _select(batch, keys))
        step_fn.compile = lambda state, batch: jitted.lower(state, _select(batch, keys)).compile()
        return step_fn
    state_shardings = _tree_shardings(_abstract_state(cfg, optimizer), mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    by_rows: dict[int, tuple] = {}  # one executable per batch row count (rollout batch, mini-batch, SFT)

    def executable(batch):
        rows = int(batch["tokens_BT"].shape[0])
        if rows not in by_rows:
            shardings = _batch_shardings(keys, mesh, rules, rows)
            jitted = jax.jit(
                step,
                in_shardings=(state_shardings, shardings),
                out_shardings=(state_shardings, replicated),
                donate_argnums=0,
            )
            by_rows[rows] = (distributed.Together(jitted, f"train_step:{rows}"), shardings)
        return by_rows[rows]

    def step_fn(state, batch):
        batch = _select(batch, keys)
        jitted, shardings = executable(batch)
        with jax.set_mesh(mesh):
            return jitted(state, _placed(batch, shardings))

    def compile(state, batch) -> None:
        """The executable `step_fn(state, batch)` runs, compiled and not run (`batch` may hold
        `jax.ShapeDtypeStruct`s); `state` is not donated."""
        batch = _select(batch, keys)
        jitted, shardings = executable(batch)
        abstract = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in batch.items()
        }
        with jax.set_mesh(mesh):
            jitted.compile(state, abstract)

    step_fn.compile = compile
    return step_fn


def _placed(batch: Batch, shardings: dict[str, NamedSharding]) -> Batch:
    """Host rows (the same on every process) or global arrays, in the step's shardings."""
    return {
        k: v if isinstance(v, jax.Array) and v.sharding == shardings[k] else jax.device_put(v, shardings[k])
        for k, v in batch.items()
    }


def _reduce_micro(name: str, values_M: jax.Array) -> jax.Array:
    if name.endswith("_max"):
        return values_M.max(axis=0)
    if name.endswith("_min"):
        return values_M.min(axis=0)
    return values_M.sum(axis=0)  # already weighted by each micro-batch's share


def _select(batch: Batch, keys: tuple[str, ...]) -> Batch:
    if "expert_indices" in keys:
        _require_replay(batch)
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ValueError(f"the batch lacks {missing}; it has {sorted(batch)}")
    return {k: batch[k] for k in keys}


def grpo_batch_keys(cfg: ml_collections.ConfigDict) -> tuple[str, ...]:
    """The batch entries a GRPO step reads under `cfg` (others are ignored)."""
    keys = ("tokens_BT", "positions_BT", "mask_BT", "advantages_B", "behaviour_logp_BT")
    if cfg.rl.loss.kl_kind != "none":
        keys += ("ref_logp_BT",)
    if updates_per_batch(cfg) > 1:
        keys += ("proximal_logp_BT",)
    if cfg.rl.routing_replay:
        keys += ("expert_indices",)
    if cfg.rl.get("gradient_projection", False):
        keys += ("domain_B",)
    return keys


def updates_per_batch(cfg: ml_collections.ConfigDict) -> int:
    """Optimizer steps one rollout batch takes: rl.ppo_epochs * rl.mini_batches."""
    return int(cfg.rl.ppo_epochs) * int(cfg.rl.mini_batches)


def make_train_step(cfg: ml_collections.ConfigDict, graphdef, *, mesh: jax.sharding.Mesh | None = None):
    """`step_fn(state, batch) -> (state, metrics)`: one GRPO update (see the module docstring). Shared by
    every call with the same `step_config`, graph definition and mesh: a second main job in one process
    (a notebook's, a test worker's) neither traces nor compiles it again."""
    grpo.validate_loss_config(cfg.rl.loss)
    return _train_step(step_config(cfg), _as_model_def(graphdef).graphdef, mesh, grpo_batch_keys(cfg))


@functools.lru_cache(maxsize=16)
def _train_step(cfg, graphdef: nnx.GraphDef, mesh, keys: tuple[str, ...]):
    units = lambda mask_MBT: _units_M(cfg.rl.loss.aggregation, mask_MBT)
    if not cfg.rl.get("gradient_projection", False):
        return _make_step(cfg, graphdef, mesh, keys, _grpo_loss, units)
    domains = tuple(cfg.rl.domains)
    loss = functools.partial(_grpo_domain_losses, units_fn=units, num_domains=len(domains))
    return _make_step(cfg, graphdef, mesh, keys, loss, units, domains)


def make_sft_step(
    cfg: ml_collections.ConfigDict,
    graphdef,
    *,
    mesh: jax.sharding.Mesh | None = None,
    mtp_weight: float = 0.0,
):
    """`step_fn(state, batch) -> (state, metrics)`: one supervised update on the masked tokens of
    tokens_BT (cross-entropy + moe_loss, + mtp_weight * mtp_loss: rl.sft.mtp_weight for the warm start),
    same state and optimizer as GRPO; routing is never replayed."""
    if mtp_weight and not cfg.model.mtp_layers:
        raise ValueError(f"mtp_weight={mtp_weight} needs MTP modules (model.mtp_layers > 0)")
    return _sft_step(step_config(cfg), _as_model_def(graphdef).graphdef, mesh, float(mtp_weight))


@functools.lru_cache(maxsize=16)
def _sft_step(cfg, graphdef: nnx.GraphDef, mesh, mtp_weight: float):
    # The target of position t is token t + 1, counted where mask[:, t + 1]: micro-batches weigh by those.
    # So does the MTP loss: depth k's targets are the same masked tokens less any at index <= k (none in a row
    # that starts with a prompt of more than k tokens).
    units = lambda mask_MBT: mask_MBT[:, :, 1:].sum(axis=(1, 2))
    loss = functools.partial(_sft_loss, mtp_weight=float(mtp_weight))
    return _make_step(cfg, graphdef, mesh, SFT_KEYS, loss, units)


# The reference's `rest`: its selection biases are in its weights (`reference_weights`), not the ModelDef's.
NO_REST = nnx.State({})


def make_grpo_update(cfg: ml_collections.ConfigDict, graphdef, *, mesh: jax.sharding.Mesh | None = None):
    """`update(state, batch, *, ref_params=None) -> (state, metrics)`: what one rollout batch does to the
    parameters (module docstring). `batch` holds host (numpy) arrays of `rl.prompts_per_step * group_size`
    rows; `ref_params` is the frozen reference's weights (`reference_weights`; needed when rl.loss.kl_kind is
    set; for a model with selection biases they are part of it). Metrics are means over
    the updates, `*_max` / `*_min` their extremes, and `updates` the count."""
    rl = cfg.rl
    step_fn = make_train_step(cfg, graphdef, mesh=mesh)
    proximal_fn = make_logprobs(cfg, graphdef, mesh=mesh)
    ref_fn = make_logprobs(cfg, graphdef, replay=False, processed=False, mesh=mesh)
    epochs, minis = int(rl.ppo_epochs), int(rl.mini_batches)
    use_kl = rl.loss.kl_kind != "none"

    def mini_rows(rows: int) -> int:
        if rows % minis:
            raise ValueError(f"rl.mini_batches={minis} does not divide the batch of {rows} rows")
        return rows // minis

    def update(state: TrainState, batch: dict, *, ref_params: nnx.State | None = None):
        batch = dict(batch)
        on_device = isinstance(batch["tokens_BT"], jax.Array)  # global arrays (rl.distributed.global_batch)
        keep = (lambda x: x) if on_device else np.asarray
        if use_kl:
            if ref_params is None:
                raise ValueError(f"rl.loss.kl_kind={rl.loss.kl_kind!r} needs the reference parameters")
            batch["ref_logp_BT"] = keep(ref_fn(ref_params, batch, NO_REST))
        if epochs * minis > 1:
            batch["proximal_logp_BT"] = keep(proximal_fn(state.params, batch, state.model_state))
        rows = batch["tokens_BT"].shape[0]
        per = mini_rows(rows)
        # Per-pass row order: a function of the seed and the optimizer step (exact resume).
        rng = np.random.default_rng([int(rl.seed), int(state.step)])
        history = []
        for _ in range(epochs):
            order = rng.permutation(rows) if minis > 1 else np.arange(rows)
            for m in range(minis):
                idx = np.sort(order[m * per : (m + 1) * per])
                mb = batch if minis == 1 else _take_rows(batch, idx)
                state, metrics = step_fn(state, mb)
                history.append(jax.device_get(metrics))
        return state, _combine_updates(history)

    def compile(state: TrainState, batch: dict, *, ref_params: nnx.State | None = None) -> None:
        """Compiles every executable `update(state, batch, ref_params=...)` runs (reference and proximal
        log-probs, the train step at the batch's and the mini-batches' row count) without running any:
        `state` is neither changed nor donated. `batch`: one of the rollout batches' shapes, placed as they
        are (`rl.rollout.empty_batch` through `rl.distributed.global_batch`). The main job compiles the
        update this way while the engine warms up."""
        batch = dict(batch)
        rows = batch["tokens_BT"].shape[0]
        per = mini_rows(rows)
        per_BT = jax.ShapeDtypeStruct(batch["tokens_BT"].shape, jnp.float32)
        if use_kl:
            ref_fn.compile(ref_params, batch, NO_REST)
            batch["ref_logp_BT"] = per_BT
        if epochs * minis > 1:
            proximal_fn.compile(state.params, batch, state.model_state)
            batch["proximal_logp_BT"] = per_BT
        if minis > 1:
            batch = {
                k: jax.ShapeDtypeStruct(v.shape[:axis] + (per,) + v.shape[axis + 1 :], v.dtype)
                for k, v in batch.items()
                for axis in [ROW_AXIS[k]]
            }
        step_fn.compile(state, batch)

    update.compile = compile
    return update


def _take_rows(batch: Batch, idx_R: np.ndarray) -> Batch:
    """The rows `idx_R` of every entry (along its `ROW_AXIS`): host arrays are indexed on the
    host, global arrays on their devices (the same indices on every process)."""
    out = {}
    for k, v in batch.items():
        axis = ROW_AXIS[k]
        out[k] = (
            jnp.take(v, jnp.asarray(idx_R), axis=axis)
            if isinstance(v, jax.Array)
            else np.take(v, idx_R, axis)
        )
    return out


def _combine_updates(history: list[dict]) -> dict[str, float]:
    out = {}
    for name in history[0]:
        values = np.asarray([float(h[name]) for h in history])
        if name.endswith("_max"):
            out[name] = float(values.max())
        elif name.endswith("_min"):
            out[name] = float(values.min())
        else:
            out[name] = float(values.mean())
    out["updates"] = float(len(history))
    return out
