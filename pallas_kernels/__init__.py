"""Attention kernels (flash, chunked, ring, paged decode), each beside a pure-jnp reference."""
