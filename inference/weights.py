"""Where an engine keeps a model's weights: the model graph it builds (`graph_config`) and the shardings of
its weight state on a mesh (`weight_shardings`), which `Engine(..., placed=True)`, `update_params(...,
placed=True)`, `inference.serve.load` and the trainer's weight push place into."""

from __future__ import annotations

import jax
import ml_collections

from configs.engine import EngineConfig
from inference import layout
from inference.drafters import split_weights


def graph_config(cfg, engine_cfg: EngineConfig, mesh: jax.sharding.Mesh | None):
    """The config an engine builds a model graph from: with a mesh, the inference rules; an MoE model's
    `moe.every_expert_max_tokens` -1 becomes the decode and speculative steps' token count, max_batch x
    (num_draft + 1): calls of up to that many tokens run every expert (longer prefill and scoring calls
    dispatch)."""
    out = cfg if mesh is None else layout.inference_config(cfg)
    if out.model.moe.num_experts and out.model.moe.get("every_expert_max_tokens", -1) == -1:
        out = ml_collections.ConfigDict(out).copy_and_resolve_references()
        out.model.moe.every_expert_max_tokens = engine_cfg.max_batch * (engine_cfg.num_draft + 1)
    return out


def weight_shardings(cfg, engine_cfg: EngineConfig, mesh: jax.sharding.Mesh):
    """Where an engine on `mesh` keeps the weights of the model `cfg` (its target's, or a draft model's):
    the state `Engine(..., placed=True)` and `update_params(..., placed=True)` take as it is."""
    _, abstract = split_weights(graph_config(cfg, engine_cfg, mesh))
    return layout.weight_shardings(abstract, mesh, layout.inference_rules(tuple(cfg.mesh.rules)))
