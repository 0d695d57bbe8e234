"""The Mixture-of-Experts feed-forward block: `layer` (the `MoEBlock` module, its router and expert bias),
`dispatch` (routing tokens to experts on one device), `local` (each batch shard's own dispatch) and
`parallel` (the expert-parallel all-to-all under `jax.shard_map`). Importers name the submodule."""
