"""The train step: `step(state, batch) -> (state, metrics)`, one optimizer update, and `make_grpo_update`,
what one rollout batch does (rl.ppo_epochs passes of rl.mini_batches steps).

Dimension key: B sequences, T token positions, L MoE layers, k experts per token, M micro-batches.

`build_step` writes the step once for GRPO and SFT: micro-batch gradients (`lax.scan`, row i in micro-batch
i % M, so every micro-batch spans every data shard), the optional gradient projection, the optimizer update
and the selection-bias update. It is jitted once per batch row count with the train state donated and
`in_shardings` / `out_shardings` from the logical axes (`rl.train_state`).

One rollout batch (`make_grpo_update`): reference log-probs of the frozen step-0 policy (when rl.loss.kl_kind
is set), proximal log-probs of the current policy (once, when there is more than one update), then
rl.ppo_epochs passes over the batch of rl.mini_batches optimizer steps each (rows shuffled per pass). From
the second update on the ratio against the proximal policy moves, and clipping engages.

Gradient projection (`rl.gradient_projection`, `rl/projection.py`): the loss is split by domain
(`losses.grpo_domain_losses`); one forward, one backward per domain, accumulated per domain over
micro-batches; PCGrad removes each domain's conflicting component against the others before the optimizer
sees the sum. D backward passes: D times the backward cost and D gradient buffers.

Aux-loss-free balancing (sigmoid routers, `model.moe.bias_update_rate` > 0): every optimizer step moves each
MoE layer's selection bias by `update_bias_state` from that layer's expert loads over the step's batch (the
mean over micro-batches). The forward of a step routes with the bias as it was before the step.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from model import sharding
from model.moe.layer import update_bias_state
from rl import batch as batch_lib
from rl import distributed, grpo, losses, projection, train_state

Batch = dict[str, jax.Array]


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
    `rl.batch.make_batch(window=...)`); prompt positions hold 0. The jitted function is shared by every call
    with the same `step_config`, graph, options and mesh (`_logprobs`)."""
    model_def = train_state.as_model_def(graphdef)
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
        window = losses.logit_window(cfg, batch["tokens_BT"].shape[1])
        logits, aux = losses.policy_forward(
            cfg, graphdef, params, batch, replay=replay, rest=rest, window=window
        )
        window_BK = aux.get("logit_positions_BK")
        return losses.token_logprobs(
            cfg, logits, batch["tokens_BT"], processed=processed, positions_BK=window_BK
        )

    jitted = distributed.Together(jax.jit(fn), "logprobs")
    keys = ("tokens_BT", "positions_BT", "mask_BT") + (("expert_indices",) if replay else ())

    def on_mesh(params, batch, rest, *, run=jitted):
        with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
            return run(params, _select(batch, keys), rest)

    on_mesh.compile = functools.partial(on_mesh, run=jitted.compile)
    return on_mesh


def _split(x: jax.Array, axis: int, num_micro: int) -> jax.Array:
    """[..., B, ...] -> [M, ..., B / M, ...]; micro-batch m holds rows m, m + M, m + 2M, ..."""
    b = x.shape[axis]
    x = x.reshape(x.shape[:axis] + (b // num_micro, num_micro) + x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis + 1, 0)


def _objective(cfg, objective: str, mtp_weight: float):
    """(loss_fn, units_fn, domains) of "grpo" (domains: rl.gradient_projection's, else None) or "sft"."""
    if objective == "sft":
        # The target of position t is token t + 1, counted where mask[:, t + 1]: micro-batches weigh by
        # those. So does the MTP loss: depth k's targets are the same masked tokens less any at index <= k
        # (none in a row that starts with a prompt of more than k tokens).
        units = lambda mask_MBT: mask_MBT[:, :, 1:].sum(axis=(1, 2))  # noqa: E731
        return functools.partial(losses.sft_loss, mtp_weight=float(mtp_weight)), units, None
    units = lambda mask_MBT: losses.units_M(cfg.rl.loss.aggregation, mask_MBT)  # noqa: E731
    if not cfg.rl.get("gradient_projection", False):
        return losses.grpo_loss, units, None
    domains = tuple(cfg.rl.domains)
    split = functools.partial(losses.grpo_domain_losses, units_fn=units, num_domains=len(domains))
    return split, units, domains


@functools.lru_cache(maxsize=32)
def build_step(
    cfg, graphdef: nnx.GraphDef, mesh, keys: tuple[str, ...], objective: str, mtp_weight: float = 0.0
):
    """`step_fn(state, batch) -> (state, metrics)`: one optimizer update of `objective` ("grpo", "sft") over
    `cfg = step_config(...)`, jitted once per batch row count with the state donated. Shared by every call
    with the same arguments: a second main job in one process (a notebook's, a test worker's) neither
    traces nor compiles it again. With rl.gradient_projection the GRPO loss is one per domain and the
    domains' gradients are projected (rl/projection.py) before the optimizer sees their sum."""
    loss_fn, units_fn, domains = _objective(cfg, objective, mtp_weight)
    num_micro = int(cfg.rl.micro_batches)
    if num_micro < 1:
        raise ValueError(f"rl.micro_batches={num_micro} must be >= 1")
    rules = tuple(cfg.mesh.rules)
    optimizer, schedule = train_state.make_optimizer(cfg.rl.optim), train_state.make_schedule(cfg.rl.optim)
    bias_rate = float(cfg.model.moe.bias_update_rate)

    def step(state: train_state.TrainState, batch: Batch):
        model_def = train_state.as_model_def(graphdef)._replace(rest=state.model_state)
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
            mb = {k: sharding.constrain(v, train_state.BATCH_AXES[k], rules) for k, v in mb.items()}
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
    state_shardings = train_state.tree_shardings(train_state.abstract_state(cfg, optimizer), mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    by_rows: dict[int, tuple] = {}  # one executable per batch row count (rollout batch, mini-batch, SFT)

    def executable(batch):
        rows = int(batch["tokens_BT"].shape[0])
        if rows not in by_rows:
            shardings = train_state.rule_batch_shardings(keys, mesh, rules, rows)
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
        losses.require_replay(batch)
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
    """`step_fn(state, batch) -> (state, metrics)`: one GRPO update (see the module docstring)."""
    grpo.validate_loss_config(cfg.rl.loss)
    model_graph = train_state.as_model_def(graphdef).graphdef
    return build_step(step_config(cfg), model_graph, mesh, grpo_batch_keys(cfg), "grpo")


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
    model_graph = train_state.as_model_def(graphdef).graphdef
    return build_step(step_config(cfg), model_graph, mesh, train_state.SFT_KEYS, "sft", float(mtp_weight))


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

    def update(state: train_state.TrainState, batch: dict, *, ref_params: nnx.State | None = None):
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

    def compile(state: train_state.TrainState, batch: dict, *, ref_params: nnx.State | None = None) -> None:
        """Compiles every executable `update(state, batch, ref_params=...)` runs (reference and proximal
        log-probs, the train step at the batch's and the mini-batches' row count) without running any:
        `state` is neither changed nor donated. `batch`: one of the rollout batches' shapes, placed as they
        are (`rl.batch.empty_batch` through `rl.distributed.global_batch`). The main job compiles the
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
                for axis in [train_state.ROW_AXIS[k]]
            }
        step_fn.compile(state, batch)

    update.compile = compile
    return update


def _take_rows(batch: Batch, idx_R: np.ndarray) -> Batch:
    """The rows `idx_R` of every entry (along its `ROW_AXIS`): host arrays are indexed on the
    host, global arrays on their devices (the same indices on every process)."""
    out = {}
    for k, v in batch.items():
        axis = train_state.ROW_AXIS[k]
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


def warm_up(cfg, engine, update, mesh, state, ref_params, rows: int) -> None:
    """Compiles before the first step: the engine's `warmup()` in a thread beside the update's compile
    (`update.compile`) on an empty batch of the rollout batches' shapes and placement, so the first step
    compiles nothing; an error in either is raised here. The overlap pays on hosts with more cores than one
    compile keeps busy (`python -m benchmarks grpo_ab` measures it)."""
    rl = cfg.rl
    local = batch_lib.empty_batch(
        rows,
        cfg.seq_len,
        routing=(engine.num_moe_layers, cfg.model.moe.top_k) if rl.routing_replay else None,
        domains=tuple(rl.domains) if rl.gradient_projection else None,
    )
    shardings = train_state.batch_shardings(cfg, tuple(local), mesh, cfg.batch_size)
    failed: list[BaseException] = []

    def warm_engine() -> None:
        try:
            engine.warmup()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread below
            failed.append(e)

    thread = threading.Thread(target=warm_engine, name="engine-warmup", daemon=True)
    thread.start()
    try:
        batch = distributed.global_batch(local, shardings, train_state.ROW_AXIS)
        update.compile(state, batch, ref_params=ref_params)
    finally:
        thread.join()
    if failed:
        raise failed[0]
