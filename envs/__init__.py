"""Environments stepped in separate JAX-free worker processes (issue 5)."""
