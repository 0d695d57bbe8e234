"""Mixture-of-Experts block: f32 router, top-k dispatch (dropless ragged or capacity), shared experts.

Dimension key: B batch, T tokens, D model width, F expert width, E experts, k experts per token,
C capacity slots per expert (per sequence), A = T * k assignments, R rows of an expert buffer,
M = B * C rows of one expert in the capacity buffer, W rows of one window of the CPU ragged path.

Routers:
- softmax: probs = softmax(logits); the top-k probs are the combine weights (optionally renormalised).
- sigmoid (DeepSeek-V3): scores = sigmoid(logits); experts are *selected* by scores + bias, where the bias
  is an `ExpertBias` variable nudged toward balance by `update_expert_bias` (aux-loss-free); combine weights
  are the unbiased scores of the chosen experts, renormalised, times `routed_scaling`.
- group-limited (`n_group` > 1, DeepSeek-V3): experts form `n_group` contiguous groups; a token's top-k
  is taken among the `topk_group` groups whose two best selection scores sum highest.

Dispatch:
- ragged: assignments sorted by expert, `jax.lax.ragged_dot` over contiguous groups; drops nothing. On
  CPU, where ragged_dot computes every expert over every row, `grouped_swiglu` loops over each expert's
  rows in W-row windows instead.
- capacity: per sequence, each expert gets C = ceil(capacity_factor * T * k / E) slots; assignments past
  C (in token order) are dropped and counted. The buffer is expert-major, [E, B * C, D], so each expert
  is one plain matmul over all its rows. With C >= T nothing drops and the output equals ragged.
- expert parallel (`moe.expert_parallel`, experts sharded over a mesh axis): either of the above as a
  `jax.shard_map` with an all-to-all of the routed tokens (model/moe/parallel.py); the same outputs.
- small-token gather (`moe.gather_max_tokens`, decode-size batches, experts not sharded): each token
  gathers its top-k experts' weights, no sort (`moe_dispatch.gathered_swiglu`); the same outputs.
- every expert (`moe.every_expert_max_tokens`, decode-size batches, experts not sharded): three matmuls
  over the stacked experts, the top-k routing weights zeroing the others (`moe_dispatch.every_expert_swiglu`);
  the same outputs up to f32 rounding.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from model import layers, sharding
from model.moe import local as moe_local
from model.moe import parallel as moe_parallel
from model.moe.dispatch import (
    combine_rows,
    every_expert_swiglu,
    gather_rows,
    gathered_swiglu,
    invert_rows,
    ragged_dispatch,
    sort_by_expert,
    swiglu_experts,
)

EXPERT_ROWS = ("act_exp", "act_tokens", None)  # capacity buffer [E, B * C, D]
# Default of `model.moe.gather_max_tokens` until configs/base.py carries the field (0: never gather;
# -1: while B * T * top_k <= num_experts, so the gather reads no more expert weights than the dispatch).
GATHER_MAX_TOKENS = 0


class ExpertBias(nnx.Variable):
    """Selection bias of aux-loss-free balancing: changed by `update_expert_bias`, not by gradients."""


def route(
    logits_TE: jax.Array,
    *,
    router: str,
    top_k: int,
    renormalize: bool,
    bias_E: jax.Array | None = None,
    forced_idx_Tk: jax.Array | None = None,
    n_group: int = 1,
    topk_group: int = 1,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (combine weights [T, k], expert indices [T, k], routing probabilities [T, E]).

    `forced_idx_Tk` (routing replay) fixes which experts are used; weights still come from the
    current logits so gradients flow to the router. With `n_group` > 1 the experts form that many
    contiguous groups and a token picks its top-k among the `topk_group` groups whose two best selection
    scores sum highest (DeepSeek-V3's group-limited routing).
    """
    logits_TE = logits_TE.astype(jnp.float32)
    if router == "softmax":
        probs_TE = jax.nn.softmax(logits_TE, axis=-1)
        select_TE = probs_TE
    elif router == "sigmoid":
        probs_TE = jax.nn.sigmoid(logits_TE)
        select_TE = probs_TE if bias_E is None else probs_TE + bias_E[None, :]
    else:
        raise ValueError(f"model.moe.router={router!r}; choose softmax or sigmoid")
    if forced_idx_Tk is None:
        select_TE = jax.lax.stop_gradient(select_TE)
        if n_group > 1:
            select_TE = limit_to_groups(select_TE, n_group, topk_group)
        _, idx_Tk = jax.lax.top_k(select_TE, top_k)
    else:
        idx_Tk = forced_idx_Tk.astype(jnp.int32)
    w_Tk = jnp.take_along_axis(probs_TE, idx_Tk, axis=-1)
    if renormalize:
        w_Tk = w_Tk / (jnp.sum(w_Tk, axis=-1, keepdims=True) + 1e-20)
    return w_Tk, idx_Tk, probs_TE


def limit_to_groups(select_TE: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """Selection scores with every expert outside each token's `topk_group` best groups set to -inf;
    a group's score is the sum of its two highest selection scores."""
    t, e = select_TE.shape
    select_TGX = select_TE.reshape(t, n_group, e // n_group)
    group_TG = jnp.sum(jax.lax.top_k(select_TGX, 2)[0], axis=-1)
    _, keep_Tg = jax.lax.top_k(group_TG, topk_group)
    keep_TG = jnp.zeros((t, n_group), bool).at[jnp.arange(t)[:, None], keep_Tg].set(True)
    return jnp.where(keep_TG[:, :, None], select_TGX, -jnp.inf).reshape(t, e)


def load_balance_loss(probs_TE: jax.Array, idx_Tk: jax.Array, router: str) -> tuple[jax.Array, jax.Array]:
    """Switch-Transformer loss E * sum_e f_e * P_e and the load fractions f_e.

    f_e: fraction of the T*k assignments sent to e (not differentiable); P_e: mean routing probability
    of e (scores normalised per token for the sigmoid router). Uniform routing gives exactly 1.
    """
    num_experts = probs_TE.shape[-1]
    counts_E = jnp.zeros((num_experts,), jnp.float32).at[idx_Tk.reshape(-1)].add(1.0)
    f_E = counts_E / idx_Tk.size
    if router == "sigmoid":
        probs_TE = probs_TE / jnp.sum(probs_TE, axis=-1, keepdims=True)
    p_E = jnp.mean(probs_TE, axis=0)
    return num_experts * jnp.sum(f_E * p_E), f_E


def z_loss(logits_TE: jax.Array) -> jax.Array:
    """Router z-loss: mean squared log-partition function (keeps router logits small)."""
    return jnp.mean(jax.nn.logsumexp(logits_TE.astype(jnp.float32), axis=-1) ** 2)


def update_expert_bias(bias_E: jax.Array, load_E: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free balancing step: raise the bias of under-loaded experts, lower over-loaded ones."""
    target = 1.0 / bias_E.shape[-1]
    return bias_E + rate * jnp.sign(target - load_E)


def update_bias_state(state: nnx.State, load_LE: jax.Array, rate: float) -> nnx.State:
    """`update_expert_bias` on the `ExpertBias` of every layer of `moe_layers` in `state` (a model's non-Param
    state: one stacked [L, E] bias with `scan_layers`, else L biases [E] in layer order) from the per-layer
    expert loads [L, E]. Other biases (an MTP module's) are kept."""
    leaves, treedef = jax.tree.flatten(state["moe_layers"])
    if len(leaves) == 1:
        new = [update_expert_bias(leaves[0], load_LE.reshape(leaves[0].shape), rate)]
    else:
        new = [update_expert_bias(b, load_LE[i], rate) for i, b in enumerate(leaves)]
    # A shallow copy of the raw mapping: `dict(state)` would wrap every sub-tree (e.g. an MTP module's) in a
    # State, a different pytree node than the state that came in (a jit's out_shardings would not match).
    out = nnx.State(dict(state.raw_mapping))
    out["moe_layers"] = jax.tree.unflatten(treedef, new)
    return out


def capacity(tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    return max(1, math.ceil(factor * tokens * top_k / num_experts))


def capacity_rows(idx_BTk: jax.Array, num_experts: int, cap: int):
    """Capacity buffer of B sequences in expert-major order: row (e * B + b) * C + c is slot c of expert
    e in sequence b, so each expert's rows are contiguous [B * C]. Assignments past slot C - 1 of their
    expert (in token order) are dropped. Returns assign_R, row_A, kept [B, A]."""
    b, t, k = idx_BTk.shape
    pos_BA = jax.vmap(lambda i: sort_by_expert(i, num_experts)[2])(idx_BTk)
    kept_BA = pos_BA < cap
    e_BA = idx_BTk.reshape(b, t * k)
    seq_B1 = jnp.arange(b, dtype=jnp.int32)[:, None]
    num_rows = num_experts * b * cap
    row_BA = jnp.where(kept_BA, (e_BA * b + seq_B1) * cap + pos_BA, num_rows)
    row_A = row_BA.reshape(-1).astype(jnp.int32)
    return invert_rows(row_A, num_rows), row_A, kept_BA


class MoEBlock(nnx.Module):
    def __init__(self, m: ml_collections.ConfigDict, rules, *, rngs: nnx.Rngs):
        e = m.moe
        d, f, n = m.d_model, e.d_ff, e.num_experts
        pd = m.param_dtype
        self.router = layers.param(rngs, (d, n), ("embed", None), std=d**-0.5, dtype=jnp.float32)
        self.gate = layers.param(rngs, (n, d, f), ("exp", "embed", "mlp"), std=d**-0.5, dtype=pd)
        self.up = layers.param(rngs, (n, d, f), ("exp", "embed", "mlp"), std=d**-0.5, dtype=pd)
        self.down = layers.param(rngs, (n, f, d), ("exp", "mlp", "embed"), std=f**-0.5, dtype=pd)
        if e.router == "sigmoid":
            self.expert_bias = ExpertBias(jnp.zeros((n,), jnp.float32), logical_axes=(None,))
        if e.num_shared_experts:
            self.shared = layers.MLP(m, e.shared_d_ff * e.num_shared_experts, rules, rngs=rngs)
        self.moe = e
        self.compute_dtype = layers.dtype_of(m.compute_dtype)
        self.rules = rules

    def __call__(
        self, x_BTD: jax.Array, *, expert_indices_BTk: jax.Array | None = None
    ) -> tuple[jax.Array, dict]:
        e, cdt = self.moe, self.compute_dtype
        b, t, d = x_BTD.shape
        n = e.num_experts
        logits_BTE = layers.matmul_rows(x_BTD.astype(jnp.float32), self.router[...].astype(jnp.float32))
        bias = self.expert_bias[...] if e.router == "sigmoid" else None
        forced = None if expert_indices_BTk is None else expert_indices_BTk.reshape(b * t, -1)
        w_Tk, idx_Tk, probs_TE = route(
            logits_BTE.reshape(b * t, n),
            router=e.router,
            top_k=e.top_k,
            renormalize=e.renormalize,
            bias_E=bias,
            forced_idx_Tk=forced,
            n_group=e.n_group,
            topk_group=e.topk_group,
        )
        w_Tk = w_Tk * e.routed_scaling
        gate, up, down = (p[...].astype(cdt) for p in (self.gate, self.up, self.down))
        x_BTD = x_BTD.astype(cdt)
        y_BTD, dropped = self._routed(x_BTD, idx_Tk, w_Tk, gate, up, down)
        if e.num_shared_experts:
            y_BTD = y_BTD + self.shared(x_BTD)
        lb, load_E = load_balance_loss(probs_TE, idx_Tk, e.router)
        aux = {
            "load_balance_loss": lb,
            "router_z_loss": z_loss(logits_BTE.reshape(b * t, n)),
            "expert_load": load_E,
            "dropped_tokens": dropped,
            "dropped_fraction": dropped / (b * t * e.top_k),
            "expert_indices": idx_Tk.reshape(b, t, -1),
        }
        return y_BTD.astype(cdt), aux

    def _routed(self, x_BTD, idx_Tk, w_Tk, gate, up, down) -> tuple[jax.Array, jax.Array]:
        """The routed experts' output [B, T, D] and the dropped assignment count, by one of: the
        expert-parallel shard_map (experts sharded, `moe_parallel.layout`), the small-token gather
        (experts not sharded and B * T <= `gather_max_tokens`, or with -1 B * T * k <= E), ragged, or
        capacity. The token count is static, so the choice is made at trace time."""
        e, rules = self.moe, self.rules
        b, t, d = x_BTD.shape
        n, k = e.num_experts, e.top_k
        cap = capacity(t, k, n, e.capacity_factor) if e.impl == "capacity" else None
        none_dropped = jnp.zeros((), jnp.float32)
        mesh = jax.sharding.get_abstract_mesh()
        sizes = {} if mesh.empty else dict(zip(mesh.axis_names, mesh.axis_sizes))
        layout = moe_parallel.layout(e, rules, sizes, (b, t), cap)
        if layout is not None:
            kept_BA = (
                jnp.ones((b, t * k), bool)
                if cap is None
                else capacity_rows(idx_Tk.reshape(b, t, k), n, cap)[2]
            )
            kept_BTk = kept_BA.reshape(b, t, k)
            split = lambda a: a.reshape(b, t, k)
            y_BTD, exchange_dropped = moe_parallel.dispatch(
                x_BTD, split(idx_Tk), split(w_Tk), kept_BTk, gate, up, down, layout
            )
            dropped = jnp.sum(1.0 - kept_BA.astype(jnp.float32))
            if layout.capped:  # model.moe.ep_capacity_factor: the exchange's own drops
                dropped = dropped + exchange_dropped.astype(jnp.float32)
            return y_BTD, dropped
        gather_max = e.gather_max_tokens
        if gather_max < -1:
            raise ValueError(
                f"model.moe.gather_max_tokens={gather_max}; use -1 (auto), 0 (never) or a token count"
            )
        small = b * t * k <= n if gather_max == -1 else b * t <= gather_max
        small = small and (cap is None or cap >= t)  # cap >= t: nothing can drop
        if small and not moe_parallel.experts_sharded(rules, sizes):
            y_TD = gathered_swiglu(x_BTD.reshape(b * t, d), idx_Tk, w_Tk, gate, up, down)
            return y_TD.reshape(b, t, d), none_dropped
        every_max = e.get("every_expert_max_tokens", -1)
        if every_max < -1:
            raise ValueError(
                f"model.moe.every_expert_max_tokens={every_max}; use -1 (the engine's decode steps), "
                "0 (never) or a token count"
            )
        every = b * t <= every_max and (cap is None or cap >= t)  # -1: the engine sets its own count
        if every and not moe_parallel.experts_sharded(rules, sizes):
            y_TD = every_expert_swiglu(x_BTD.reshape(b * t, d), idx_Tk, w_Tk, gate, up, down)
            return y_TD.reshape(b, t, d), none_dropped
        if cap is None:
            if moe_local.applies(rules, sizes, b):  # a data / FSDP mesh: each shard its own tokens
                split = lambda a: a.reshape(b, t, k)  # noqa: E731
                y_BTD = moe_local.local_ragged(x_BTD, split(idx_Tk), split(w_Tk), gate, up, down, rules)
                return y_BTD, none_dropped
            y_TD = ragged_dispatch(x_BTD.reshape(b * t, d), idx_Tk, w_Tk, gate, up, down)
            return y_TD.reshape(b, t, d), none_dropped
        assign_R, row_A, kept_BA = capacity_rows(idx_Tk.reshape(b, t, -1), n, cap)
        x_EMD = gather_rows(x_BTD.reshape(b * t, d), assign_R, row_A, k)
        # Rows of one expert are [B * C] with the sequence major: they stay sharded over batch,
        # experts over `expert` (an all-to-all under GSPMD).
        x_EMD = sharding.constrain(x_EMD.reshape(n, b * cap, d), EXPERT_ROWS, rules)
        y_EMD = swiglu_experts(x_EMD, gate, up, down)
        y_EMD = sharding.constrain(y_EMD, EXPERT_ROWS, rules)
        y_BTD = combine_rows(y_EMD.reshape(-1, d), w_Tk, assign_R, row_A).reshape(b, t, d)
        return y_BTD, jnp.sum(1.0 - kept_BA.astype(jnp.float32))
