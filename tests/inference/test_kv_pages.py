"""Paged KV bookkeeping: refcount invariants under random operations, atomic failures, copy-on-write exactly
on shared partial pages, prefix cache hits/LRU/stats, host tier round trips, and paged attention over the
tables equal to attention over each sequence's contiguous K/V."""

import jax.numpy as jnp
import numpy as np
import pytest

from inference import kv_pages as kvp
from pallas_kernels.paged_attention import paged_attention_reference

PAGE = 4
F32_TOL = 1e-5  # f32: the same terms summed in a different order


def _setup(num_pages=16, max_pages=6, capacity=8, host_capacity=0):
    pool = kvp.PagePool(num_pages, PAGE)
    table = kvp.SequenceTable(pool, max_pages)
    cache = kvp.PrefixCache(pool, PAGE, capacity, host_capacity)
    return pool, table, cache


def _state(pool, table, seq_ids):
    return pool.num_free, [pool.refcount(p) for p in range(pool.num_pages)], [table.pages(s) for s in seq_ids]


def test_pool_alloc_incref_decref():
    pool = kvp.PagePool(5, PAGE)
    pages = pool.alloc(3)
    assert kvp.NULL_PAGE not in pages and len(set(pages)) == 3 and pool.num_free == 1
    pool.incref(pages[:1])
    pool.decref(pages)
    assert pool.num_free == 3 and pool.refcount(pages[0]) == 1
    pool.check(extra=pages[:1])
    pool.decref(pages[:1])
    with pytest.raises(ValueError, match="double free"):
        pool.decref(pages[:1])
    with pytest.raises(ValueError, match="free"):
        pool.incref(pages[:1])
    pool.check()
    assert sorted(pool.alloc(4)) == [1, 2, 3, 4]


def test_out_of_pages_leaves_state_unchanged():
    pool, table, _ = _setup(num_pages=6)
    table.new(0)
    table.append_tokens(0, 3 * PAGE - 1)
    table.fork(0, 1)
    before = _state(pool, table, [0, 1])
    with pytest.raises(kvp.OutOfPages, match="asked for 3 pages, only 2 free") as err:
        pool.alloc(3)
    assert (err.value.asked, err.value.free) == (3, 2)
    # Copy-on-write of the partial page plus two new pages: 3 > 2 free.
    with pytest.raises(kvp.OutOfPages):
        table.append_tokens(1, 1 + 2 * PAGE)
    with pytest.raises(ValueError, match="pages >"):
        table.append_tokens(1, 4 * PAGE)
    assert _state(pool, table, [0, 1]) == before
    assert table.length(1) == 3 * PAGE - 1
    table.check()


def test_fork_shares_pages_and_copies_on_first_append_into_shared_partial_page():
    pool, table, _ = _setup()
    table.new(0)
    table.append_tokens(0, PAGE + 2)
    a, b = table.pages(0)
    table.fork(0, 1)
    assert table.pages(1) == [a, b] and pool.refcount(a) == pool.refcount(b) == 2
    child = table.append_tokens(1, 1)
    (dst,) = [p for p in table.pages(1) if p not in (a, b)]
    assert child.copies == [(b, dst)] and child.writes == [(dst, 2)]
    assert table.pages(1) == [a, dst] and pool.refcount(b) == 1 and pool.refcount(a) == 2
    # The parent's partial page is private again: no copy; its next page is fresh, also no copy.
    parent = table.append_tokens(0, 3)
    assert parent.copies == [] and parent.writes[:2] == [(b, 2), (b, 3)]
    assert table.append_tokens(1, 5).copies == []
    table.check()


def test_full_shared_pages_stay_shared():
    pool, table, _ = _setup()
    table.new(0)
    table.append_tokens(0, 2 * PAGE)
    table.fork(0, 1)
    for seq in (0, 1):
        out = table.append_tokens(seq, 1)
        assert out.copies == [] and out.writes[0][1] == 0
    assert table.pages(0)[:2] == table.pages(1)[:2] and table.pages(0)[2] != table.pages(1)[2]
    assert all(pool.refcount(p) == 2 for p in table.pages(0)[:2])
    table.check()


def test_n_samples_prefill_once():
    pool, table, _ = _setup(num_pages=32)
    prompt_len, n = 2 * PAGE + 1, 8
    table.new(0)
    prefill_writes = len(table.append_tokens(0, prompt_len).writes)
    for i in range(1, n):
        table.fork(0, i)
    copies = [c for i in range(n) for c in table.append_tokens(i, 1).copies]
    assert prefill_writes == prompt_len  # one prefill, shared by all n samples
    # The shared partial page is copied by the first n - 1 appenders; the last one owns it alone.
    assert len(copies) == n - 1
    assert pool.num_free == 31 - 3 - (n - 1)
    table.check()


def test_page_table_and_lengths():
    _, table, _ = _setup()
    table.new(0)
    table.new(1)
    table.new(2)
    table.append_tokens(0, PAGE + 1)
    table.append_tokens(2, 3 * PAGE)
    page_table_BM = table.page_table([2, 1, 0], max_pages=5)
    assert page_table_BM.shape == (3, 5) and page_table_BM.dtype == np.int32
    assert (page_table_BM[0, :3] == table.pages(2)).all() and (page_table_BM[0, 3:] == kvp.NULL_PAGE).all()
    assert (page_table_BM[1] == kvp.NULL_PAGE).all()
    assert (page_table_BM[2, :2] == table.pages(0)).all()
    assert table.page_table([0]).shape == (1, 6)
    lengths_B = table.lengths([2, 1, 0])
    assert lengths_B.dtype == np.int32 and lengths_B.tolist() == [3 * PAGE, 0, PAGE + 1]
    assert table.lengths([]).shape == (0,)
    with pytest.raises(ValueError, match="max_pages 2"):
        table.page_table([2], max_pages=2)


def _prefill(table, cache, seq_id, tokens):
    hit = cache.lookup(tokens)
    table.new(seq_id, hit.pages, hit.num_tokens)
    table.append_tokens(seq_id, len(tokens) - hit.num_tokens)
    cache.insert(tokens, table.pages(seq_id))
    return hit


def test_prefix_cache_hits_shared_prefix_and_never_caches_partial_pages():
    pool, table, cache = _setup()
    prefix = list(range(2 * PAGE))
    _prefill(table, cache, 0, prefix + [90, 91])
    assert cache.stats()["device_pages"] == 2  # the partial third page is not cached
    hit = _prefill(table, cache, 1, prefix + [70, 71, 72])
    assert hit.num_tokens == 2 * PAGE and hit.pages == table.pages(0)[:2] and hit.reload.pages == []
    assert table.pages(1)[:2] == table.pages(0)[:2] and table.pages(1)[2] != table.pages(0)[2]
    hit = cache.lookup(prefix[:-1])
    assert hit.num_tokens == PAGE
    with pytest.raises(AssertionError, match="holders"):
        table.check()  # the hit's reference is held outside the table and the cache
    pool.check(extra=hit.pages)
    pool.decref(hit.pages)
    table.check()
    cache.check()


def test_prefix_hash_covers_the_whole_prefix():
    pool, table, cache = _setup()
    a, b, c = [1] * PAGE, [2] * PAGE, [3] * PAGE
    _prefill(table, cache, 0, a + c)
    hit = cache.lookup(b + c)
    assert hit.num_tokens == 0 and hit.pages == []
    assert kvp.block_hashes(a + c, PAGE)[1] != kvp.block_hashes(b + c, PAGE)[1]
    hit = cache.lookup(a + b)
    assert hit.num_tokens == PAGE
    pool.check(extra=hit.pages)


def test_lru_eviction_order_and_stats():
    pool, table, cache = _setup(capacity=2)
    x, y, z = ([t] * PAGE for t in (1, 2, 3))
    for i, tokens in enumerate((x, y)):
        _prefill(table, cache, i, tokens)
        table.free(i)
    pool.decref(cache.lookup(x).pages)  # x becomes the most recently used
    _prefill(table, cache, 2, z)
    assert cache.lookup(y).num_tokens == 0  # y was evicted, not x
    hit = cache.lookup(x)
    assert hit.num_tokens == PAGE
    pool.decref(hit.pages)
    stats = cache.stats()
    assert stats["evictions"] == 1 and stats["lookups"] == 6 and stats["lookup_tokens"] == 6 * PAGE
    assert stats["hit_tokens"] == 2 * PAGE and stats["hit_rate"] == pytest.approx(1 / 3)
    # z stays held by sequence 2: the next insert evicts idle x; then nothing is idle, so the cache stays
    # over capacity rather than evict pages that sequences hold.
    _prefill(table, cache, 3, [4] * PAGE)
    assert cache.lookup(x).num_tokens == 0 and cache.stats()["evictions"] == 2
    _prefill(table, cache, 4, [5] * PAGE)
    assert cache.stats()["device_pages"] == 3 and cache.stats()["evictions"] == 2
    cache.check()


def test_pool_reclaims_idle_cache_pages_and_fails_atomically():
    pool, table, cache = _setup(num_pages=5, capacity=8)
    _prefill(table, cache, 0, list(range(2 * PAGE)))
    table.free(0)
    table.new(1)
    table.append_tokens(1, PAGE)
    assert pool.num_free == 1 and cache.reclaimable() == 2
    before = (_state(pool, table, [1]), cache.stats())
    with pytest.raises(kvp.OutOfPages, match="only 3 free"):
        pool.alloc(4)
    assert (_state(pool, table, [1]), cache.stats()) == before
    table.append_tokens(1, 2 * PAGE)  # evicts the least recently used idle block
    assert cache.stats()["evictions"] == 1
    table.check()
    cache.check()


def _random_pool(rng, num_pages, page):
    """Named page arrays (page axis 1) of different row counts, widths and dtypes, as an engine's caches
    are: K/V of 2 kv heads, one MLA-like latent row, an int8 routing record of 3 layers x top-2."""
    return {
        "kv/k": jnp.asarray(rng.normal(size=(2, num_pages, page, 8)), jnp.float32),
        "kv/v": jnp.asarray(rng.normal(size=(2, num_pages, page, 8)), jnp.float32),
        "mtp_kv/latent": jnp.asarray(rng.normal(size=(1, num_pages, page, 5)), jnp.bfloat16),
        "kv/experts": jnp.asarray(rng.integers(0, 8, size=(3, num_pages, page, 2)), jnp.int8),
    }


def _pages(arrays, pages):
    return {name: np.asarray(a[:, pages]) for name, a in arrays.items()}


def test_host_tier_round_trip_restores_pages_and_skips_referenced_pages():
    pool, table, cache = _setup(num_pages=8, capacity=8, host_capacity=4)
    arrays = _random_pool(np.random.default_rng(0), 8, PAGE)
    tokens = list(range(3 * PAGE))
    _prefill(table, cache, 0, tokens)
    old = table.pages(0)
    table.fork(0, 1)
    table.free(0)
    table.truncate(1, PAGE)  # seq 1 keeps the first block referenced
    want = _pages(arrays, old)
    assert cache.offload_candidates(8) == [old[2], old[1]]  # idle blocks only, deepest (least recent) first
    with pytest.raises(ValueError, match="only the cache"):
        cache.offload(old[:1], {name: x[:, :1] for name, x in want.items()})
    assert cache.offload_lru(8, arrays) == 2
    assert pool.refcount(old[1]) == pool.refcount(old[2]) == 0
    cache.check()
    # Reuse the freed pages with other data (every array), then reload.
    other = _random_pool(np.random.default_rng(1), 8, PAGE)
    arrays = kvp.scatter_pages(arrays, old[1:], _pages(other, old[1:]))
    assert all(not np.array_equal(np.asarray(arrays[n][:, old[1:]]), want[n][:, 1:]) for n in want)
    hit = cache.lookup(tokens)
    assert hit.num_tokens == 3 * PAGE and hit.pages[0] == old[0] and hit.reload.pages == hit.pages[1:]
    arrays = hit.reload.apply(arrays)
    got = _pages(arrays, hit.pages)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        assert arrays[name].dtype == want[name].dtype
    with pytest.raises(ValueError, match="host pages of"):
        kvp.scatter_pages(arrays, old[1:], {"kv/k": want["kv/k"][:, 1:]})
    stats = cache.stats()
    assert (stats["offloads"], stats["reloads"], stats["host_pages"]) == (2, 2, 0)
    pool.check(extra=hit.pages)
    pool.decref(hit.pages)
    cache.check()


def test_copy_pages_and_gather_helpers():
    arrays = _random_pool(np.random.default_rng(1), 8, PAGE)
    want = kvp.gather_pages(arrays, [3, 5, 6])
    assert want["kv/k"].shape == (2, 3, PAGE, 8) and isinstance(want["kv/k"], np.ndarray)
    assert want["kv/experts"].shape == (3, 3, PAGE, 2) and want["kv/experts"].dtype == np.int8
    for name, x in want.items():  # the listed pages, in order
        np.testing.assert_array_equal(x, np.asarray(arrays[name])[:, [3, 5, 6]])
    arrays = kvp.copy_pages(arrays, [(3, 1), (5, 2), (6, 4)])
    got = kvp.gather_pages(arrays, [1, 2, 4])
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


class _Model:
    """Token ids written into a simulated page store through the tables' writes, copies and reloads."""

    def __init__(self, seed, num_pages=24, max_pages=6):
        self.rng = np.random.default_rng(seed)
        self.pool, self.table, self.cache = _setup(num_pages, max_pages, capacity=8, host_capacity=6)
        self.store_PL = np.full((num_pages, PAGE), -1)
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0
        self.prefixes = [self.rng.integers(2, size=3 * PAGE).tolist() for _ in range(3)]

    def write(self, seq_id, new_tokens):
        out = self.table.append_tokens(seq_id, len(new_tokens))
        for src, dst in out.copies:
            self.store_PL[dst] = self.store_PL[src]
        for (page, slot), token in zip(out.writes, new_tokens):
            self.store_PL[page, slot] = token
        self.tokens[seq_id] += new_tokens

    def step(self):
        rng, table, seqs = self.rng, self.table, sorted(self.tokens)
        op = rng.choice(7, p=[0.25, 0.2, 0.1, 0.2, 0.05, 0.1, 0.1]) if seqs else 0
        seq = seqs[rng.integers(len(seqs))] if seqs else None
        if op == 0:
            shared = self.prefixes[rng.integers(len(self.prefixes))][: rng.integers(3 * PAGE)]
            prompt = shared + rng.integers(2, size=rng.integers(1, 6)).tolist()
            hit = self.cache.lookup(prompt[:-1])
            if hit.reload.pages:
                self.store_PL[hit.reload.pages] = hit.reload.host["k"][0, :, :, 0]
            assert (self.store_PL[hit.pages].reshape(-1) == prompt[: hit.num_tokens]).all()
            seq = self.next_id
            self.next_id += 1
            table.new(seq, hit.pages, hit.num_tokens)
            self.tokens[seq] = prompt[: hit.num_tokens]
            try:
                self.write(seq, prompt[hit.num_tokens :])
            except (kvp.OutOfPages, ValueError):
                table.free(seq)
                del self.tokens[seq]
        elif op == 1:
            before = (table.pages(seq), table.length(seq), self.pool.num_free)
            try:
                self.write(seq, rng.integers(2, size=rng.integers(1, 6)).tolist())
            except (kvp.OutOfPages, ValueError):
                assert (table.pages(seq), table.length(seq), self.pool.num_free) == before
        elif op == 2:
            table.fork(seq, self.next_id)
            self.tokens[self.next_id] = list(self.tokens[seq])
            self.next_id += 1
        elif op == 3:
            table.free(seq)
            del self.tokens[seq]
        elif op == 4:
            length = int(rng.integers(table.length(seq) + 1))
            table.truncate(seq, length)
            del self.tokens[seq][length:]
        elif op == 5:
            self.cache.insert(self.tokens[seq], table.pages(seq))
        else:
            pages = self.cache.offload_candidates(int(rng.integers(1, 4)))
            host_KNLH = self.store_PL[pages][None, :, :, None]
            self.cache.offload(pages, {"k": host_KNLH, "v": host_KNLH})

    def verify(self):
        self.table.check()
        self.cache.check()
        for seq, tokens in self.tokens.items():
            stored = self.store_PL[self.table.pages(seq)].reshape(-1)[: len(tokens)]
            assert stored.tolist() == tokens, f"sequence {seq}"


@pytest.mark.parametrize("seed", range(3))
def test_random_walk_keeps_invariants_and_contents(seed):
    model = _Model(seed)
    for _ in range(400):
        model.step()
        model.verify()
    stats = model.cache.stats()
    assert (
        stats["hit_tokens"] > 0 and stats["offloads"] > 0 and stats["reloads"] > 0 and stats["evictions"] > 0
    )


def _attention(q_NH, k_SKH, v_SKH):
    kv = k_SKH.shape[1]
    q_KGH = q_NH.reshape(kv, -1, q_NH.shape[-1])
    s_KGS = np.einsum("kgh,skh->kgs", q_KGH, k_SKH) / np.sqrt(q_NH.shape[-1])
    p_KGS = np.exp(s_KGS - s_KGS.max(-1, keepdims=True))
    p_KGS /= p_KGS.sum(-1, keepdims=True)
    return np.einsum("kgs,skh->kgh", p_KGS, v_SKH).reshape(q_NH.shape)


def test_forked_sequences_paged_attention_equals_contiguous():
    rng = np.random.default_rng(2)
    kv, n, h, num_pages = 2, 4, 8, 12
    pool, table, _ = _setup(num_pages=num_pages)
    k_pages = jnp.full((kv, num_pages, PAGE, h), jnp.nan, jnp.float32)
    v_pages = jnp.full((kv, num_pages, PAGE, h), jnp.nan, jnp.float32)
    contiguous = {}

    def write(seq, num):
        nonlocal k_pages, v_pages
        k_TKH, v_TKH = rng.normal(size=(2, num, kv, h)).astype(np.float32)
        out = table.append_tokens(seq, num)
        copied = kvp.copy_pages({"k": k_pages, "v": v_pages}, out.copies)
        k_pages, v_pages = copied["k"], copied["v"]
        pages_T, slots_T = (np.array(x) for x in zip(*out.writes))
        k_pages = k_pages.at[:, pages_T, slots_T].set(np.swapaxes(k_TKH, 0, 1))
        v_pages = v_pages.at[:, pages_T, slots_T].set(np.swapaxes(v_TKH, 0, 1))
        old_k, old_v = contiguous.get(seq, (np.zeros((0, kv, h), np.float32),) * 2)
        contiguous[seq] = (np.concatenate([old_k, k_TKH]), np.concatenate([old_v, v_TKH]))

    table.new(0)
    write(0, PAGE + 2)
    table.fork(0, 1)
    contiguous[1] = contiguous[0]
    write(1, 3)
    write(0, PAGE)
    seqs = [0, 1]
    q_BNH = rng.normal(size=(2, n, h)).astype(np.float32)
    o_BNH = paged_attention_reference(
        jnp.asarray(q_BNH),
        k_pages,
        v_pages,
        jnp.asarray(table.lengths(seqs)),
        jnp.asarray(table.page_table(seqs)),
    )
    for b, seq in enumerate(seqs):
        np.testing.assert_allclose(
            np.asarray(o_BNH[b]), _attention(q_BNH[b], *contiguous[seq]), atol=F32_TOL, rtol=F32_TOL
        )
    assert table.pages(0)[0] == table.pages(1)[0] and table.pages(0)[1] != table.pages(1)[1]
