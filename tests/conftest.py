"""Strict JAX for every test: 8 fake CPU devices, rank promotion raises, a persistent compile cache, a quick
XLA:CPU backend (optimization level 0, fusion emitters off)."""

import os
import pathlib

# Before the first backend use: every sharding path runs on 8 fake CPU devices.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
# XLA:CPU compile time is ~2/3 of the suite's time (the programs run for milliseconds), most of it LLVM
# optimizing each fusion's code. At backend optimization level 0 a GRPO update of the test config compiles in
# 2.9 s instead of 5.6 s and runs 3x slower (17 ms instead of 6). The same XLA programs (HLO passes, fusion,
# no fast-math either way) are compiled; the main job, the benchmarks and the demo run at XLA's default level.
# Child processes (main jobs, hosts, workers) inherit this flag and the next through XLA_FLAGS.
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"


def _xla_knows(flag: str) -> bool:
    """Whether this jaxlib's XLA defines `flag` (XLA aborts the process on an unknown flag in XLA_FLAGS)."""
    import importlib.util
    import mmap

    spec = importlib.util.find_spec("jaxlib")
    for location in spec.submodule_search_locations if spec else ():
        for lib in pathlib.Path(location).glob("*.so"):
            if lib.stat().st_size == 0:
                continue
            with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if m.find(flag.encode() + b"\0") >= 0:
                    return True
    return False


# XLA:CPU's MLIR fusion emitters took 18% of a cold main job's CPU time (perf). Off, XLA:CPU emits its
# fusions with the elemental IR emitter, its older, still supported code path (a few fusion choices, around
# scatters, differ). Measured on 2 cores, cold caches: tests/rl/test_train_step.py plus test_train_end_to_end
# 88 -> 58 s, the whole suite 1198 -> 832-929 s (3 runs). Results may differ in the last bit (other order); a
# test that depends on the last bit is wrong either way. The main job, benchmarks and demo keep the emitters.
if "xla_cpu_use_fusion_emitters" not in _flags and _xla_knows("xla_cpu_use_fusion_emitters"):
    _flags += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = _flags.strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from absl import flags  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
_cache = pathlib.Path(os.environ.get("JAX_TEST_CACHE", pathlib.Path(__file__).parent.parent / ".jax_cache"))
jax.config.update("jax_compilation_cache_dir", str(_cache))
# Child processes (main jobs, hosts) read the threshold from the environment (JAX's default is 1 s).
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.1"
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# Modules that define absl flags (CLIs) can be imported and used without parsing argv.
if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


# Every XLA:CPU executable maps its code and buffers (~3,000 mappings per main-job run on 8 fake devices), and
# JAX's in-memory caches keep the executables of every test alive. A worker ~20 main-job tests old reached
# vm.max_map_count (65,530); the next compile's mmap failed and XLA segfaulted or aborted (in the compiler or
# in executable.serialize()). Past a threshold, drop the in-memory caches: the executables that nothing else
# holds are freed and unmapped, and the persistent cache gives them back cheaply if needed. After a test
# module past MODULE_MAPPINGS; after a test only past TEST_MAPPINGS, near the limit (a module's fixtures may
# hold a warmed-up engine that counts its compiles, and a cleared cache makes it compile again).
MODULE_MAPPINGS, TEST_MAPPINGS = 15_000, 45_000


def _mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no such limit to keep under
        return 0


def _drop_caches_past(limit: int) -> None:
    if _mappings() > limit:
        import gc

        gc.collect()
        jax.clear_caches()
        gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _bounded_mappings_per_module():
    yield
    _drop_caches_past(MODULE_MAPPINGS)


@pytest.fixture(autouse=True)
def _bounded_mappings_per_test():
    yield
    _drop_caches_past(TEST_MAPPINGS)


def pytest_terminal_summary(terminalreporter):
    """Tests that did not run, in a banner of their own: a skip hides a path CI never exercised (e.g. the
    bubblewrap sandbox where Debian's `bubblewrap` is missing; `.ci/run` installs it)."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    terminalreporter.write_sep("!", f"{len(skipped)} TEST(S) DID NOT RUN", red=True, bold=True)
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        terminalreporter.write_line(f"  {report.nodeid}: {reason}", red=True)
