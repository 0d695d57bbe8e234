"""The engine's device functions: prefill, decode (one step, or `decode_many`: up to N steps in one
`lax.while_loop`), speculative steps, teacher-forced scoring, page copies.

Dimension key: B rows (decode slots or prefill rows), T tokens per row, K draft tokens, K1 = K + 1, V vocab,
M pages per row in the page table.

Each is a pure function of (params, cache arrays, small per-row arrays) built from a model graph definition
and jitted once per shape (`jitted`); the cache arrays are donated, so XLA updates the pages in place. The
cache dict holds the K/V pages `k` / `v` and, when the engine records routing, the record `experts`
(`inference.routing`): every forward through the target writes both.
Per-row arrays (tokens, starts, counts, page tables, sampling parameters, seeds) are traced values, so a new
prompt length, sampling setting or batch composition never retraces: only the bucketed shapes do.

On a mesh (`jitted(..., place=layout.Placement)`) every step gets explicit in/out shardings (weights and
caches as the engine placed them, everything else replicated) and traces under the mesh, so the model's
activation constraints (the inference rules in its graph definition) apply and no later call reshards or
recompiles.

Randomness: the token at index `step` of sample `sample` of request `request` is drawn with the key
`sampling.sample_keys(seed, request, sample, step)`, so runs are reproducible whatever the scheduling, and
the n samples of a prompt never share a key.
"""

from __future__ import annotations

import functools
import platform
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from inference import layout, routing, sampling, speculative
from inference.sampling import SamplingArrays
from model import logprobs
from model.kv_cache import PagedCache, page_keys


def row_keys(seed_B, request_B, sample_B, step_B) -> jax.Array:
    """One key per row, `sample_keys(seed, request, sample, step)` with a per-row seed."""

    def one(seed, request, sample, step):
        key = jax.random.fold_in(jax.random.key(seed), request)
        return jax.random.fold_in(jax.random.fold_in(key, sample), step)

    return jax.vmap(one)(seed_B, request_B, sample_B, step_B)


def _cache(kv: dict, table_BM, start_B, num_new_B) -> PagedCache:
    """The model's paged cache: its page arrays (GQA `k`/`v`, MLA `latent`) and this step's table."""
    pages = {name: kv[name] for name in page_keys(kv)}
    return PagedCache(pages, table_BM, start_B, num_new_B)


def _forward(graphdef, params, kv, tokens_BT, table_BM, start_B, num_new_B, *, hidden: bool = False):
    """The model over a paged cache; returns (logits_BTV, kv with the new tokens' K/V written, and their
    routing when `kv` holds the routing record `experts`), plus the last hidden state [B, T, D] before the
    final norm when `hidden` (what the MTP head reads)."""
    logits_BTV, aux = nnx.merge(graphdef, params)(
        tokens_BT, kv_cache=_cache(kv, table_BM, start_B, num_new_B)
    )
    kv = dict(kv, **aux["kv_cache"])
    if "experts" in kv:
        kv["experts"] = routing.write(kv["experts"], aux["expert_indices"], table_BM, start_B, num_new_B)
    return (logits_BTV, kv, aux["hidden"]) if hidden else (logits_BTV, kv)


def prefill(graphdef, params, kv, tokens_BT, table_BM, start_B, num_new_B):
    """Writes the K/V of `num_new_B` tokens per row at positions start.. into the pages. The logits are
    unused, so XLA drops the unembedding."""
    return _forward(graphdef, params, kv, tokens_BT, table_BM, start_B, num_new_B)[1]


def _processed_rows(logits_BTV, arrays: SamplingArrays):
    """processed_logprobs at every position of each row, with the row's parameters."""
    b, t, v = logits_BTV.shape
    rep = SamplingArrays(*(jnp.repeat(a, t) for a in arrays))
    return sampling.processed_logprobs(logits_BTV.reshape(b * t, v), rep).reshape(b, t, v)


class Rows(NamedTuple):
    """The decode slots' per-row inputs: pending tokens (fed at position start), page tables, starts,
    active flags (0/1), sampling parameters and key names (seed, request, sample, step)."""

    pending_B: jax.Array
    table_BM: jax.Array
    start_B: jax.Array
    active_B: jax.Array
    arrays: SamplingArrays
    keys: tuple


def decode(graphdef, params, kv, rows: Rows):
    """One token per active row: feeds the pending token at position start, samples the next one.

    Returns (kv, next_B, logp_B under the processed distribution, raw_logp_B untempered)."""
    tokens_BT = rows.pending_B[:, None]
    logits_BTV, kv = _forward(graphdef, params, kv, tokens_BT, rows.table_BM, rows.start_B, rows.active_B)
    logits_BV = logits_BTV[:, 0]
    logp_BV = sampling.processed_logprobs(logits_BV, rows.arrays)
    next_B, logp_B = sampling.sample_from_logprobs(row_keys(*rows.keys), logp_BV)
    return kv, next_B, logp_B, sampling.raw_logprobs(logits_BV, next_B)


def _advanced(rows: Rows, pending_B, active_B, by) -> Rows:
    """`rows` as a single-step call would get them `by` tokens later (a scalar or per row): the pending
    token and active flags given, the starts and the keys' step moved on by `by`."""
    seed_B, request_B, sample_B, step_B = rows.keys
    return rows._replace(
        pending_B=pending_B,
        start_B=rows.start_B + by,
        active_B=active_B,
        keys=(seed_B, request_B, sample_B, step_B + by),
    )


def decode_many(graphdef, params, kv, rows: Rows, stop_BS, budget_B, *, num_steps: int):
    """Up to `num_steps` tokens per active row in one device call: a `lax.while_loop` of `decode` steps.

    A row's token at loop step i is drawn with the key of step `rows.keys` step + i (the key one `decode` call
    per token would use), so the tokens are those of `num_steps` single steps. A row stops after a token in
    its `stop_BS` row (padded with -1) or after `budget_B` tokens; a stopped row is fed as inactive (no K/V
    written) until the loop ends, which it does after num_steps steps or when no row is active. The pages of
    positions start .. start + budget - 1 must be reserved. N = num_steps. Returns (kv, tokens_BN,
    logp_BN, raw_BN, count_B): the first count_B entries of each row are its tokens."""
    b, n = rows.pending_B.shape[0], num_steps

    def cond(carry):
        i, _, _, active_B, *_ = carry
        return (i < n) & jnp.any(active_B > 0)

    def body(carry):
        i, kv, pending_B, active_B, tokens_BN, logp_BN, raw_BN, count_B = carry
        kv, next_B, logp_B, raw_B = decode(graphdef, params, kv, _advanced(rows, pending_B, active_B, i))
        live_B = active_B > 0
        put = lambda out_BN, x_B: jax.lax.dynamic_update_slice_in_dim(
            out_BN, jnp.where(live_B, x_B, jnp.zeros_like(x_B))[:, None], i, axis=1
        )
        count_B = count_B + live_B.astype(jnp.int32)
        stopped_B = jnp.any(next_B[:, None] == stop_BS, axis=1) | (count_B >= budget_B)
        active_B = jnp.where(live_B & ~stopped_B, 1, 0).astype(active_B.dtype)
        pending_B = jnp.where(live_B, next_B, pending_B)
        return (
            i + 1,
            kv,
            pending_B,
            active_B,
            put(tokens_BN, next_B),
            put(logp_BN, logp_B),
            put(raw_BN, raw_B),
            count_B,
        )

    zeros = lambda dtype: jnp.zeros((b, n), dtype)
    init = (
        jnp.int32(0),
        kv,
        rows.pending_B,
        rows.active_B,
        zeros(jnp.int32),
        zeros(jnp.float32),
        zeros(jnp.float32),
        jnp.zeros((b,), jnp.int32),
    )
    _, kv, _, _, tokens_BN, logp_BN, raw_BN, count_B = jax.lax.while_loop(cond, body, init)
    return kv, tokens_BN, logp_BN, raw_BN, count_B


def _verify(
    graphdef, params, kv, rows: Rows, draft_BK, draft_logp_BKV, num_draft_B, resample_from, hidden=False
):
    """Target forward over [pending, draft] (K1 positions) and exact verification; with `hidden` the
    target's last hidden states [B, K1, D] come last."""
    k = draft_BK.shape[1]
    tokens_BK1 = jnp.concatenate([rows.pending_B[:, None], draft_BK], axis=1)
    num_new_B = jnp.where(rows.active_B > 0, k + 1, 0)
    logits_BK1V, kv, *hidden_BK1D = _forward(
        graphdef, params, kv, tokens_BK1, rows.table_BM, rows.start_B, num_new_B, hidden=hidden
    )
    target_logp_BK1V = _processed_rows(logits_BK1V, rows.arrays)
    verify_keys = jax.vmap(lambda key: jax.random.fold_in(key, 1))(row_keys(*rows.keys))
    accepted_B, out_BK1, out_logp_BK1 = speculative.verify(
        verify_keys, draft_BK, draft_logp_BKV, target_logp_BK1V, num_draft_B, _resample_from=resample_from
    )
    raw_BK1V = jax.nn.log_softmax(logits_BK1V, axis=-1)
    raw_BK1 = jnp.take_along_axis(raw_BK1V, out_BK1[..., None], axis=-1)[..., 0]
    return (kv, accepted_B, out_BK1, out_logp_BK1, raw_BK1, *hidden_BK1D)


def speculative_model(
    graphdef,
    draft_graphdef,
    params,
    draft_params,
    kv,
    draft_kv,
    rows: Rows,
    *,
    num_draft: int,
    resample_from: str = "residual",
):
    """Draft `num_draft` tokens with the draft model (its own pages, the same page table), then verify.

    The draft model runs num_draft + 1 single-token steps: the last only writes the K/V of the last draft
    token, so its cache is complete whatever the target accepts. Returns (kv, draft_kv, accepted_B,
    tokens_BK1, logp_BK1, raw_BK1)."""
    base_keys = row_keys(*rows.keys)

    def draft_step(carry, i):
        draft_kv, token_B = carry
        logits_BTV, draft_kv = _forward(
            draft_graphdef,
            draft_params,
            draft_kv,
            token_B[:, None],
            rows.table_BM,
            rows.start_B + i,
            rows.active_B,
        )
        logp_BV = sampling.processed_logprobs(logits_BTV[:, 0], rows.arrays)
        step_keys = jax.vmap(lambda key: jax.random.fold_in(jax.random.fold_in(key, 2), i))(base_keys)
        next_B, _ = sampling.sample_from_logprobs(step_keys, logp_BV)
        return (draft_kv, next_B), (next_B, logp_BV)

    (draft_kv, _), (draft_KB, draft_logp_KBV) = jax.lax.scan(
        draft_step, (draft_kv, rows.pending_B), jnp.arange(num_draft + 1, dtype=jnp.int32)
    )
    draft_BK = draft_KB[:num_draft].T
    draft_logp_BKV = jnp.moveaxis(draft_logp_KBV[:num_draft], 0, 1)
    num_draft_B = jnp.full_like(rows.start_B, num_draft)
    kv, *out = _verify(graphdef, params, kv, rows, draft_BK, draft_logp_BKV, num_draft_B, resample_from)
    return (kv, draft_kv, *out)


def speculative_model_many(
    graphdef,
    draft_graphdef,
    params,
    draft_params,
    kv,
    draft_kv,
    rows: Rows,
    stop_BS,
    budget_B,
    *,
    num_draft: int,
    num_steps: int,
    resample_from: str = "residual",
):
    """Up to `num_steps` speculative steps (`speculative_model`) per active row in one device call: a
    `lax.while_loop`, as `decode_many` is for plain decoding.

    Each step of a row runs with the start, pending token and key step (`rows.keys` step + the tokens the row
    emitted so far in this call) that the host would give a single `speculative_model` call at that point,
    so the tokens are those of single steps. A step emits the accepted drafts and the target's token, cut
    after the first token in the row's `stop_BS` row (padded with -1) and at `budget_B` tokens; a row that
    reached either is fed as inactive (no K/V written) until the loop ends, which it does after num_steps
    steps or when no row is active. A step writes num_draft + 1 positions from the row's start, so positions
    start .. start + budget + num_draft - 1 must be reserved. W = num_steps * (num_draft + 1). Returns (kv,
    draft_kv, tokens_BW, logp_BW, raw_BW, count_B, accepted_B, steps_B): the first count_B entries of each
    row are its tokens; accepted_B sums the accepted drafts and steps_B counts the steps each row ran."""
    b, k1 = rows.pending_B.shape[0], num_draft + 1
    w = num_steps * k1
    j_K1 = jnp.arange(k1, dtype=jnp.int32)
    row_B1 = jnp.arange(b)[:, None]

    def cond(carry):
        i, *_, active_B = carry[:5]
        return (i < num_steps) & jnp.any(active_B > 0)

    def body(carry):
        i, kv, draft_kv, pending_B, active_B, count_B, accepted_sum_B, steps_B, tokens_BW, logp_BW, raw_BW = (
            carry
        )
        kv, draft_kv, accepted_B, out_BK1, logp_BK1, raw_BK1 = speculative_model(
            graphdef,
            draft_graphdef,
            params,
            draft_params,
            kv,
            draft_kv,
            _advanced(rows, pending_B, active_B, count_B),
            num_draft=num_draft,
            resample_from=resample_from,
        )
        live_B = active_B > 0
        emitted_BK1 = j_K1[None] <= accepted_B[:, None]
        stop_BK1 = jnp.any(out_BK1[..., None] == stop_BS[:, None, :], axis=-1) & emitted_BK1
        first_stop_B = jnp.min(jnp.where(stop_BK1, j_K1[None], k1), axis=1)
        n_B = jnp.minimum(jnp.minimum(accepted_B + 1, first_stop_B + 1), budget_B - count_B)
        n_B = jnp.where(live_B, n_B, 0)
        slot_BK1 = jnp.where(j_K1[None] < n_B[:, None], count_B[:, None] + j_K1[None], w)  # w: dropped
        put = lambda out_BW, x_BK1: out_BW.at[row_B1, slot_BK1].set(x_BK1, mode="drop")
        last_B = jnp.take_along_axis(out_BK1, jnp.maximum(n_B - 1, 0)[:, None], axis=1)[:, 0]
        stopped_B = (first_stop_B < n_B) | (count_B + n_B >= budget_B)
        return (
            i + 1,
            kv,
            draft_kv,
            jnp.where(live_B, last_B, pending_B),
            jnp.where(live_B & ~stopped_B, 1, 0).astype(active_B.dtype),
            count_B + n_B,
            accepted_sum_B + jnp.where(live_B, accepted_B, 0),
            steps_B + live_B.astype(jnp.int32),
            put(tokens_BW, out_BK1),
            put(logp_BW, logp_BK1),
            put(raw_BW, raw_BK1),
        )

    zeros = lambda *shape, dtype=jnp.int32: jnp.zeros(shape, dtype)
    init = (
        jnp.int32(0),
        kv,
        draft_kv,
        rows.pending_B,
        rows.active_B,
        zeros(b),
        zeros(b),
        zeros(b),
        zeros(b, w),
        zeros(b, w, dtype=jnp.float32),
        zeros(b, w, dtype=jnp.float32),
    )
    _, kv, draft_kv, _, _, count_B, accepted_B, steps_B, tokens_BW, logp_BW, raw_BW = jax.lax.while_loop(
        cond, body, init
    )
    return kv, draft_kv, tokens_BW, logp_BW, raw_BW, count_B, accepted_B, steps_B


class MTPCarry(NamedTuple):
    """What the MTP drafter hands from one speculative step to the next, per decode slot: the first draft
    token (the one after the pending token), the processed distribution q it was drawn from, and the MTP
    module's hidden state at the position before the pending token (the input of the next draft)."""

    token_B: jax.Array
    logp_BV: jax.Array
    hidden_BD: jax.Array


def _mtp(graphdef, params, mtp_kv, hidden_BTD, next_BT, table_BM, start_B, num_new_B):
    """The first MTP module over its own pages (`Transformer.mtp_paged`): (logits_BTV, h'_BTD, mtp_kv)."""
    return nnx.merge(graphdef, params).mtp_paged(
        hidden_BTD, next_BT, _cache(mtp_kv, table_BM, start_B, num_new_B)
    )


def prefill_mtp(graphdef, params, kv, mtp_kv, tokens_BT, next_BT, table_BM, start_B, num_new_B):
    """`prefill`, and the MTP module's K/V at the same positions: at position i it reads the target's hidden
    state there and the token after it (`next_BT`, the tokens shifted by one). Returns (kv, mtp_kv)."""
    _, kv, hidden_BTD = _forward(graphdef, params, kv, tokens_BT, table_BM, start_B, num_new_B, hidden=True)
    _, _, mtp_kv = _mtp(graphdef, params, mtp_kv, hidden_BTD, next_BT, table_BM, start_B, num_new_B)
    return kv, mtp_kv


def speculative_mtp(
    graphdef,
    params,
    kv,
    mtp_kv,
    carry: MTPCarry,
    rows: Rows,
    num_draft_B,
    *,
    num_draft: int,
    resample_from: str = "residual",
):
    """Draft with the model's own MTP head, verify with the target, and draft the next step's first token.

    With the pending token c at position s (the row's start): draft 1 is the carried token (predicted at
    s - 1 last step); draft i + 1 comes from the MTP module at position s + i - 1, fed its own previous hidden
    state and draft i (the chain vLLM and EAGLE use: one module reused past its depth). The target verifies
    [c, drafts] as for any drafter. Then the module runs over positions s .. s + K with the target's hidden
    states there and the tokens that follow them (the accepted drafts, then the correction), which rewrites
    its pages with the right inputs up to s + accepted; its prediction at s + accepted (the position before
    the next pending token) is the next step's first draft. Rows with `num_draft_B` 0 (just admitted) verify
    no draft. Returns (kv, mtp_kv, next carry, accepted_B, tokens_BK1, logp_BK1, raw_BK1)."""
    base_keys = row_keys(*rows.keys)
    fold = lambda n, i=0: jax.vmap(lambda key: jax.random.fold_in(jax.random.fold_in(key, n), i))(base_keys)

    def chain(c, i):
        mtp_kv, token_B, h_BD = c
        logits_BTV, h_BTD, mtp_kv = _mtp(
            graphdef,
            params,
            mtp_kv,
            h_BD[:, None],
            token_B[:, None],
            rows.table_BM,
            rows.start_B + i - 1,
            rows.active_B,
        )
        logp_BV = sampling.processed_logprobs(logits_BTV[:, 0], rows.arrays)
        next_B, _ = sampling.sample_from_logprobs(fold(3, i), logp_BV)
        return (mtp_kv, next_B, h_BTD[:, 0]), (next_B, logp_BV)

    (mtp_kv, _, _), (chain_KB, chain_logp_KBV) = jax.lax.scan(
        chain, (mtp_kv, carry.token_B, carry.hidden_BD), jnp.arange(1, num_draft, dtype=jnp.int32)
    )
    draft_BK = jnp.concatenate([carry.token_B[:, None], chain_KB.T], axis=1)
    draft_logp_BKV = jnp.concatenate([carry.logp_BV[:, None], jnp.moveaxis(chain_logp_KBV, 0, 1)], axis=1)
    kv, accepted_B, out_BK1, out_logp_BK1, raw_BK1, hidden_BK1D = _verify(
        graphdef, params, kv, rows, draft_BK, draft_logp_BKV, num_draft_B, resample_from, hidden=True
    )
    num_new_B = jnp.where(rows.active_B > 0, num_draft + 1, 0)
    logits_BK1V, h_BK1D, mtp_kv = _mtp(
        graphdef, params, mtp_kv, hidden_BK1D, out_BK1, rows.table_BM, rows.start_B, num_new_B
    )
    at = lambda x: jnp.take_along_axis(x, accepted_B.reshape(-1, 1, 1), axis=1)[:, 0]
    logp_BV = sampling.processed_logprobs(at(logits_BK1V), rows.arrays)
    token_B, _ = sampling.sample_from_logprobs(fold(4), logp_BV)
    carry = MTPCarry(token_B, logp_BV, at(h_BK1D).astype(carry.hidden_BD.dtype))
    return kv, mtp_kv, carry, accepted_B, out_BK1, out_logp_BK1, raw_BK1


def speculative_tokens(
    graphdef, params, kv, rows: Rows, draft_BK, num_draft_B, *, vocab: int, resample_from: str = "residual"
):
    """Verify host-proposed draft tokens (n-gram lookup): their draft distribution is the one-hot on the
    proposed token, so acceptance is p(x) and a rejection resamples from p with x removed: still exact.
    Returns (kv, accepted_B, tokens_BK1, logp_BK1, raw_BK1)."""
    onehot_BKV = jax.nn.one_hot(draft_BK, vocab, dtype=jnp.bool_)
    draft_logp_BKV = jnp.where(onehot_BKV, 0.0, -jnp.inf)
    return _verify(graphdef, params, kv, rows, draft_BK, draft_logp_BKV, num_draft_B, resample_from)


def score(graphdef, params, tokens_BT, arrays: SamplingArrays):
    """Teacher-forced (processed_BT, raw_BT): log-probs of tokens[:, t] from the plain forward's logits at
    t - 1 (position 0 gets 0), under each row's sampling parameters and untempered."""
    logits_BTV, _ = nnx.merge(graphdef, params)(tokens_BT)
    targets_BT = logprobs.shifted(tokens_BT)
    raw_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
    processed_BTV = _processed_rows(logits_BTV, arrays)
    scored = lambda logp_BTV: logprobs.at_tokens(logprobs.pick(logp_BTV, targets_BT))  # noqa: E731
    return scored(processed_BTV), scored(raw_BTV)


def copy_pages(kv: dict, src_N, dst_N) -> dict:
    """Copy-on-write: pages src -> dst in every layer (padding copies the null page onto itself)."""
    return {name: a.at[:, dst_N].set(a[:, src_N]) for name, a in kv.items()}


# Per kind: the step function and which arguments / outputs are weights ("params", "draft_params"), caches
# ("kv", "draft_kv", "mtp_kv") or small replicated arrays (None); the caches are donated.
_SIGNATURES = {
    "prefill": (("params", "kv", None, None, None, None), "kv"),
    "decode": (("params", "kv", None), ("kv", None, None, None)),
    "decode_many": (("params", "kv", None, None, None), ("kv", None, None, None, None)),
    "score": (("params", None, None), (None, None)),
    "copy": (("kv", None, None), "kv"),
    "spec_model": (
        ("params", "draft_params", "kv", "draft_kv", None),
        ("kv", "draft_kv", None, None, None, None),
    ),
    "spec_model_many": (
        ("params", "draft_params", "kv", "draft_kv", None, None, None),
        ("kv", "draft_kv", None, None, None, None, None, None),
    ),
    "prefill_mtp": (("params", "kv", "mtp_kv", None, None, None, None, None), ("kv", "mtp_kv")),
    "spec_mtp": (
        ("params", "kv", "mtp_kv", None, None, None),
        ("kv", "mtp_kv", None, None, None, None, None),
    ),
    "spec_tokens": (("params", "kv", None, None, None), ("kv", None, None, None, None)),
}


def _function(kind: str, static: tuple):
    """(the step over its static arguments, donated argument numbers)."""
    if kind in ("prefill", "decode"):
        return functools.partial(prefill if kind == "prefill" else decode, *static), (1,)
    if kind == "decode_many":
        g, num_steps = static
        return functools.partial(decode_many, g, num_steps=num_steps), (1,)
    if kind == "score":
        return functools.partial(score, *static), ()
    if kind == "copy":
        return copy_pages, (0,)
    if kind == "spec_model":
        g, draft_g, k, resample_from = static
        return functools.partial(speculative_model, g, draft_g, num_draft=k, resample_from=resample_from), (
            2,
            3,
        )
    if kind == "spec_model_many":
        g, draft_g, k, num_steps, resample_from = static
        fn = functools.partial(
            speculative_model_many, g, draft_g, num_draft=k, num_steps=num_steps, resample_from=resample_from
        )
        return fn, (2, 3)
    if kind == "prefill_mtp":
        return functools.partial(prefill_mtp, *static), (1, 2)
    if kind == "spec_mtp":
        g, k, resample_from = static
        return functools.partial(speculative_mtp, g, num_draft=k, resample_from=resample_from), (1, 2)
    if kind == "spec_tokens":
        g, vocab, resample_from = static
        return functools.partial(speculative_tokens, g, vocab=vocab, resample_from=resample_from), (1,)
    raise ValueError(f"unknown step kind {kind!r}")


# XLA:CPU runs every dot in YNNPACK (a `ynn_fusion`). Whether its own (Eigen) dot kernels are faster at
# decode-size row counts depends on the CPU: faster at a few to a few dozen rows on x86-64 without AVX-512,
# not with AVX-512 (`python -m benchmarks small_dots`; benchmarks/results/small_dots.jsonl).
# So a step whose matmuls have SMALL_DOT_MIN_ROWS .. SMALL_DOT_ROWS rows compiles without YNN fusions on an
# x86-64 CPU without AVX-512 (`eigen_small_dots`); elsewhere every step keeps XLA's defaults. The choice is
# fixed per machine (a resumed run computes as the interrupted one did); EIGEN_SMALL_DOTS = True / False
# overrides it (the benchmark's A/B).
SMALL_DOT_MIN_ROWS, SMALL_DOT_ROWS = 4, 32
NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}
EIGEN_SMALL_DOTS: bool | None = None  # None: by the host CPU (`eigen_small_dots`)


@functools.cache
def _no_ynn_supported() -> bool:
    """Whether this jaxlib takes the option (an XLA:CPU debug option: a later release may rename it)."""
    try:
        jax.jit(lambda x: x @ x, compiler_options=NO_YNN).lower(jnp.ones((2, 2))).compile()
    except Exception:  # noqa: BLE001 - an unknown option is refused with a backend-specific error
        return False
    return True


def x86_without_avx512(machine: str, cpuinfo: str) -> bool:
    """Whether `platform.machine()` and /proc/cpuinfo's text describe an x86-64 CPU without AVX-512F (every
    processor's flags; an empty or unreadable cpuinfo: False, nothing known)."""
    if machine.lower() not in ("x86_64", "amd64"):
        return False
    flag_sets = [line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")]
    return bool(flag_sets) and not any("avx512f" in flags for flags in flag_sets)


@functools.cache
def eigen_small_dots() -> bool:
    """Whether this host is the kind of CPU where Eigen beat YNNPACK at decode sizes (see above)."""
    try:
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
    except OSError:
        return False
    return x86_without_avx512(platform.machine(), cpuinfo)


def dot_options(rows: int, platform: str) -> dict | None:
    """The compiler options of a step whose matmuls have `rows` rows (0: not known, e.g. bucketed prefill)
    on `platform`: on a CPU where Eigen wins at decode sizes (EIGEN_SMALL_DOTS, else `eigen_small_dots`),
    from SMALL_DOT_MIN_ROWS to SMALL_DOT_ROWS rows, dots outside YNNPACK; otherwise XLA's defaults."""
    if platform != "cpu" or not SMALL_DOT_MIN_ROWS <= rows <= SMALL_DOT_ROWS or not _no_ynn_supported():
        return None
    if not (eigen_small_dots() if EIGEN_SMALL_DOTS is None else EIGEN_SMALL_DOTS):
        return None
    return dict(NO_YNN)


@functools.lru_cache(maxsize=64)
def jitted(kind: str, *static, place: layout.Placement | None = None, rows: int = 0):
    """The jitted step `kind` over static arguments (graph definitions, sizes), shared by every engine over
    the same model graph, sizes and placement, so an engine rebuilt with them does not re-trace.

    With a `place` (an engine on a mesh) every argument and output gets its sharding from it (weights and
    caches as placed, the rest replicated) and the step traces under the mesh, so the model's activation
    constraints apply; `copy` copies the pages of `place.kv`. Without one, placements follow the arguments.
    `rows`: the rows of the step's matmuls, where every call has the same (decode: max_batch; speculative:
    max_batch * (num_draft + 1)); it picks the CPU dot kernels (`dot_options`)."""
    fn, donate = _function(kind, static)
    platform = jax.default_backend() if place is None else place.mesh.devices.flat[0].platform
    options = dot_options(rows, platform)
    if place is None:
        return jax.jit(fn, donate_argnums=donate, compiler_options=options)
    ins, outs = _SIGNATURES[kind]
    pick = lambda name: place.replicated if name is None else getattr(place, name).tree
    out_shardings = pick(outs) if isinstance(outs, str) else tuple(pick(n) for n in outs)
    mesh = place.mesh.abstract_mesh

    @functools.wraps(fn)
    def on_mesh(*args):
        with jax.sharding.use_abstract_mesh(mesh):
            return fn(*args)

    return jax.jit(
        on_mesh,
        in_shardings=tuple(pick(n) for n in ins),
        out_shardings=out_shardings,
        donate_argnums=donate,
        compiler_options=options,
    )
