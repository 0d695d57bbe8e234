"""Where the engine's arrays live on a mesh: the inference layout, in one place.

Dimension key: L layers, K kv heads, P pages in the pool, S slots per page, W page width.

Weights (`inference_rules`, derived from the training rules `cfg.mesh.rules`): tensor parallel over attention
heads, kv heads, the MLP hidden width and the vocabulary (`tensor`), experts over `expert`, and no FSDP:
every weight is replicated over `data` / `fsdp` (a decode step reads every weight, so gathering FSDP shards
each step would cost more than it saves). A weight dimension that does not divide its mesh axes is replicated
over them (GQA with fewer kv heads than the tensor axis: each kv head is kept whole, on every device), where
training would refuse it. Activations keep the training rules (rows over data / fsdp / expert), but for
`act_length`, which is unsharded (no sequence parallelism in decoding: the engine refuses a `sequence` axis).

KV pages (`[L * K, P, S, W]`, `Transformer.init_paged_cache`): dim 0 over `tensor` when K divides by it,
else replicated; replicated over every other axis (any row may read any page: prefix sharing and
copy-on-write forks cross rows). Today the model orders dim 0 layer-major (row i * K + k for layer i, head
k), so the split is by blocks of layers, and a page read crosses devices (GSPMD all-reduces the gathered
pages); with head-major rows (k * L + i) the same spec is a split by kv heads and reads stay local. MLA's
`latent` pages hold one row per token that every head reads: replicated (splitting its width would add an
all-reduce per layer). The routing record and the MTP drafter's carry are replicated; the MTP module's own
pages follow the K/V rule (one layer: dim 0 is its kv heads).

`Placement` is what `inference.steps.jitted` needs to give every step explicit in/out shardings; it is
hashable, so engines over the same model, mesh and sizes share compiled steps.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from model import sharding

WEIGHT_AXES_DROPPED = ("data", "fsdp", "sequence")  # weights are replicated over these for decoding


def inference_rules(rules: sharding.Rules) -> tuple:
    """The training rules with `data`/`fsdp`/`sequence` dropped from every weight's axes and `act_length`
    unsharded; every other activation rule is kept."""
    out = []
    for name, target in rules:
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        if name == "act_length":
            axes = ()
        elif not name.startswith("act_"):
            axes = tuple(a for a in axes if a not in WEIGHT_AXES_DROPPED)
        out.append((name, None if not axes else axes[0] if len(axes) == 1 else axes))
    return tuple(out)


def inference_config(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy of `cfg` whose `mesh.rules` are `inference_rules` (the model's activation constraints read
    them from its graph definition)."""
    out = ml_collections.ConfigDict(cfg).copy_and_resolve_references()
    out.mesh.rules = inference_rules(tuple(cfg.mesh.rules))
    return out


def check_mesh(mesh: Mesh) -> None:
    """The engine's mesh: the project's axes (`model.sharding.make_mesh`), no sequence parallelism."""
    if tuple(mesh.axis_names) != sharding.MESH_AXES:
        raise ValueError(
            f"Engine(mesh=...) has axes {tuple(mesh.axis_names)}; build it with model.sharding.make_mesh "
            f"(axes {sharding.MESH_AXES})."
        )
    if mesh.shape["sequence"] != 1:
        raise ValueError(
            f"Engine(mesh=...): sequence={mesh.shape['sequence']}, but decoding shards no sequence; put "
            "those devices on the data axis (mesh shape sequence=1)."
        )


def weight_shardings(abstract: nnx.State, mesh: Mesh, rules: sharding.Rules) -> nnx.State:
    """NamedShardings of every variable of `abstract` under `rules`, in the tree of the weights (each
    variable holding its sharding); a dimension that does not divide its mesh axes is replicated over them."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))

    def one(v):
        spec = sharding.mesh_spec(sharding.logical_axes_of(v), rules, mesh)
        shape = sharding.variable_value(v).shape
        fitted = PartitionSpec(*(_fit(dim, e, sizes) for dim, e in zip(shape, spec)))
        return v.replace(NamedSharding(mesh, fitted))

    return jax.tree.map(one, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _fit(dim: int, entry, sizes: dict):
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return entry if dim % math.prod(sizes[a] for a in axes) == 0 else None


def page_shardings(pages: dict, mesh: Mesh, kv_heads: int) -> dict:
    """Shardings of a cache dict (`k`/`v`, MLA `latent`, the routing record `experts`): see the module
    docstring."""
    heads_split = kv_heads % mesh.shape["tensor"] == 0 and mesh.shape["tensor"] > 1
    spec = lambda name: PartitionSpec("tensor") if name in ("k", "v") and heads_split else PartitionSpec()
    return {name: NamedSharding(mesh, spec(name)) for name in pages}


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def cache_zeros(shapes, mesh: Mesh | None, kv_heads: int | None):
    """Zero caches of `shapes` (a tree of ShapeDtypeStructs; a dict of page arrays when `kv_heads` is
    given, else replicated) created in place on `mesh`, with no full-size buffer on one device first.
    Without a mesh: on the default device, committed (jit caches executables per committed-ness, and the
    arrays steps return are committed)."""
    make = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    if mesh is None:
        made = make()
        return jax.device_put(made, jax.tree.map(lambda a: a.sharding, made))
    out = replicated(mesh) if kv_heads is None else page_shardings(shapes, mesh, kv_heads)
    return jax.jit(make, out_shardings=out)()


class Tree:
    """A pytree of shardings, hashable and comparable (a key of the jitted-step cache)."""

    def __init__(self, tree: Any):
        self.tree = tree
        leaves, self._treedef = jax.tree.flatten(tree)
        self._leaves = tuple(leaves)

    def __hash__(self) -> int:
        return hash((self._treedef, self._leaves))

    def __eq__(self, other) -> bool:
        return isinstance(other, Tree) and (self._treedef, self._leaves) == (other._treedef, other._leaves)


@dataclasses.dataclass(frozen=True)
class Placement:
    """The shardings of one engine's step arguments: weights, cache trees (None when the engine has no
    such cache), and `replicated` for the small per-row arrays and every output but caches."""

    mesh: Mesh
    params: Tree
    kv: Tree
    draft_params: Tree | None = None
    draft_kv: Tree | None = None
    mtp_kv: Tree | None = None

    @property
    def replicated(self) -> NamedSharding:
        return replicated(self.mesh)


def placement(mesh: Mesh, params, kv, draft_params=None, draft_kv=None, mtp_kv=None) -> Placement:
    """The `Placement` of an engine's placed arrays (None for a cache or drafter it does not have)."""
    tree = lambda x: None if x is None else Tree(jax.tree.map(lambda a: a.sharding, x))
    return Placement(mesh, tree(params), tree(kv), tree(draft_params), tree(draft_kv), tree(mtp_kv))
