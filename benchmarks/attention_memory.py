"""python -m benchmarks attention_memory

Attention memory from XLA's compiled buffer assignment (`compiled.memory_analysis()`), nothing run:
the temp bytes of jit(value_and_grad) of one attention call, B=1, N=8 query heads, K=4 kv heads, H=64,
causal, f32. One JSON line per measurement, then one summary line with the growth ratios and targets:

  kind=impl   `reference`, `chunked` at T = 4k, 16k, 64k; `flash` (Pallas, interpret mode on CPU)
              at 4k and 16k. Target: chunked grows <= 4.5x when T grows 4x (the reference ~16x).
  kind=ring   ring attention (chunked blocks) in shard_map over 1, 2, 4, 8 fake CPU devices at fixed
              T; per-device temp + argument bytes. Target: falls near-linearly with devices.
  kind=model  the tiny config (`configs/tiny.py`, attention_impl=chunked) forward+backward of the
              next-token loss at T = 128k, B = 1: temp + argument bytes. Target: <= 8 GiB.
              `--run_model` also runs it once and reports the process's peak RSS (minutes on 2 cores).

    python -m benchmarks attention_memory --lengths=4096,16384 --ring_len=16384 --skip_model
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks.record import emit  # noqa: E402

GIB = 2**30
B, N, K, H = 1, 8, 4, 64


def _impl(name: str):
    if name == "reference":
        from pallas_kernels.reference import attention_reference as fn
    elif name == "chunked":
        from pallas_kernels.chunked_attention import chunked_attention as fn
    else:
        from pallas_kernels.flash_attention import flash_attention as fn
    return fn


def _shapes(t: int, b: int = B):
    f32 = jnp.float32
    return (
        jax.ShapeDtypeStruct((b, t, N, H), f32),
        jax.ShapeDtypeStruct((b, t, K, H), f32),
        jax.ShapeDtypeStruct((b, t, K, H), f32),
    )


def _grad_fn(attn):
    def loss(q, k, v):
        return jnp.sum(attn(q, k, v).astype(jnp.float32) ** 2)

    return jax.value_and_grad(loss, argnums=(0, 1, 2))


def impl_memory(name: str, t: int) -> dict:
    fn = _impl(name)
    start = time.perf_counter()
    from pallas_kernels.mask import Mask

    compiled = jax.jit(_grad_fn(lambda q, k, v: fn(q, k, v, Mask(causal=True)))).lower(*_shapes(t)).compile()
    mem = compiled.memory_analysis()
    return {
        "kind": "impl",
        "impl": name,
        "seq_len": t,
        "temp_bytes": int(mem.temp_size_in_bytes),
        "temp_gib": round(mem.temp_size_in_bytes / GIB, 4),
        "compile_s": round(time.perf_counter() - start, 1),
    }


def ring_memory(num_devices: int, t: int) -> dict:
    from pallas_kernels import ring_attention
    from pallas_kernels.mask import Mask

    mesh = Mesh(np.asarray(jax.devices()[:num_devices]), ("sequence",), axis_types=(AxisType.Auto,))
    spec = P(None, "sequence", None, None)

    def local(q, k, v):
        return ring_attention.ring_attention(q, k, v, Mask(causal=True), block_impl="chunked")

    ring = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    shardings = jax.sharding.NamedSharding(mesh, spec)
    args = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings) for s in _shapes(t)]
    compiled = jax.jit(_grad_fn(ring)).lower(*args).compile()
    mem = compiled.memory_analysis()
    per_device = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
    return {
        "kind": "ring",
        "devices": num_devices,
        "seq_len": t,
        "temp_bytes": int(mem.temp_size_in_bytes),
        "per_device_bytes": int(per_device),
        "per_device_gib": round(per_device / GIB, 4),
    }


def model_memory(t: int, run: bool) -> dict:
    from flax import nnx

    import model
    from configs import tiny

    cfg = tiny.get_config()
    cfg.model.attention_impl = "chunked"
    net = model.build(cfg)
    graphdef, params, rest = nnx.split(net, nnx.Param, ...)

    def loss(params, tokens_BT):
        logits_BTV, aux = nnx.merge(graphdef, params, rest)(tokens_BT)
        return model.next_token_loss(logits_BTV, tokens_BT) + aux["moe_loss"]

    step = jax.jit(jax.value_and_grad(loss))
    tokens = jax.random.randint(jax.random.key(0), (1, t), 0, cfg.model.vocab_size, jnp.int32)
    compiled = step.lower(params, tokens).compile()
    mem = compiled.memory_analysis()
    total = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
    out = {
        "kind": "model",
        "config": "tiny",
        "attention_impl": "chunked",
        "seq_len": t,
        "compiled_bytes": int(total),
        "compiled_gib": round(total / GIB, 3),
        "target_gib": 8,
        "fits": bool(total <= 8 * GIB),
    }
    if run:
        start = time.perf_counter()
        loss_value, _ = compiled(params, tokens)
        loss_value.block_until_ready()
        out["run_s"] = round(time.perf_counter() - start, 1)
        out["loss"] = float(loss_value)
        out["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="4096,16384,65536")
    ap.add_argument("--flash_max_len", type=int, default=16384, help="interpret mode compiles slowly")
    ap.add_argument("--ring_len", type=int, default=65536)
    ap.add_argument("--ring_devices", default="1,2,4,8")
    ap.add_argument("--model_len", type=int, default=131072)
    ap.add_argument("--skip_model", action="store_true")
    ap.add_argument("--run_model", action="store_true")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]

    temp: dict[str, dict[int, int]] = {}
    for name in ("reference", "chunked", "flash"):
        for t in lengths:
            if name == "flash" and t > a.flash_max_len:
                continue
            row = impl_memory(name, t)
            temp.setdefault(name, {})[t] = row["temp_bytes"]
            emit(row)

    ring = {}
    for d in (int(x) for x in a.ring_devices.split(",")):
        row = ring_memory(d, a.ring_len)
        ring[d] = row["per_device_bytes"]
        emit(row)

    summary: dict = {"kind": "summary", "growth_per_4x_length": {}}
    for name, by_t in temp.items():
        ts = sorted(by_t)
        summary["growth_per_4x_length"][name] = [
            round(by_t[t2] / max(by_t[t1], 1), 2) for t1, t2 in zip(ts, ts[1:]) if t2 == 4 * t1
        ]
    growth = summary["growth_per_4x_length"].get("chunked", [])
    summary["chunked_target_4_5x_met"] = bool(growth) and max(growth) <= 4.5
    if ring:
        base = ring[min(ring)]
        summary["ring_per_device_vs_1"] = {d: round(v / base, 3) for d, v in sorted(ring.items())}
    if not a.skip_model:
        row = model_memory(a.model_len, a.run_model)
        emit(row)
        summary["model_128k_fits_8gib"] = row["fits"]
    emit(summary)


if __name__ == "__main__":
    main()
