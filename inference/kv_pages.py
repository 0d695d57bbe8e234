"""Paged KV cache bookkeeping: page pool, page tables with copy-on-write, prefix cache, host tier.

Dimension key: K kv heads, P pages in the pool, L slots per page (page size), H head dim, N pages moved in
one gather/scatter, B sequences in a batch, M pages per sequence in a page table.

Everything here is host-side Python/numpy; the page contents live in device arrays that the engine owns,
page axis 1 in each (`k_pages_KPLH` / `v_pages_KPLH`, the layout `pallas_kernels.paged_attention` reads;
MLA's `latent` pages; the routing record; a drafter's pages), passed to the helpers below as one dict of
named page arrays. The bookkeeping tells the engine what to do to them: `SequenceTable.append_tokens`
returns the (page, slot) write positions and the (src, dst) page copies that copy-on-write needs (apply them
with `copy_pages` before the writes); `PrefixCache.offload` / `PrefixCache.lookup` hand pages to and from
the host tier through `gather_pages` / `scatter_pages`, every named array of a page together.

Page `NULL_PAGE` (0) is reserved: never allocated, it fills unused page-table entries so that every entry
is a valid pool index (the attention kernels mask those slots by length).

Ownership: every holder of a page (a sequence, the prefix cache, a `PrefixHit` not yet adopted by a
sequence) owns one reference; a page returns to the free list when its count reaches 0. `check()` verifies
that the counts equal the holders registered with the pool.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

NULL_PAGE = 0


class OutOfPages(RuntimeError):
    """The pool (after evicting what the prefix cache could give back) has fewer free pages than asked."""

    def __init__(self, asked: int, free: int):
        super().__init__(f"asked for {asked} pages, only {free} free (after prefix-cache eviction)")
        self.asked, self.free = asked, free


class Holder(Protocol):
    def held_pages(self) -> Iterable[int]:
        """Every page this holder references, once per reference it owns."""


class Reclaimer(Protocol):
    def reclaimable(self) -> int:
        """How many pages `reclaim` could return to the free list now."""

    def reclaim(self, n: int) -> None:
        """Releases at least n pages (n <= reclaimable())."""


class PagePool:
    """Free list and reference counts of P pages of L slots; page `NULL_PAGE` is reserved."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2 or page_size < 1:
            raise ValueError(
                f"num_pages {num_pages} (>= 2: one is the null page), page_size {page_size} (>= 1)"
            )
        self.num_pages, self.page_size = num_pages, page_size
        self._refs = np.zeros(num_pages, np.int64)
        # Popping from the end hands out low page ids first (readable tables in tests and logs).
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))
        self._holders: list[Holder] = []
        self.reclaimer: Reclaimer | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_pages(self) -> list[int]:
        """The pages on the free list (a copy)."""
        return list(self._free)

    def refcount(self, page: int) -> int:
        return int(self._refs[page])

    def register(self, holder: Holder) -> None:
        """Adds a holder whose `held_pages()` `check()` counts."""
        self._holders.append(holder)

    def alloc(self, n: int) -> list[int]:
        """n fresh pages with count 1; asks the reclaimer (the prefix cache) for pages if short. Raises
        `OutOfPages` before changing anything when even that cannot cover n."""
        if n < 0:
            raise ValueError(f"alloc({n}): n must be >= 0")
        short = n - len(self._free)
        if short > 0:
            reclaimable = self.reclaimer.reclaimable() if self.reclaimer else 0
            if reclaimable < short:
                raise OutOfPages(n, len(self._free) + reclaimable)
            self.reclaimer.reclaim(short)
        pages = [self._free.pop() for _ in range(n)]
        self._refs[pages] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        for page in pages:
            if self._refs[page] <= 0:
                raise ValueError(f"incref of page {page}, which is free (count 0)")
        np.add.at(self._refs, pages, 1)

    def decref(self, pages: Iterable[int]) -> None:
        """Drops one reference per listed page; pages reaching 0 go back to the free list. A decref past 0
        (double free) raises before any count changes."""
        pages = list(pages)
        counts = collections.Counter(pages)
        for page, k in counts.items():
            if page == NULL_PAGE or self._refs[page] < k:
                raise ValueError(f"decref of page {page} x{k}, count {self._refs[page]}: double free")
        np.add.at(self._refs, pages, -1)
        self._free.extend(page for page in counts if self._refs[page] == 0)

    def check(self, extra: Iterable[int] = ()) -> None:
        """Counts equal the references of the registered holders plus `extra` (pages held elsewhere, e.g. an
        unadopted `PrefixHit`); the free list is exactly the unreferenced pages, without duplicates."""
        expected = np.zeros(self.num_pages, np.int64)
        for holder in self._holders:
            np.add.at(expected, list(holder.held_pages()), 1)
        np.add.at(expected, list(extra), 1)
        assert expected[NULL_PAGE] == 0, "the null page is held"
        bad = np.flatnonzero(expected != self._refs)
        assert not bad.size, f"pages {bad.tolist()}: counts {self._refs[bad]}, holders {expected[bad]}"
        assert len(set(self._free)) == len(self._free), "duplicate pages in the free list"
        free = set(self._free)
        assert NULL_PAGE not in free, "the null page is on the free list"
        unreferenced = {p for p in range(self.num_pages) if p != NULL_PAGE and self._refs[p] == 0}
        assert free == unreferenced, f"free {sorted(free ^ unreferenced)} vs unreferenced mismatch"


class Append(NamedTuple):
    """What `append_tokens` asks of the engine: first the page copies (src, dst), then the K/V writes of
    the new tokens at (page, slot), in token order."""

    writes: list[tuple[int, int]]
    copies: list[tuple[int, int]]


@dataclasses.dataclass
class _Seq:
    pages: list[int]
    length: int


class SequenceTable:
    """Page lists of live sequences over one pool; at most `max_pages_per_seq` pages each."""

    def __init__(self, pool: PagePool, max_pages_per_seq: int):
        self.pool, self.max_pages = pool, max_pages_per_seq
        self._seqs: dict[int, _Seq] = {}
        pool.register(self)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def held_pages(self) -> Iterable[int]:
        return (page for seq in self._seqs.values() for page in seq.pages)

    def pages(self, seq_id: int) -> list[int]:
        return list(self._seqs[seq_id].pages)

    def length(self, seq_id: int) -> int:
        return self._seqs[seq_id].length

    def new(self, seq_id: int, prefix_pages: Sequence[int] = (), prefix_len: int = 0) -> None:
        """Starts a sequence, adopting the references of `prefix_pages` that hold its first `prefix_len`
        tokens (a `PrefixHit`: its pages and num_tokens)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} exists")
        if len(prefix_pages) != -(-prefix_len // self.pool.page_size) or len(prefix_pages) > self.max_pages:
            raise ValueError(f"{len(prefix_pages)} prefix pages for {prefix_len} tokens")
        self._seqs[seq_id] = _Seq(list(prefix_pages), prefix_len)

    def append_tokens(self, seq_id: int, n: int) -> Append:
        """Reserves slots for n more tokens. A shared, partially filled last page is first copied into a
        private page (copy-on-write); full shared pages stay shared. Atomic: raises (`OutOfPages` or
        ValueError past `max_pages_per_seq`) before changing anything."""
        seq, size = self._seqs[seq_id], self.pool.page_size
        if n <= 0:
            return Append([], [])
        total_pages = -(-(seq.length + n) // size)
        if total_pages > self.max_pages:
            raise ValueError(
                f"sequence {seq_id}: {seq.length + n} tokens need {total_pages} pages > {self.max_pages}"
            )
        partial = seq.length % size != 0
        cow = partial and self.pool.refcount(seq.pages[-1]) > 1
        fresh = self.pool.alloc(total_pages - len(seq.pages) + cow)
        copies = []
        if cow:
            src, dst = seq.pages[-1], fresh.pop()
            seq.pages[-1] = dst
            self.pool.decref([src])
            copies.append((src, dst))
        seq.pages.extend(fresh)
        positions = range(seq.length, seq.length + n)
        seq.length += n
        return Append([(seq.pages[t // size], t % size) for t in positions], copies)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every page of the parent (one more reference each); no copy until one of them
        appends into the shared partial last page."""
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id} exists")
        parent = self._seqs[parent_id]
        self.pool.incref(parent.pages)
        self._seqs[child_id] = _Seq(list(parent.pages), parent.length)

    def truncate(self, seq_id: int, length: int) -> None:
        """Drops the tokens from `length` on (speculative-decoding rollback), releasing emptied pages."""
        seq = self._seqs[seq_id]
        if not 0 <= length <= seq.length:
            raise ValueError(f"truncate sequence {seq_id} of {seq.length} tokens to {length}")
        keep = -(-length // self.pool.page_size)
        self.pool.decref(seq.pages[keep:])
        del seq.pages[keep:]
        seq.length = length

    def free(self, seq_id: int) -> None:
        self.pool.decref(self._seqs.pop(seq_id).pages)

    def page_table(self, seq_ids: Sequence[int], max_pages: int | None = None) -> np.ndarray:
        """page_table_BM int32; entries past a sequence's pages hold `NULL_PAGE`."""
        m = self.max_pages if max_pages is None else max_pages
        table_BM = np.full((len(seq_ids), m), NULL_PAGE, np.int32)
        for b, seq_id in enumerate(seq_ids):
            pages = self._seqs[seq_id].pages
            if len(pages) > m:
                raise ValueError(f"sequence {seq_id} has {len(pages)} pages > max_pages {m}")
            table_BM[b, : len(pages)] = pages
        return table_BM

    def lengths(self, seq_ids: Sequence[int]) -> np.ndarray:
        """lengths_B int32."""
        return np.array([self._seqs[s].length for s in seq_ids], np.int32).reshape(len(seq_ids))

    def check(self) -> None:
        for seq_id, seq in self._seqs.items():
            need = -(-seq.length // self.pool.page_size)
            assert len(seq.pages) == need <= self.max_pages, f"sequence {seq_id}: {seq} needs {need} pages"
        self.pool.check()


# --- Device helpers -------------------------------------------------------------------------------------


def _bucket(n: int) -> int:
    """Page counts are padded to powers of two so a handful of shapes covers every call (no retraces)."""
    return 1 << max(n - 1, 0).bit_length()


def _padded(pages: Sequence[int]) -> jax.Array:
    return jnp.asarray(np.pad(np.asarray(pages, np.int32), (0, _bucket(len(pages)) - len(pages))))


Pages = dict[str, jax.Array]  # named page arrays, page axis 1: [rows, P, L, width] (k, v, latent, experts...)
HostPages = dict[str, np.ndarray]  # the same names, host copies of N pages: [rows, N, L, width]


@jax.jit
def _gather(arrays: Pages, pages_N) -> Pages:
    return {name: a[:, pages_N] for name, a in arrays.items()}


def _scatter_fn(arrays: Pages, pages_N, host: Pages) -> Pages:
    return {name: a.at[:, pages_N].set(host[name].astype(a.dtype)) for name, a in arrays.items()}


def _copy_fn(arrays: Pages, src_N, dst_N) -> Pages:
    return {name: a.at[:, dst_N].set(a[:, src_N]) for name, a in arrays.items()}


@functools.lru_cache(maxsize=32)
def _in_place(fn, shardings: tuple):
    """`fn` jitted with the page arrays donated and its outputs placed like them (a pool sharded over a
    mesh stays as the engine's steps expect it); `shardings`: (name, sharding) pairs."""
    return jax.jit(fn, donate_argnums=0, out_shardings=dict(shardings))


def _shardings(arrays: Pages) -> tuple:
    return tuple((name, a.sharding) for name, a in sorted(arrays.items()))


def gather_pages(arrays: Pages, pages: Sequence[int]) -> HostPages:
    """Host copies of the listed pages of every named array. Reads only: the pool arrays stay valid."""
    host = jax.device_get(_gather(arrays, _padded(pages)))
    return {name: x[:, : len(pages)] for name, x in host.items()}


def scatter_pages(arrays: Pages, pages: Sequence[int], host: HostPages) -> Pages:
    """New page arrays with the host pages (`gather_pages`' names) written at `pages`; donates the old
    arrays. Padding writes zeros into `NULL_PAGE`, whose contents are never read unmasked."""
    if sorted(host) != sorted(arrays):
        raise ValueError(f"host pages of {sorted(host)} for page arrays {sorted(arrays)}")
    padded = {}
    for name, x in host.items():
        pad = [(0, 0)] * x.ndim
        pad[1] = (0, _bucket(len(pages)) - len(pages))
        padded[name] = np.pad(x, pad)
    return _in_place(_scatter_fn, _shardings(arrays))(arrays, _padded(pages), padded)


def copy_pages(arrays: Pages, copies: Sequence[tuple[int, int]]) -> Pages:
    """Applies `Append.copies` (src, dst) to every named array in one jitted gather/scatter; donates the
    old arrays. Padding copies `NULL_PAGE` onto itself."""
    if not copies:
        return arrays
    src, dst = zip(*copies)
    return _in_place(_copy_fn, _shardings(arrays))(arrays, _padded(src), _padded(dst))


# --- Prefix cache and host tier -------------------------------------------------------------------------


def block_hashes(tokens: Sequence[int], page_size: int) -> list[bytes]:
    """One digest per full page-aligned block, each of (parent digest, block tokens): a block's digest names
    its whole prefix, so equal blocks after different prefixes never collide."""
    digests, parent = [], b""
    for start in range(0, len(tokens) - page_size + 1, page_size):
        block = np.asarray(tokens[start : start + page_size], np.int64).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        digests.append(parent)
    return digests


@dataclasses.dataclass
class _Block:
    page: int | None  # device page, None while the block lives on the host tier
    host: dict[str, np.ndarray] | None = None  # name -> [rows, L, width] while on the host tier


class HostReload(NamedTuple):
    """Host blocks a lookup brought back: the engine writes them into their fresh pages with `apply`."""

    pages: list[int]
    host: HostPages | None  # name -> [rows, len(pages), L, width]

    def apply(self, arrays: Pages) -> Pages:
        """`arrays` with the reloaded pages written (the old arrays donated when there are any)."""
        if not self.pages:
            return arrays
        return scatter_pages(arrays, self.pages, self.host)


class PrefixHit(NamedTuple):
    """The longest cached prefix: one reference per page is the caller's (adopt it with
    `SequenceTable.new(seq_id, hit.pages, hit.num_tokens)`), after applying `reload` to the pool arrays."""

    pages: list[int]
    num_tokens: int
    reload: HostReload


class PrefixCache:
    """Full page-aligned blocks of finished prefills -> pages, across requests, in LRU order.

    The cache holds one reference per device block. Blocks only the cache references are evicted, least
    recently used first, when more than `capacity_pages` are on device and whenever the pool runs short
    (the cache is the pool's reclaimer), or moved to the host tier (`offload`), which keeps at most
    `host_capacity_pages` blocks and drops its least recently used beyond that. Blocks of a prefix are
    touched deepest first, so a block is never more recently used than its parent and eviction takes the
    tails of prefixes before their heads.
    """

    def __init__(self, pool: PagePool, page_size: int, capacity_pages: int, host_capacity_pages: int = 0):
        if page_size != pool.page_size:
            raise ValueError(f"page_size {page_size} != the pool's {pool.page_size}")
        self.pool, self.page_size = pool, page_size
        self.capacity, self.host_capacity = capacity_pages, host_capacity_pages
        self._blocks: collections.OrderedDict[bytes, _Block] = collections.OrderedDict()  # LRU first
        self._by_page: dict[int, bytes] = {}
        self._stats = collections.Counter()
        pool.register(self)
        pool.reclaimer = self

    def held_pages(self) -> Iterable[int]:
        return iter(self._by_page)

    def lookup(self, tokens: Sequence[int]) -> PrefixHit:
        """The longest cached page-aligned prefix of `tokens`, with a reference per page for the caller.
        Host blocks on it are reloaded into fresh pages (see `PrefixHit.reload`); if the pool cannot give
        those pages, the hit stops before the first host block. The engine should look up all but the last
        prompt token, so that at least one token is prefilled to produce logits."""
        self._stats.update(lookups=1, lookup_tokens=len(tokens))
        hit = []
        for digest in block_hashes(tokens, self.page_size):
            if digest not in self._blocks:
                break
            hit.append(digest)
        # References first, so that the reclaim an alloc below may trigger cannot evict these blocks.
        self.pool.incref(self._blocks[d].page for d in hit if self._blocks[d].page is not None)
        on_host = [i for i, d in enumerate(hit) if self._blocks[d].page is None]
        try:
            fresh = self.pool.alloc(len(on_host))
        except OutOfPages:
            self.pool.decref(
                self._blocks[d].page for d in hit[on_host[0] :] if self._blocks[d].page is not None
            )
            hit, on_host, fresh = hit[: on_host[0]], [], []
        reloaded = []
        for i, page in zip(on_host, fresh):
            block = self._blocks[hit[i]]
            reloaded.append(block.host)
            block.page, block.host = page, None
            self._by_page[page] = hit[i]
        self.pool.incref(fresh)
        for digest in reversed(hit):
            self._blocks.move_to_end(digest)
        self._stats.update(hit_tokens=len(hit) * self.page_size, reloads=len(fresh))
        host = {name: np.stack([b[name] for b in reloaded], 1) for name in reloaded[0]} if reloaded else None
        reload = HostReload(fresh, host)
        return PrefixHit([self._blocks[d].page for d in hit], len(hit) * self.page_size, reload)

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        """Registers the full blocks of `tokens` held in `pages` (a sequence's pages, in order); the partial
        last page is never cached. Known blocks keep their page (a host block takes the new device page)."""
        digests = block_hashes(tokens, self.page_size)[: len(pages)]
        for digest, page in zip(digests, pages):
            if self.pool.refcount(page) == 0:
                raise ValueError(f"insert of free page {page}")
            if self._by_page.get(page, digest) != digest:
                raise ValueError(f"page {page} already caches a different block")
        for digest, page in zip(digests, pages):
            block = self._blocks.setdefault(digest, _Block(None))
            if block.page is None:
                self.pool.incref([page])
                block.page, block.host = page, None
                self._by_page[page] = digest
        for digest in reversed(digests):
            self._blocks.move_to_end(digest)
        self._evict(len(self._by_page) - self.capacity)

    def clear(self) -> None:
        """Forgets every block (new weights make cached K/V stale); pages sequences hold stay theirs."""
        pages = list(self._by_page)
        self._blocks.clear()
        self._by_page.clear()
        self.pool.decref(pages)
        self._stats.update(clears=1)

    def reclaimable(self) -> int:
        return len(self._idle_blocks())

    def reclaim(self, n: int) -> None:
        self._evict(n)

    def offload_candidates(self, n: int) -> list[int]:
        """Pages of the n least recently used device blocks that only the cache references."""
        return [self._blocks[d].page for d in self._idle_blocks()[:n]]

    def offload(self, pages: Sequence[int], host: HostPages) -> None:
        """Moves the blocks of `pages` (from `offload_candidates`; `host`: their contents, every named page
        array, from `gather_pages`) to the host tier and frees their device pages. Pages someone else still
        references are refused."""
        for page in pages:
            if page not in self._by_page or self.pool.refcount(page) != 1:
                raise ValueError(f"page {page} is not a cached page that only the cache references")
        for n, page in enumerate(pages):
            block = self._blocks[self._by_page.pop(page)]
            block.page, block.host = None, {name: np.array(x[:, n]) for name, x in host.items()}
        self.pool.decref(pages)
        self._stats.update(offloads=len(pages))
        host = [d for d, b in self._blocks.items() if b.page is None]
        for digest in host[: max(len(host) - self.host_capacity, 0)]:
            del self._blocks[digest]
            self._stats.update(host_evictions=1)

    def offload_lru(self, n: int, arrays: Pages) -> int:
        """Offloads up to n idle blocks (copying their pages of every named array to the host); returns how
        many it moved."""
        pages = self.offload_candidates(n)
        if pages:
            self.offload(pages, gather_pages(arrays, pages))
        return len(pages)

    def stats(self) -> dict[str, float]:
        """Counters; hit_rate is cached tokens over looked-up tokens."""
        s = {k: self._stats[k] for k in ("lookups", "lookup_tokens", "hit_tokens", "evictions", "offloads")}
        s.update(reloads=self._stats["reloads"], host_evictions=self._stats["host_evictions"])
        s["hit_rate"] = s["hit_tokens"] / max(s["lookup_tokens"], 1)
        s["device_pages"] = len(self._by_page)
        s["host_pages"] = len(self._blocks) - len(self._by_page)
        return s

    def check(self) -> None:
        for digest, block in self._blocks.items():
            assert (block.page is None) != (block.host is None), f"block {digest.hex()}: {block}"
            if block.page is not None:
                assert self._by_page.get(block.page) == digest, f"page {block.page} index mismatch"
        assert len(self._by_page) == sum(b.page is not None for b in self._blocks.values())
        assert len(self._blocks) - len(self._by_page) <= self.host_capacity, "host tier over capacity"
        self.pool.check()

    def _idle_blocks(self) -> list[bytes]:
        """Device blocks only the cache references, least recently used first."""
        return [d for d, b in self._blocks.items() if b.page is not None and self.pool.refcount(b.page) == 1]

    def _evict(self, n: int) -> None:
        for digest in self._idle_blocks()[: max(n, 0)]:
            page = self._blocks.pop(digest).page
            del self._by_page[page]
            self.pool.decref([page])
            self._stats.update(evictions=1)
