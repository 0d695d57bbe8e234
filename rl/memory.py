"""Memory you can see: what each of this process's devices holds in live arrays, and the process's peak
resident memory.

Fake CPU devices share one process's memory, so a full copy where a shard belongs costs memory, not an
error: `device_bytes` counts, per local device, the bytes of every live device buffer on it (a replicated
array counts once on each device holding it; views sharing a buffer count once), which is what an
accelerator's HBM would hold. `trees`
(named trees of arrays: params, optimizer state, sampler weights, KV pages) are counted the same way, each
as its largest per-device figure, for the planner's prediction (`rl.plan.memory`) to be checked against.
"""

from __future__ import annotations

import resource
import sys
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any


def per_device(arrays: Iterable) -> Counter:
    """Bytes per local device of `arrays`, each device buffer counted once: an array passed twice, and the
    single-device views of another array's shards (`addressable_shards[i].data`, which Orbax's saves keep
    alive) share their buffers."""
    import jax

    out: Counter = Counter()
    seen = set()
    for x in arrays:
        if not isinstance(x, jax.Array) or x.is_deleted():
            continue
        for shard in x.addressable_shards:
            buffer = shard.data
            key = (shard.device, _address(buffer))
            if key not in seen:
                seen.add(key)
                out[shard.device] += buffer.nbytes
    return out


def _address(buffer) -> int:
    try:
        return buffer.unsafe_buffer_pointer()
    except Exception:  # noqa: BLE001 - a backend without raw pointers: count the buffer by its object
        return id(buffer)


def device_bytes() -> int:
    """The largest number of bytes any local device holds in live arrays (`jax.live_arrays`)."""
    import jax

    counts = per_device(jax.live_arrays())
    return max(counts.values(), default=0)


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def snapshot(trees: Mapping[str, Any]) -> dict[str, float]:
    """`memory/*` metrics of this process: `device_bytes` (every live array), each named tree's largest
    per-device bytes, and `peak_rss_bytes`."""
    import jax

    out = {"memory/device_bytes": float(device_bytes()), "memory/peak_rss_bytes": float(peak_rss_bytes())}
    for name, tree in trees.items():
        counts = per_device(jax.tree.leaves(tree))
        out[f"memory/{name}_bytes"] = float(max(counts.values(), default=0))
    return out
