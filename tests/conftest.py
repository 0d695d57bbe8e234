"""Strict JAX for every test: 8 fake CPU devices, rank promotion raises, a persistent compile cache."""

import os
import pathlib

# Before the first backend use: every sharding path runs on 8 fake CPU devices.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
from absl import flags  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
_cache = pathlib.Path(os.environ.get("JAX_TEST_CACHE", pathlib.Path(__file__).parent.parent / ".jax_cache"))
jax.config.update("jax_compilation_cache_dir", str(_cache))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# Modules that define absl flags (CLIs) can be imported and used without parsing argv.
if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
