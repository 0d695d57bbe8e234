"""python -m benchmarks attention_speed

Jitted forward+backward time of the model's attention impls on the default device, causal, f32,
B * T = 4096 tokens, 8 query / 4 kv heads, H = 64 (the small config's geometry). One JSON line per
length with the best of --repeats milliseconds per impl and each impl's speed-up over `reference`.

    python -m benchmarks attention_speed --lengths=512,2048 --impls=reference,chunked
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.record import emit
from benchmarks.timing import call_seconds
from model import attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="256,512,1024,2048")
    ap.add_argument("--impls", default="reference,query_blocked,chunked")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    for t in (int(x) for x in a.lengths.split(",")):
        b = max(1, 4096 // t)
        keys = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(keys[0], (b, t, 8, 64))
        k = jax.random.normal(keys[1], (b, t, 4, 64))
        v = jax.random.normal(keys[2], (b, t, 4, 64))
        row: dict = {"bench": "attention_speed", "seq_len": t, "batch": b, "ms": {}}
        for impl in a.impls.split(","):
            fn = attention.ATTENTION_IMPLS[impl]

            def loss(q, k, v, fn=fn):
                return jnp.sum(fn(q, k, v, causal=True) ** 2)

            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
            row["ms"][impl] = round(1000 * min(call_seconds(step, q, k, v, calls=a.repeats)), 1)
        if "reference" in row["ms"]:
            row["speedup_vs_reference"] = {
                name: round(row["ms"]["reference"] / ms, 2) for name, ms in row["ms"].items()
            }
        emit(row)


if __name__ == "__main__":
    main()
