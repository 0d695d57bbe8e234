"""Attention kernels (flash, ring, paged decode), each beside a pure-jnp reference (issue 3)."""
