"""JAX decoding engine: paged KV cache, continuous batching, speculative decoding (issue 4)."""
