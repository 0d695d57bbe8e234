"""Paged decode attention: every impl equals the gather reference and plain causal attention on the
contiguous K/V, never reads garbage past the lengths, and does not retrace when lengths or table change."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention as pa
from pallas_kernels import reference
from pallas_kernels.mask import Mask

# f32: the same terms summed in a different order (blocks, pages).
F32_TOL = 1e-5
# bf16: inputs are the same bf16 values and everything is f32 inside, so impl and reference differ by the
# final rounding to bf16 (2**-8 relative) at most; |o| < 3 here, hence 1e-2 absolute.
BF16_TOL = 1e-2
TOL = {jnp.float32: F32_TOL, jnp.bfloat16: BF16_TOL}

IMPLS = ["xla", "pallas_prefetch", "pallas_gather"]
PAGE, MAX_PAGES, HEAD_DIM = 4, 4, 8
# Empty, one token, exactly one page, a partial last page, the whole table.
LENGTHS = [0, 1, PAGE, 2 * PAGE + 3, MAX_PAGES * PAGE]
SPARE_PAGES = 3  # pool pages that no sequence owns: filled with huge values


def _case(lengths, n, kv, dtype, seed=0, garbage=np.nan, share_first_page=True):
    """Contiguous K/V [B, S, K, H] scattered into a shuffled page pool whose unused slots hold `garbage`.

    Sequence 1 (one token) shares its first physical page with sequence 2 (a full page, same prefix), so
    slots 1.. of that page hold valid data of another sequence; table entries past each sequence's last
    needed page point anywhere, even outside the pool.
    """
    rng = np.random.default_rng(seed)
    b, s = len(lengths), MAX_PAGES * PAGE
    q_BNH = rng.normal(size=(b, n, HEAD_DIM))
    k_BSKH, v_BSKH = rng.normal(size=(2, b, s, kv, HEAD_DIM))
    pool = b * MAX_PAGES + SPARE_PAGES
    table_BM = rng.permutation(pool)[: b * MAX_PAGES].reshape(b, MAX_PAGES)
    if share_first_page:
        table_BM[1, 0] = table_BM[2, 0]
        k_BSKH[1, :PAGE], v_BSKH[1, :PAGE] = k_BSKH[2, :PAGE], v_BSKH[2, :PAGE]
    k_KPLH = np.full((kv, pool, PAGE, HEAD_DIM), garbage)
    v_KPLH = np.full((kv, pool, PAGE, HEAD_DIM), garbage)
    spare = np.setdiff1d(np.arange(pool), table_BM)
    k_KPLH[:, spare], v_KPLH[:, spare] = 3e38, -3e38
    for bi, length in enumerate(lengths):
        for t in range(length):
            k_KPLH[:, table_BM[bi, t // PAGE], t % PAGE] = k_BSKH[bi, t]
            v_KPLH[:, table_BM[bi, t // PAGE], t % PAGE] = v_BSKH[bi, t]
    for bi, length in enumerate(lengths):
        needed = math.ceil(length / PAGE)
        table_BM[bi, needed:] = rng.integers(-2, pool + 2, MAX_PAGES - needed)
    cast = lambda x: jnp.asarray(x, dtype)
    paged = (cast(q_BNH), cast(k_KPLH), cast(v_KPLH), jnp.asarray(lengths, jnp.int32), jnp.asarray(table_BM))
    return paged, (cast(k_BSKH), cast(v_BSKH))


def _check(got, want, dtype):
    chex.assert_tree_all_finite(got)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=TOL[dtype], rtol=TOL[dtype]
    )


# (query heads, kv heads, pages_per_block, dtype): GQA 1, 2, 4; blocks of 1, 2, 3 (pads the table), > M.
CASES = [
    (4, 4, 1, jnp.float32),
    (4, 2, 2, jnp.bfloat16),
    (8, 2, 3, jnp.float32),
    (8, 2, MAX_PAGES + 5, jnp.bfloat16),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n,kv,pages_per_block,dtype", CASES)
def test_matches_reference(impl, n, kv, pages_per_block, dtype):
    paged, _ = _case(LENGTHS, n, kv, dtype)
    got = pa.paged_attention(*paged, pages_per_block=pages_per_block, impl=impl)
    assert got.shape == paged[0].shape and got.dtype == dtype
    _check(got, pa.paged_attention_reference(*paged), dtype)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), 0.0)  # length 0


@pytest.mark.parametrize("impl", ["reference", *IMPLS])
def test_equals_causal_attention_on_contiguous_kv(impl):
    (q_BNH, k_KPLH, v_KPLH, lengths_B, table_BM), (k_BSKH, v_BSKH) = _case(LENGTHS, 4, 2, jnp.float32)
    # The decode query is the token at position length-1 of its sequence.
    want_B1NH = reference.attention_reference(
        q_BNH[:, None], k_BSKH, v_BSKH, Mask(causal=True, q_positions=lengths_B[:, None] - 1)
    )
    args = (q_BNH, k_KPLH, v_KPLH, lengths_B, table_BM)
    if impl == "reference":
        got = pa.paged_attention_reference(*args)
    else:
        got = pa.paged_attention(*args, pages_per_block=2, impl=impl)
    _check(got, want_B1NH[:, 0], jnp.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_garbage_values_do_not_change_the_output(impl):
    outs = []
    for garbage in (np.nan, 1e30, 0.0):
        paged, _ = _case(LENGTHS, 4, 2, jnp.float32, garbage=garbage)
        outs.append(np.asarray(pa.paged_attention(*paged, pages_per_block=2, impl=impl)))
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


def test_default_impl_on_cpu_is_xla():
    paged, _ = _case(LENGTHS, 4, 2, jnp.float32)
    np.testing.assert_array_equal(pa.paged_attention(*paged), pa.paged_attention(*paged, impl="xla"))


def test_merge_blocks_equals_folded_merge_partials():
    rng = np.random.default_rng(3)
    o_BKJGH = jnp.asarray(rng.normal(size=(2, 3, 4, 2, 5)), jnp.float32)
    lse_BKJG = jnp.asarray(rng.normal(size=(2, 3, 4, 2)) * 5, jnp.float32)
    # Some all-masked blocks (o = 0, lse = MASK_VALUE), and one row masked in every block.
    masked_BKJG = jnp.asarray(rng.random((2, 3, 4, 2)) < 0.3).at[0, 0, :, 0].set(True)
    o_BKJGH = jnp.where(masked_BKJG[..., None], 0.0, o_BKJGH)
    lse_BKJG = jnp.where(masked_BKJG, reference.MASK_VALUE, lse_BKJG)
    want_o, want_lse = o_BKJGH[:, :, 0], lse_BKJG[:, :, 0]
    for j in range(1, 4):
        want_o, want_lse = reference.merge_partials(want_o, want_lse, o_BKJGH[:, :, j], lse_BKJG[:, :, j])
    got_o, got_lse = pa.merge_blocks(o_BKJGH, lse_BKJG)
    np.testing.assert_allclose(got_o, want_o, atol=F32_TOL, rtol=F32_TOL)
    np.testing.assert_allclose(got_lse[1:], want_lse[1:], atol=F32_TOL, rtol=F32_TOL)
    np.testing.assert_array_equal(got_o[0, 0, 0], 0.0)


@pytest.mark.parametrize("pages_per_block", [1, 2, 3])
def test_kernels_visit_only_the_needed_pages(pages_per_block):
    # Masking alone would hide extra reads from the other tests; this pins which pages the kernels fetch.
    c, blocks = pages_per_block, math.ceil(MAX_PAGES / pages_per_block)
    for length in LENGTHS:
        needed = math.ceil(length / PAGE)
        slots = [int(pa._table_slot(length, slot, PAGE)) for slot in range(blocks * c)]
        assert slots == list(range(needed)) + [max(needed - 1, 0)] * (blocks * c - needed)
        counts = [int(pa._pages_in_block(length, ji, c, PAGE)) for ji in range(blocks)]
        assert counts == [min(max(needed - ji * c, 0), c) for ji in range(blocks)]


@pytest.mark.parametrize("impl", ["xla", "pallas_prefetch"])
def test_no_retrace_when_lengths_or_table_change(impl):
    traces = []

    @jax.jit
    def decode(*args):
        traces.append(1)
        return pa.paged_attention(*args, pages_per_block=2, impl=impl)

    for seed, lengths in enumerate([LENGTHS, [3, 16, 0, 7, 9], [16, 16, 16, 1, 2]]):
        paged, _ = _case(lengths, 4, 2, jnp.float32, seed=seed, share_first_page=False)
        _check(decode(*paged), pa.paged_attention_reference(*paged), jnp.float32)
    assert len(traces) == 1


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: {**a, "q": a["q"][:, None]}, "q_BNH: shape"),
        (lambda a: {**a, "v": a["v"][:, :2]}, "expected the same"),
        (lambda a: {**a, "q": a["q"][..., :4]}, "head dim"),
        (lambda a: {**a, "q": a["q"][:, :3]}, "not a multiple"),
        (lambda a: {**a, "lengths": a["lengths"][:2]}, "lengths_B: shape"),
        (lambda a: {**a, "table": a["table"][:, None]}, "page_table_BM: shape"),
        (lambda a: {**a, "table": a["table"].astype(jnp.float32)}, "page_table_BM: dtype"),
        (lambda a: {**a, "k": a["k"].astype(jnp.int32)}, "k_pages: dtype"),
        (lambda a: {**a, "pages_per_block": 0}, "pages_per_block"),
        (lambda a: {**a, "impl": "triton"}, "impl"),
    ],
)
def test_bad_arguments_name_the_fix(change, match):
    (q, k, v, lengths, table), _ = _case(LENGTHS, 4, 2, jnp.float32)
    a = change(dict(q=q, k=k, v=v, lengths=lengths, table=table, pages_per_block=1, impl="xla"))
    with pytest.raises(ValueError, match=match):
        pa.paged_attention(
            a["q"],
            a["k"],
            a["v"],
            a["lengths"],
            a["table"],
            pages_per_block=a["pages_per_block"],
            impl=a["impl"],
        )


@pytest.mark.parametrize("impl", ["xla", "pallas_gather"])
def test_kv_offset_reads_one_layer_of_a_stacked_pool(impl):
    """A model's cache stacks every layer's kv heads ([layers * K, P, L, H]); kv_offset picks layer 1's
    rows. The result equals the call on that layer alone, and other layers' garbage never leaks in."""
    (q, k, v, lengths, table), _ = _case([5, 1, 16, 11], n=4, kv=2, dtype=jnp.float32, seed=3)
    noise = jnp.full_like(k, jnp.nan)
    k3, v3 = jnp.concatenate([noise, k, noise]), jnp.concatenate([noise, v, noise])
    want = pa.paged_attention(q, k, v, lengths, table, impl=impl)
    got = jax.jit(
        lambda offset: pa.paged_attention(
            q, k3, v3, lengths, table, impl=impl, kv_offset=offset, num_kv_heads=2
        )
    )(jnp.int32(2))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="kv_offset and num_kv_heads go together"):
        pa.paged_attention(q, k3, v3, lengths, table, kv_offset=2)
