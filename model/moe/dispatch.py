"""Moving tokens to experts and back, the dropless (ragged) dispatch with its CPU grouped-matmul kernel,
and the small-token path that gathers each token's experts' weights.

Dimension key: T tokens, D model width, F expert width, E experts, k experts per token, A = T * k
assignments, R buffer rows, W rows of one window.

A buffer has R rows, each holding one assignment (a token sent to an expert) or nothing: `assign_R` is
the assignment of each row (A when empty) and `row_A` the row of each assignment (R when dropped).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

RAGGED_BLOCK = 128  # rows per window of the CPU dropless path


def _pad_row(x: jax.Array) -> jax.Array:
    """Appends one zero row (entry): the source of empty buffer rows, the target of dropped ones."""
    return jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)], axis=0)


def vary_like(a: jax.Array, *refs: jax.Array) -> jax.Array:
    """`a` marked as varying over every mesh axis that one of `refs` varies over: inside a shard_map
    (check_vma) a loop carry keeps one type, so its zero init must vary as its updates do. Elsewhere a
    no-op."""
    axes: set = set()
    for r in refs:
        axes |= varying_axes(r)
    missing = tuple(sorted(axes - varying_axes(a)))
    return jax.lax.pcast(a, missing, to="varying") if missing else a


def varying_axes(a: jax.Array) -> set:
    """The mesh axes a value varies over inside a shard_map (`aval.mat.varying` in jax 0.10, `aval.vma`
    before); empty outside one."""
    aval = jax.typeof(a)
    mat = getattr(aval, "mat", None)
    return set(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())


def invert_rows(row_A: jax.Array, num_rows: int) -> jax.Array:
    """assign_R from row_A: the assignment held by each of `num_rows` rows (A when empty)."""
    a = row_A.shape[0]
    assign = jnp.full((num_rows + 1,), a, jnp.int32).at[row_A].set(jnp.arange(a, dtype=jnp.int32))
    return assign[:-1]


# Both directions are gathers, and so are their gradients (custom VJPs): autodiff would transpose each
# gather into a scatter-add, which on XLA:CPU takes 1.5-2.5x as long for the small config. A row holds
# at most one assignment, so the gathers add up the same terms as the scatters would.


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gather_rows(x_TD: jax.Array, assign_R: jax.Array, row_A: jax.Array, top_k: int) -> jax.Array:
    """Buffer [R, D]: row r holds token assign_R[r] // top_k, or zeros when empty."""
    return jnp.take(_pad_row(x_TD), assign_R // top_k, axis=0)


def _gather_rows_fwd(x_TD, assign_R, row_A, top_k):
    return gather_rows(x_TD, assign_R, row_A, top_k), row_A


def _gather_rows_bwd(top_k, row_A, g_RD):
    g_TkD = jnp.take(_pad_row(g_RD), row_A, axis=0).reshape(-1, top_k, g_RD.shape[-1])
    return jnp.sum(g_TkD, axis=1), None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


@jax.custom_vjp
def combine_rows(y_RD: jax.Array, w_Tk: jax.Array, assign_R: jax.Array, row_A: jax.Array) -> jax.Array:
    """sum_k w[t, k] * y[row of (t, k)] -> [T, D]; dropped assignments contribute zero."""
    return _combine_rows_fwd(y_RD, w_Tk, assign_R, row_A)[0]


def _combine_rows_fwd(y_RD, w_Tk, assign_R, row_A):
    t, k = w_Tk.shape
    y_TkD = jnp.take(_pad_row(y_RD), row_A, axis=0).reshape(t, k, -1)
    y_TD = jnp.einsum("tkd,tk->td", y_TkD, w_Tk.astype(y_TkD.dtype))
    return y_TD, (y_TkD, w_Tk, assign_R)


def _combine_rows_bwd(res, g_TD):
    y_TkD, w_Tk, assign_R = res
    k = w_Tk.shape[1]
    dw_Tk = jnp.einsum("tkd,td->tk", y_TkD, g_TD).astype(w_Tk.dtype)
    w_R = jnp.take(_pad_row(w_Tk.reshape(-1).astype(y_TkD.dtype)), assign_R)
    dy_RD = jnp.take(_pad_row(g_TD), assign_R // k, axis=0) * w_R[:, None]
    return dy_RD, dw_Tk, None, None


combine_rows.defvjp(_combine_rows_fwd, _combine_rows_bwd)


def swiglu_experts(x_EMD, gate_EDF, up_EDF, down_EFD):
    """Each expert's SwiGLU on its own rows: batched over E, plain [M, D] matmuls per expert."""
    g_EMF = jnp.einsum("emd,edf->emf", x_EMD, gate_EDF)
    u_EMF = jnp.einsum("emd,edf->emf", x_EMD, up_EDF)
    return jnp.einsum("emf,efd->emd", jax.nn.silu(g_EMF) * u_EMF, down_EFD)


def _matmul_f32(a: jax.Array, b: jax.Array) -> jax.Array:
    """Weight-gradient term of one window, accumulated over windows in f32 (as one matmul would)."""
    return jnp.matmul(a, b, preferred_element_type=jnp.float32)


def _window(a: jax.Array, start: jax.Array, rows: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(a, start, rows, axis=0)


def _write_window(a: jax.Array, new: jax.Array, start: jax.Array, valid_W1: jax.Array) -> jax.Array:
    """Writes the valid rows of `new` at `start`; the others belong to a neighbouring expert."""
    new = jnp.where(valid_W1, new, _window(a, start, new.shape[0]))
    return jax.lax.dynamic_update_slice_in_dim(a, new, start, axis=0)


def _expert_windows(e, sizes_E, block: int, body, carry):
    """Runs body(start, valid_W1, carry) over expert e's sorted rows in W = `block`-row windows: as many
    windows as its load needs, ceil(n_e / W). A window may run into the next expert's rows; valid_W1
    marks the rows that are e's."""
    start_E = jnp.cumsum(sizes_E) - sizes_E
    start, size = start_E[e], sizes_E[e]

    def window(j, carry):
        valid_W1 = (jnp.arange(block) < size - j * block)[:, None]
        return body(start + j * block, valid_W1, carry)

    return jax.lax.fori_loop(0, (size + block - 1) // block, window, carry)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def grouped_swiglu(x_RD, sizes_E, gate_EDF, up_EDF, down_EFD, block: int) -> jax.Array:
    """Expert SwiGLU over rows sorted by expert (the first n_0 rows go to expert 0, ...) in `block`-row
    windows. Rows past sum(n_e) are padding (at least `block` of them) and come out zero."""
    return _grouped_swiglu_fwd(x_RD, sizes_E, gate_EDF, up_EDF, down_EFD, block)[0]


def _grouped_swiglu_fwd(x_RD, sizes_E, gate_EDF, up_EDF, down_EFD, block):
    r, f = x_RD.shape[0], gate_EDF.shape[-1]

    def expert(e, carry):
        gate_DF, up_DF, down_FD = gate_EDF[e], up_EDF[e], down_EFD[e]

        def body(start, valid_W1, carry):
            y_RD, g_RF, u_RF = carry
            x_WD = _window(x_RD, start, block)
            g_WF, u_WF = x_WD @ gate_DF, x_WD @ up_DF
            y_WD = (jax.nn.silu(g_WF) * u_WF) @ down_FD
            new = (y_WD, g_WF, u_WF)
            return tuple(_write_window(a, n, start, valid_W1) for a, n in zip(carry, new))

        return _expert_windows(e, sizes_E, block, body, carry)

    zeros = lambda n: vary_like(jnp.zeros((r, n), x_RD.dtype), x_RD, sizes_E, gate_EDF, up_EDF, down_EFD)
    init = (zeros(x_RD.shape[1]), zeros(f), zeros(f))
    y_RD, g_RF, u_RF = jax.lax.fori_loop(0, gate_EDF.shape[0], expert, init)
    return y_RD, (x_RD, sizes_E, gate_EDF, up_EDF, down_EFD, g_RF, u_RF)


def _grouped_swiglu_bwd(block, res, dy_RD):
    x_RD, sizes_E, gate_EDF, up_EDF, down_EFD, g_RF, u_RF = res
    operands = (dy_RD,) + res

    def expert(e, carry):
        dx_RD, dgate_EDF, dup_EDF, ddown_EFD = carry
        gate_DF, up_DF, down_FD = gate_EDF[e], up_EDF[e], down_EFD[e]

        def body(start, valid_W1, carry):
            dx_RD, dgate_DF, dup_DF, ddown_FD = carry
            x_WD, g_WF, u_WF = (_window(a, start, block) for a in (x_RD, g_RF, u_RF))
            dy_WD = jnp.where(valid_W1, _window(dy_RD, start, block), 0)  # other experts' rows: 0
            h_WF, h_vjp = jax.vjp(lambda g, u: jax.nn.silu(g) * u, g_WF, u_WF)
            dg_WF, du_WF = h_vjp(dy_WD @ down_FD.T)
            dx_WD = dg_WF @ gate_DF.T + du_WF @ up_DF.T
            return (
                _write_window(dx_RD, dx_WD, start, valid_W1),
                dgate_DF + _matmul_f32(x_WD.T, dg_WF),
                dup_DF + _matmul_f32(x_WD.T, du_WF),
                ddown_FD + _matmul_f32(h_WF.T, dy_WD),
            )

        zeros_f32 = lambda a: vary_like(jnp.zeros(a.shape, jnp.float32), *operands)
        init = (dx_RD, zeros_f32(gate_DF), zeros_f32(up_DF), zeros_f32(down_FD))
        dx_RD, dgate_DF, dup_DF, ddown_FD = _expert_windows(e, sizes_E, block, body, init)
        return (
            dx_RD,
            dgate_EDF.at[e].set(dgate_DF.astype(dgate_EDF.dtype)),
            dup_EDF.at[e].set(dup_DF.astype(dup_EDF.dtype)),
            ddown_EFD.at[e].set(ddown_FD.astype(ddown_EFD.dtype)),
        )

    init = tuple(vary_like(jnp.zeros_like(a), *operands) for a in (x_RD, gate_EDF, up_EDF, down_EFD))
    dx_RD, dgate_EDF, dup_EDF, ddown_EFD = jax.lax.fori_loop(0, gate_EDF.shape[0], expert, init)
    return dx_RD, None, dgate_EDF, dup_EDF, ddown_EFD


grouped_swiglu.defvjp(_grouped_swiglu_fwd, _grouped_swiglu_bwd)


def sort_by_expert(idx_Tk: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Assignments sorted by expert (stable: token order within an expert): the sort order [A], the
    group sizes [E], and each assignment's position among its expert's assignments [A]."""
    a = idx_Tk.size
    flat_e_A = idx_Tk.reshape(-1)
    order_A = jnp.argsort(flat_e_A, stable=True)
    sizes_E = jnp.bincount(flat_e_A, length=num_experts).astype(jnp.int32)
    start_E = jnp.cumsum(sizes_E) - sizes_E
    pos_sorted_A = jnp.arange(a, dtype=jnp.int32) - start_E[flat_e_A[order_A]]
    pos_A = jnp.zeros((a,), jnp.int32).at[order_A].set(pos_sorted_A)
    return order_A, sizes_E, pos_A


def ragged_dispatch(
    x_TD, idx_Tk, w_Tk, gate_EDF, up_EDF, down_EFD, *, use_ragged_dot: bool | None = None
) -> jax.Array:
    """Dropless: sort assignments by expert, grouped matmuls, unsort, weight and sum over k.

    An index of E (one past the last expert) is an empty assignment: it is sorted after every expert's
    rows and contributes zero (the expert-parallel receiver marks its empty buffer rows so).

    On accelerators the grouped matmuls are `jax.lax.ragged_dot`. On CPU ragged_dot runs every expert
    densely over every row (E / k times the work), so there each expert's rows go through its weights
    in `RAGGED_BLOCK`-row windows, as many as its load needs (`grouped_swiglu`)."""
    t, k = idx_Tk.shape
    n = gate_EDF.shape[0]
    order_A, sizes_G, pos_A = sort_by_expert(idx_Tk, n + 1)  # group n: the empty assignments, last
    sizes_E = sizes_G[:n]
    start_G = jnp.cumsum(sizes_G) - sizes_G
    inverse_A = start_G[idx_Tk.reshape(-1)] + pos_A  # where each assignment sits in the sorted order
    if use_ragged_dot is None:
        use_ragged_dot = jax.default_backend() != "cpu"
    if not use_ragged_dot:
        block = min(RAGGED_BLOCK, t * k)
        # Rows sorted by expert, then `block` zero rows so that every window lies inside the buffer.
        assign_R = jnp.concatenate([order_A, jnp.full((block,), t * k, order_A.dtype)])
        x_RD = gather_rows(x_TD, assign_R, inverse_A, k)
        y_RD = grouped_swiglu(x_RD, sizes_E, gate_EDF, up_EDF, down_EFD, block)
        return combine_rows(y_RD, w_Tk, assign_R, inverse_A)
    x_AD = jnp.take(x_TD, order_A // k, axis=0)
    g_AF = jax.lax.ragged_dot(x_AD, gate_EDF, sizes_E)
    u_AF = jax.lax.ragged_dot(x_AD, up_EDF, sizes_E)
    y_AD = jax.lax.ragged_dot(jax.nn.silu(g_AF) * u_AF, down_EFD, sizes_E)
    # Rows past the groups (empty assignments) are not defined by every backend's ragged_dot.
    y_AD = jnp.where((jnp.arange(t * k) < jnp.sum(sizes_E))[:, None], y_AD, 0)
    y_TkD = jnp.take(y_AD, inverse_A, axis=0).reshape(t, k, -1)
    return jnp.einsum("tkd,tk->td", y_TkD, w_Tk.astype(y_TkD.dtype))


def gathered_swiglu(x_TD, idx_Tk, w_Tk, gate_EDF, up_EDF, down_EFD) -> jax.Array:
    """Small-token path: each token through its own top-k experts by gathering their weights
    ([T, k, D, F]) and batched matmuls; no sort, no groups. Reads T * k expert weights, so it pays only
    where that is fewer bytes than the dispatch's work (decode-size batches)."""
    g_TkDF, u_TkDF = jnp.take(gate_EDF, idx_Tk, axis=0), jnp.take(up_EDF, idx_Tk, axis=0)
    d_TkFD = jnp.take(down_EFD, idx_Tk, axis=0)
    g_TkF = jnp.einsum("td,tkdf->tkf", x_TD, g_TkDF)
    u_TkF = jnp.einsum("td,tkdf->tkf", x_TD, u_TkDF)
    y_TkD = jnp.einsum("tkf,tkfd->tkd", jax.nn.silu(g_TkF) * u_TkF, d_TkFD)
    return jnp.einsum("tkd,tk->td", y_TkD, w_Tk.astype(y_TkD.dtype))


def every_expert_swiglu(x_TD, idx_Tk, w_Tk, gate_EDF, up_EDF, down_EFD) -> jax.Array:
    """Small-token path: every expert on every token as three contractions with the stacked experts as
    they are stored, x [T, D] with [E, D, F] (gate and up), then (w_TE * h_TEF) [T, E, F] with [E, F, D],
    where w_TE holds each token's top-k routing weights and zeros elsewhere: an unselected expert's row is
    multiplied by 0, so the output is the top-k experts' weighted sum (in another order than the
    dispatch's: f32 rounding). E / k times the routed FLOPs, but at decode-size batches the cost is
    reading the weights, which the dispatch reads too (in E small matmuls plus a sort).

    Gate and up are batched over the experts (x broadcast to [E, T, D] against [E, D, F]), so each expert's
    weights are read where they are stored. Written as one contraction "td,edf->tef", XLA:CPU lays the
    weights out as [D, E * F] for its matmul: a copy of every gate and up weight in every decode step
    (inside the engine's decode loop, which it does not hoist); batched, that copy is gone
    (`python -m benchmarks moe_decode`)."""
    dt = x_TD.dtype
    t, e = x_TD.shape[0], gate_EDF.shape[0]
    x_ETD = jnp.broadcast_to(x_TD[None], (e, *x_TD.shape))
    g_ETF = jnp.einsum("etd,edf->etf", x_ETD, gate_EDF.astype(dt))
    u_ETF = jnp.einsum("etd,edf->etf", x_ETD, up_EDF.astype(dt))
    w_TE = jnp.zeros((t, e), dt).at[jnp.arange(t)[:, None], idx_Tk].add(w_Tk.astype(dt))
    h_ETF = jax.nn.silu(g_ETF) * u_ETF * w_TE.T[:, :, None]
    return jnp.einsum("etf,efd->td", h_ETF, down_EFD.astype(dt))
