"""Multi-token prediction (DeepSeek-V3): D extra modules, module k predicting token i + k + 1 at position i.

Dimension key: B batch, T tokens, D model width, V vocab.

Module k takes the previous depth's hidden state h_i (the main model's last hidden state, before its final
norm, for k = 1) and the embedding of token i + k, and runs

    x_i = eh_proj([enorm(embed(t_{i+k})); hnorm(h_i)])      eh_proj: [2D, D]
    h'_i = Block(x_i)                                        one decoder layer (attention and MLP / MoE)
    logits_i = unembed(norm(h'_i))                           `norm` is HF's shared_head.norm

The embedding and the output matrix are the main model's (DeepSeek-V3's checkpoints store copies in each MTP
layer; `model.io.hf` reads and writes them as such). In HF checkpoints module k is decoder layer
num_hidden_layers + k - 1 (`num_nextn_predict_layers` of them): enorm, hnorm, eh_proj, the usual layer
tensors, shared_head.norm / shared_head.head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from model import layers
from model.logprobs import masked_nll


class MTPModule(nnx.Module):
    def __init__(self, cfg: ml_collections.ConfigDict, block, *, rngs: nnx.Rngs):
        m = cfg.model
        d = m.d_model
        self.enorm = layers.RMSNorm(d, eps=m.norm_eps, dtype=m.param_dtype)
        self.hnorm = layers.RMSNorm(d, eps=m.norm_eps, dtype=m.param_dtype)
        self.eh_proj = layers.param(
            rngs, (2 * d, d), (None, "embed"), std=(2 * d) ** -0.5, dtype=m.param_dtype
        )
        self.block = block
        self.norm = layers.RMSNorm(d, eps=m.norm_eps, dtype=m.param_dtype)

    def __call__(self, h_BTD, emb_BTD, positions_BT, segment_ids_BT=None, cache=None):
        """(h'_BTD, the block's aux, cache): the module's hidden state at each position."""
        x_BTD = jnp.concatenate([self.enorm(emb_BTD), self.hnorm(h_BTD).astype(emb_BTD.dtype)], axis=-1)
        x_BTD = layers.matmul_rows(x_BTD, self.eh_proj[...].astype(x_BTD.dtype))
        return self.block(x_BTD, positions_BT, segment_ids_BT, cache, None)


def mtp_loss(logits_DBTV: jax.Array, tokens_BT: jax.Array, mask_BT: jax.Array | None = None) -> jax.Array:
    """Mean over depths of the cross-entropy of module k's prediction of token i + k + 1 at position i,
    counted where that token exists (and mask[:, i + k + 1])."""
    depths = logits_DBTV.shape[0]
    losses = [masked_nll(logits_DBTV[k - 1], tokens_BT, mask_BT, k=k + 1) for k in range(1, depths + 1)]
    return jnp.mean(jnp.stack(losses))
