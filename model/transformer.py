"""Decoder-only MoE transformer (pre-norm, GQA or MLA attention, RoPE, SwiGLU or MoE MLP) and `build`.

Dimension key: B batch, T tokens, S cache slots, D model width, V vocab, L layers, K kv heads,
H head dim, k experts per token.

Layers come in two groups: `dense_layers` (the first `moe.first_dense_layers`, or all layers of a dense
model) and `moe_layers`. With `scan_layers` each group holds stacked parameters (leading `layers` axis)
and runs under one `lax.scan`, so a layer is compiled once; otherwise it is a list of blocks. Both
initialise layer i from the same key, so they hold the same parameters.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from model import config as config_lib
from model import layers, logprobs, seeds, sharding
from model.attention import Attention
from model.kv_cache import DenseCache, PagedCache
from model.mla import MLAttention, cache_width
from model.moe.layer import MoEBlock
from model.mtp import MTPModule

ACT = ("act_batch", "act_length", "act_embed")
REMAT_POLICIES = {
    "full": None,  # save nothing; recompute the whole layer in the backward pass
    "dots_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Block(nnx.Module):
    def __init__(self, cfg: ml_collections.ConfigDict, *, use_moe: bool, rngs: nnx.Rngs):
        m = cfg.model
        rules = tuple(cfg.mesh.rules)
        self.attn_norm = layers.RMSNorm(m.d_model, eps=m.norm_eps, dtype=m.param_dtype)
        attention_cls = MLAttention if m.attention_kind == "mla" else Attention
        self.attn = attention_cls(m, rules, rngs=rngs)
        self.mlp_norm = layers.RMSNorm(m.d_model, eps=m.norm_eps, dtype=m.param_dtype)
        if use_moe:
            self.mlp = MoEBlock(m, rules, rngs=rngs)
        else:
            self.mlp = layers.MLP(m, m.d_ff, rules, rngs=rngs)
        self.use_moe = use_moe
        self.rules = rules

    def __call__(self, x_BTD, positions_BT, segment_ids_BT, cache, expert_indices_BTk):
        h_BTD, cache = self.attn(
            self.attn_norm(x_BTD), positions_BT, segment_ids_BT=segment_ids_BT, cache=cache
        )
        x_BTD = x_BTD + h_BTD.astype(x_BTD.dtype)
        if self.use_moe:
            y_BTD, aux = self.mlp(self.mlp_norm(x_BTD), expert_indices_BTk=expert_indices_BTk)
        else:
            y_BTD, aux = self.mlp(self.mlp_norm(x_BTD)), {}
        x_BTD = sharding.constrain(x_BTD + y_BTD.astype(x_BTD.dtype), ACT, self.rules)
        return x_BTD, aux, cache


def _add_layer_axis(v: nnx.Variable) -> nnx.Variable:
    return v.replace(logical_axes=("layers",) + tuple(v.get_metadata()["logical_axes"]))


class LayerStack(nnx.Module):
    """`num` identical blocks: stacked and scanned, or a plain list."""

    def __init__(self, cfg, *, use_moe: bool, num: int, key: jax.Array):
        keys = jax.random.split(key, num)
        make = lambda k: Block(cfg, use_moe=use_moe, rngs=nnx.Rngs(params=k))
        self.scan = bool(cfg.model.scan_layers)
        self.remat = cfg.model.remat
        if self.scan:
            graphdef = nnx.graphdef(nnx.eval_shape(lambda: make(keys[0])))
            stacked = jax.vmap(lambda k: nnx.state(make(k)))(keys)
            stacked = jax.tree.map(_add_layer_axis, stacked, is_leaf=lambda x: isinstance(x, nnx.Variable))
            self.blocks = nnx.merge(graphdef, stacked)
        else:
            self.blocks = nnx.List([make(keys[i]) for i in range(num)])

    def _maybe_remat(self, fn):
        if self.remat == "none":
            return fn
        return jax.checkpoint(fn, policy=REMAT_POLICIES[self.remat], prevent_cse=not self.scan)

    def __call__(self, x_BTD, positions_BT, segment_ids_BT, cache, expert_indices_LBTk):
        def run(block, x, layer_cache, idx):
            return block(x, positions_BT, segment_ids_BT, layer_cache, idx)

        if isinstance(cache, PagedCache):
            return self._paged(run, x_BTD, cache, expert_indices_LBTk)
        if self.scan:
            graphdef, state = nnx.split(self.blocks)

            def body(x, xs):
                layer_state, layer_cache, idx = xs
                x, aux, layer_cache = run(nnx.merge(graphdef, layer_state), x, layer_cache, idx)
                return x, (aux, layer_cache)

            body = self._maybe_remat(body)
            x_BTD, (aux, cache) = jax.lax.scan(body, x_BTD, (state, cache, expert_indices_LBTk))
            return x_BTD, aux, cache
        auxes, caches = [], []
        for i, block in enumerate(self.blocks):
            take = lambda tree, i=i: jax.tree.map(lambda a: a[i], tree)
            step = self._maybe_remat(functools.partial(run, block))
            x_BTD, aux, layer_cache = step(x_BTD, take(cache), take(expert_indices_LBTk))
            auxes.append(aux)
            caches.append(layer_cache)
        stack = lambda trees: jax.tree.map(lambda *a: jnp.stack(a), *trees)
        return x_BTD, stack(auxes), (None if cache is None else stack(caches))

    def _paged(self, run, x_BTD, cache, expert_indices_LBTk):
        """The layers over a paged cache: the page arrays (`cache.pages`) are carried (updated in place),
        layer i of the stack is cache layer `cache.layer + i`."""
        first = cache.layer

        if self.scan:
            graphdef, state = nnx.split(self.blocks)
            num = jax.tree.leaves(state)[0].shape[0]

            def body(carry, xs):
                x, pages = carry
                layer_state, i, idx = xs
                layer_cache = cache._replace(pages=pages, layer=first + i)
                x, aux, layer_cache = run(nnx.merge(graphdef, layer_state), x, layer_cache, idx)
                return (x, layer_cache.pages), aux

            xs = (state, jnp.arange(num, dtype=jnp.int32), expert_indices_LBTk)
            (x_BTD, pages), aux = jax.lax.scan(body, (x_BTD, cache.pages), xs)
            return x_BTD, aux, cache._replace(pages=pages)
        auxes = []
        for i, block in enumerate(self.blocks):
            idx = None if expert_indices_LBTk is None else expert_indices_LBTk[i]
            x_BTD, aux, cache = run(block, x_BTD, cache._replace(layer=first + i), idx)
            auxes.append(aux)
        stack = lambda trees: jax.tree.map(lambda *a: jnp.stack(a), *trees)
        return x_BTD, stack(auxes), cache._replace(layer=first)


class Transformer(nnx.Module):
    """`__call__(tokens_BT, positions_BT, *, segment_ids=None, kv_cache=None, expert_indices=None,
    logit_positions=None)` returns `(logits_BTV in f32, aux)`; with `logit_positions` [B, K] (indices into
    each row, clipped to T - 1; a contiguous-cache or cache-free call) the logits of those positions only,
    logits_BKV: the LM head and its softmax cost K / T of the full ones. `aux` holds the MoE losses
    (`moe_loss` is the weighted sum to add to a training loss), per-layer expert load, dropped tokens, the
    chosen experts (`expert_indices [L_moe, B, T, k]`, to replay routing), the last hidden state before the
    final norm (`hidden`, what multi-token prediction reads: `mtp_logits`), and `kv_cache` when one was
    passed.
    """

    def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
        config_lib.validate_model(cfg.model)
        # Hashable, stored in the graph definition: the sections the model reads and no others, so configs
        # that differ only elsewhere (rl, data, ...) give equal graph definitions and share jitted steps
        # (`inference.steps.jitted`, `rl.train_step`'s step cache); a read of another section fails here.
        cfg = model_config(cfg)
        m = cfg.model
        self.cfg = cfg
        self.rules = tuple(cfg.mesh.rules)
        self.embed = layers.Embed(m, rngs=rngs)
        self.num_dense, self.num_moe = config_lib.layer_counts(m)
        key = rngs.params()
        self.dense_layers = (
            LayerStack(cfg, use_moe=False, num=self.num_dense, key=jax.random.fold_in(key, 0))
            if self.num_dense
            else None
        )
        self.moe_layers = (
            LayerStack(cfg, use_moe=True, num=self.num_moe, key=jax.random.fold_in(key, 1))
            if self.num_moe
            else None
        )
        self.final_norm = layers.RMSNorm(m.d_model, eps=m.norm_eps, dtype=m.param_dtype)
        if m.mtp_layers:  # after the last layer, so MoE whenever the model has experts
            rngs_k = [nnx.Rngs(params=jax.random.fold_in(key, 2 + k)) for k in range(m.mtp_layers)]
            self.mtp = nnx.List(
                [MTPModule(cfg, Block(cfg, use_moe=bool(m.moe.num_experts), rngs=r), rngs=r) for r in rngs_k]
            )
        if not m.tie_embeddings:
            self.unembed = layers.param(
                rngs,
                (m.d_model, m.vocab_size),
                ("embed", "vocab"),
                std=m.d_model**-0.5,
                dtype=m.param_dtype,
            )

    def cache_rows(self) -> tuple[dict[str, int], int]:
        """({page array name: width}, rows per layer) of this model's KV cache: GQA keeps `k` and `v` of
        head_dim per kv head; MLA one `latent` row of kv_lora_rank + qk_rope_head_dim for all heads."""
        m = self.cfg.model
        if m.attention_kind == "mla":
            return {"latent": cache_width(m)}, 1
        return {"k": m.head_dim, "v": m.head_dim}, m.num_kv_heads

    def init_cache(self, batch: int, max_len: int, dtype=None) -> DenseCache:
        """A contiguous KV cache for `max_len` positions per row, empty (index 0)."""
        dtype = dtype or self.cfg.model.compute_dtype
        widths, heads = self.cache_rows()

        def group(num):
            if not num:
                return None
            return {k: jnp.zeros((num, batch, max_len, heads, w), dtype) for k, w in widths.items()}

        groups = {"dense": group(self.num_dense), "moe": group(self.num_moe)}
        return DenseCache(groups, jnp.zeros((batch,), jnp.int32))

    def init_paged_cache(self, num_pages: int, page_size: int, dtype=None) -> dict:
        """Empty page arrays [num_layers * K, num_pages, page_size, width] for a paged cache (`k`/`v`, or
        MLA's `latent` with K = 1; see `cache_rows`). The engine owns the page tables; see `__call__`."""
        m = self.cfg.model
        dtype = dtype or m.compute_dtype
        widths, heads = self.cache_rows()
        return {
            k: jnp.zeros((m.num_layers * heads, num_pages, page_size, w), dtype) for k, w in widths.items()
        }

    def __call__(
        self,
        tokens_BT: jax.Array,
        positions_BT: jax.Array | None = None,
        *,
        segment_ids: jax.Array | None = None,
        kv_cache: DenseCache | PagedCache | None = None,
        expert_indices: jax.Array | None = None,
        logit_positions: jax.Array | None = None,
    ) -> tuple[jax.Array, dict]:
        m = self.cfg.model
        b, t = tokens_BT.shape
        paged = isinstance(kv_cache, PagedCache)
        if positions_BT is None:
            start = 0 if kv_cache is None else (kv_cache.start if paged else kv_cache.index)[:, None]
            positions_BT = start + jnp.arange(t, dtype=jnp.int32)[None, :]
        positions_BT = jnp.broadcast_to(positions_BT, (b, t))
        x_BTD = sharding.constrain(self.embed(tokens_BT), ACT, self.rules)

        def layer_cache(name):
            if kv_cache is None:
                return None
            arrays = kv_cache.arrays[name]
            index = jnp.broadcast_to(kv_cache.index, (next(iter(arrays.values())).shape[0], b))
            return DenseCache(arrays, index)

        new_cache = {}
        moe_aux = {}
        if paged:
            if logit_positions is not None:
                raise ValueError("logit_positions is for cache-free or contiguous-cache forwards, not paged")
            return self._paged_call(x_BTD, positions_BT, kv_cache, expert_indices)
        if self.dense_layers is not None:
            x_BTD, _, new_cache["dense"] = self.dense_layers(
                x_BTD, positions_BT, segment_ids, layer_cache("dense"), None
            )
        if self.moe_layers is not None:
            x_BTD, moe_aux, new_cache["moe"] = self.moe_layers(
                x_BTD, positions_BT, segment_ids, layer_cache("moe"), expert_indices
            )
        if logit_positions is None:
            logits_BTV = self._logits(x_BTD)
        else:
            index_BK = jnp.clip(logit_positions.astype(jnp.int32), 0, t - 1)
            logits_BTV = self._logits(jnp.take_along_axis(x_BTD, index_BK[:, :, None], axis=1))
        aux = summarize_aux(moe_aux, m.moe)
        aux["hidden"] = x_BTD
        if kv_cache is not None:
            arrays = {name: _arrays(new_cache.get(name)) for name in ("dense", "moe")}
            aux["kv_cache"] = DenseCache(arrays, kv_cache.index + t)
        return logits_BTV, aux

    def _logits(self, x_BTD: jax.Array, *, normed: bool = False) -> jax.Array:
        """Output logits of a hidden state (after `final_norm`, unless `normed` says it was normed)."""
        if not normed:
            x_BTD = self.final_norm(x_BTD)
        if self.cfg.model.tie_embeddings:
            logits_BTV = self.embed.attend(x_BTD)
        else:
            w_DV = self.unembed[...].astype(x_BTD.dtype)
            logits_BTV = layers.matmul_rows(x_BTD, w_DV, preferred_element_type=jnp.float32)
        return sharding.constrain(
            logits_BTV.astype(jnp.float32), ("act_batch", "act_length", "act_vocab"), self.rules
        )

    def _paged_call(self, x_BTD, positions_BT, kv_cache: PagedCache, expert_indices):
        """Paged-cache forward: `kv_cache.pages` are the page arrays of `init_paged_cache`; returns logits
        and aux["kv_cache"], the updated page arrays."""
        cache = _int32_paged(kv_cache)
        moe_aux = {}
        if self.dense_layers is not None:
            x_BTD, _, cache = self.dense_layers(x_BTD, positions_BT, None, cache, None)
        if self.moe_layers is not None:
            cache = cache._replace(layer=jnp.asarray(self.num_dense, jnp.int32))
            x_BTD, moe_aux, cache = self.moe_layers(x_BTD, positions_BT, None, cache, expert_indices)
        aux = summarize_aux(moe_aux, self.cfg.model.moe)
        aux["kv_cache"] = cache.pages
        aux["hidden"] = x_BTD
        return self._logits(x_BTD), aux

    def mtp_logits(
        self,
        hidden_BTD: jax.Array,
        tokens_BT: jax.Array,
        positions_BT: jax.Array | None = None,
        *,
        segment_ids=None,
    ) -> jax.Array:
        """logits_DBTV of the `model.mtp_layers` multi-token-prediction modules (`model.mtp`): module k at
        position i predicts token i + k + 1 from `hidden` (aux["hidden"] of the forward over `tokens`)."""
        b, t = tokens_BT.shape
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
        out, h_BTD = [], hidden_BTD
        for k, module in enumerate(self.mtp, start=1):
            emb_BTD = self.embed(logprobs.shifted(tokens_BT, k))
            h_BTD, _, _ = module(h_BTD, emb_BTD, positions_BT, segment_ids)
            out.append(self._logits(module.norm(h_BTD), normed=True))
        return jnp.stack(out)

    def init_mtp_paged_cache(self, num_pages: int, page_size: int, dtype=None) -> dict:
        """Empty page arrays for the first MTP module's attention (one layer; layout of `init_paged_cache`),
        what `mtp_paged` reads and writes: the engine's MTP drafter keeps them beside the target's."""
        m = self.cfg.model
        widths, heads = self.cache_rows()
        dtype = dtype or m.compute_dtype
        return {k: jnp.zeros((heads, num_pages, page_size, w), dtype) for k, w in widths.items()}

    def mtp_paged(self, hidden_BTD: jax.Array, next_tokens_BT: jax.Array, kv_cache: PagedCache):
        """The first MTP module over a paged cache (`init_mtp_paged_cache` arrays as its pages, as for
        `__call__`): at position start + t it reads the hidden state `hidden_BTD[:, t]` of
        position start + t and the embedding of the token after it, `next_tokens_BT[:, t]`, and predicts
        the token after that. Returns (logits_BTV, the module's hidden state h'_BTD, updated page arrays)."""
        module = self.mtp[0]
        b, t = next_tokens_BT.shape
        cache = _int32_paged(kv_cache)
        positions_BT = cache.start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        emb_BTD = self.embed(next_tokens_BT)
        h_BTD, _, cache = module(hidden_BTD.astype(emb_BTD.dtype), emb_BTD, positions_BT, None, cache)
        logits_BTV = self._logits(module.norm(h_BTD), normed=True)
        return logits_BTV, h_BTD, cache.pages


def _int32_paged(cache: PagedCache) -> PagedCache:
    """`cache` with int32 table, start and num_new, at cache layer 0."""
    return PagedCache(
        cache.pages,
        cache.page_table.astype(jnp.int32),
        cache.start.astype(jnp.int32),
        cache.num_new.astype(jnp.int32),
        jnp.zeros((), jnp.int32),
    )


def _arrays(cache: DenseCache | None) -> dict | None:
    return None if cache is None else cache.arrays


def summarize_aux(moe_aux: dict, moe_cfg) -> dict:
    """Per-layer MoE statistics [L_moe, ...] -> means over layers, plus the weighted `moe_loss`."""
    if not moe_aux:
        zero = jnp.zeros((), jnp.float32)
        return {"moe_loss": zero, "load_balance_loss": zero, "router_z_loss": zero}
    lb = jnp.mean(moe_aux["load_balance_loss"])
    z = jnp.mean(moe_aux["router_z_loss"])
    return {
        "moe_loss": moe_cfg.load_balance_weight * lb + moe_cfg.z_loss_weight * z,
        "load_balance_loss": lb,
        "router_z_loss": z,
        "expert_load": moe_aux["expert_load"],
        "dropped_tokens": jnp.sum(moe_aux["dropped_tokens"]),
        "dropped_fraction": jnp.mean(moe_aux["dropped_fraction"]),
        "expert_indices": moe_aux["expert_indices"],
    }


def build(
    cfg: ml_collections.ConfigDict, *, seed: int = 0, mesh: jax.sharding.Mesh | None = None
) -> Transformer:
    """Builds the model; with a mesh, every parameter is created directly with its sharding."""
    config_lib.validate(cfg, None if mesh is None else mesh.size)
    if mesh is None:
        return Transformer(cfg, rngs=nnx.Rngs(params=seeds.key(seed)))
    graphdef, init = _sharded_init(model_config(cfg), mesh)
    with jax.set_mesh(mesh):
        state = init(seeds.key(seed))
    return nnx.merge(graphdef, state)


def model_config(cfg: ml_collections.ConfigDict) -> ml_collections.FrozenConfigDict:
    """The sections of `cfg` a Transformer reads (model, mesh), frozen: hashable, a cache key."""
    return ml_collections.FrozenConfigDict({"model": cfg.model, "mesh": cfg.mesh})


# The init program runs once, for milliseconds; on CPU most of its compile is LLVM optimizing its threefry
# hashes. At backend optimization level 0 it compiles several times faster and runs a few ms longer
# (`python -m benchmarks init_compile`; benchmarks/results/init_compile.jsonl), and its values are within a
# few ulp of the default level's (another rounding order in the normal draws).
INIT_CPU_OPTIONS = {"xla_backend_optimization_level": 0}


def init_compiler_options(mesh: jax.sharding.Mesh) -> dict | None:
    """The init program's compiler options on `mesh`: INIT_CPU_OPTIONS on CPU, XLA's defaults elsewhere."""
    return dict(INIT_CPU_OPTIONS) if mesh.devices.flat[0].platform == "cpu" else None


@functools.lru_cache(maxsize=16)
def _sharded_init(cfg: ml_collections.FrozenConfigDict, mesh: jax.sharding.Mesh, xla_defaults: bool = False):
    """(graph definition, jitted `init(key) -> state`): every parameter made with its sharding on `mesh`.
    The key is an argument, so every seed runs one program (one compile, a threefry hash per parameter); the
    model and mesh are the cache key. Compiled with `init_compiler_options`, or XLA's defaults everywhere
    (`xla_defaults`, for the benchmark)."""
    make = lambda key: Transformer(cfg, rngs=nnx.Rngs(params=key))  # noqa: E731
    graphdef, abstract = nnx.split(nnx.eval_shape(make, jax.random.key(0)))
    shardings = sharding.state_shardings(abstract, mesh, cfg.mesh.rules)
    options = None if xla_defaults else init_compiler_options(mesh)
    init = jax.jit(lambda key: nnx.state(make(key)), out_shardings=shardings, compiler_options=options)
    return graphdef, init


def next_token_loss(logits_BTV: jax.Array, tokens_BT: jax.Array, mask_BT=None) -> jax.Array:
    """Mean cross-entropy of predicting tokens[:, t + 1] from logits[:, t] (where mask[:, t + 1])."""
    return logprobs.masked_nll(logits_BTV, tokens_BT, mask_BT)
