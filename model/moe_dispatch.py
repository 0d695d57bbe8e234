"""Moving tokens to experts and back, and the CPU grouped-matmul kernel of the dropless path.

Dimension key: T tokens, D model width, F expert width, E experts, k experts per token, A = T * k
assignments, R buffer rows, W rows of one window.

A buffer has R rows, each holding one assignment (a token sent to an expert) or nothing: `assign_R` is
the assignment of each row (A when empty) and `row_A` the row of each assignment (R when dropped).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _pad_row(x: jax.Array) -> jax.Array:
    """Appends one zero row (entry): the source of empty buffer rows, the target of dropped ones."""
    return jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)], axis=0)


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

    zeros = lambda n: jnp.zeros((r, n), x_RD.dtype)
    init = (zeros(x_RD.shape[1]), zeros(f), zeros(f))
    y_RD, g_RF, u_RF = jax.lax.fori_loop(0, gate_EDF.shape[0], expert, init)
    return y_RD, (x_RD, sizes_E, gate_EDF, up_EDF, down_EFD, g_RF, u_RF)


def _grouped_swiglu_bwd(block, res, dy_RD):
    x_RD, sizes_E, gate_EDF, up_EDF, down_EFD, g_RF, u_RF = res

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

        zeros_f32 = lambda a: jnp.zeros(a.shape, jnp.float32)
        init = (dx_RD, zeros_f32(gate_DF), zeros_f32(up_DF), zeros_f32(down_FD))
        dx_RD, dgate_DF, dup_DF, ddown_FD = _expert_windows(e, sizes_E, block, body, init)
        return (
            dx_RD,
            dgate_EDF.at[e].set(dgate_DF.astype(dgate_EDF.dtype)),
            dup_EDF.at[e].set(dup_DF.astype(dup_EDF.dtype)),
            ddown_EFD.at[e].set(ddown_FD.astype(ddown_EFD.dtype)),
        )

    init = tuple(jnp.zeros_like(a) for a in (x_RD, gate_EDF, up_EDF, down_EFD))
    dx_RD, dgate_EDF, dup_EDF, ddown_EFD = jax.lax.fori_loop(0, gate_EDF.shape[0], expert, init)
    return dx_RD, None, dgate_EDF, dup_EDF, ddown_EFD


grouped_swiglu.defvjp(_grouped_swiglu_fwd, _grouped_swiglu_bwd)
