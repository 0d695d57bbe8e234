"""python -m benchmarks hf_load

Loading a Hugging Face checkpoint: wall time and peak host memory (RSS) of `model.io.hf.load` for a random
~1B-parameter Qwen3-style dense checkpoint in bf16 (written here with safetensors' numpy API, in 1 GiB
shards), each measured in a fresh process. Beside it, the same checkpoint loaded by
`transformers.AutoModelForCausalLM.from_pretrained` (torch, CPU) when transformers is installed. One
JSON line per loader, then a summary; target: our peak RSS <= 1.3x the checkpoint size.

RSS figures: `peak` is the process's maximum RSS; `before` is the RSS after imports, before loading;
`net = peak - before` is what loading added.

    python -m benchmarks hf_load --layers=4          # a smaller (~330M) checkpoint
    python -m benchmarks hf_load --dir=/tmp/ckpt     # reuse a checkpoint written before
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from benchmarks.record import emit

GIB = 2**30


def write_checkpoint(directory: pathlib.Path, layers: int) -> int:
    """A random Qwen3 dense checkpoint (hidden 2048, 16/8 heads of 128, MLP 6144, vocab 32768); bytes."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    d, n, k, h, f, v = 2048, 16, 8, 128, 6144, 32768
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": v,
        "hidden_size": d,
        "num_hidden_layers": layers,
        "num_attention_heads": n,
        "num_key_value_heads": k,
        "head_dim": h,
        "intermediate_size": f,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "max_position_embeddings": 4096,
    }
    shapes = {"model.embed_tokens.weight": (v, d), "lm_head.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (n * h, d),
                p + "self_attn.k_proj.weight": (k * h, d),
                p + "self_attn.v_proj.weight": (k * h, d),
                p + "self_attn.o_proj.weight": (d, n * h),
                p + "self_attn.q_norm.weight": (h,),
                p + "self_attn.k_norm.weight": (h,),
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
                p + "mlp.gate_proj.weight": (f, d),
                p + "mlp.up_proj.weight": (f, d),
                p + "mlp.down_proj.weight": (d, f),
            }
        )
    rng = np.random.default_rng(0)
    shards, current, size, total = [], {}, 0, 0
    names = sorted(shapes)
    for name in names:
        t = (rng.standard_normal(shapes[name], np.float32) * 0.02).astype(ml_dtypes.bfloat16)
        if current and size + t.nbytes > GIB:
            shards.append(current)
            save_file(current, str(directory / f"part{len(shards)}.safetensors"))
            current, size = {}, 0
        current[name] = t
        size += t.nbytes
        total += t.nbytes
    shards.append(current)
    save_file(current, str(directory / f"part{len(shards)}.safetensors"))
    count = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        final = f"model-{i:05d}-of-{count:05d}.safetensors"
        (directory / f"part{i}.safetensors").rename(directory / final)
        weight_map.update(dict.fromkeys(shard, final))
        shard.clear()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text(json.dumps(config))
    return total


_CHILD = r"""
import json, resource, sys, time
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))
loader, path = sys.argv[1], sys.argv[2]
if loader == "ours":
    import jax
    from model.io import hf
    jax.numpy.zeros(1).block_until_ready()
else:
    import torch, transformers
before = rss()
start = time.perf_counter()
if loader == "ours":
    cfg, params = hf.load(path)
    jax.block_until_ready(jax.tree.leaves(params))
    count = sum(x.size for x in jax.tree.leaves(params))
else:
    net = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    count = sum(p.numel() for p in net.parameters())
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"before": before, "peak": peak, "seconds": seconds, "params": int(count)}))
"""


def measure(loader: str, path: pathlib.Path, ckpt_bytes: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, loader, str(path)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if out.returncode:
        return {"bench": "hf_load", "loader": loader, "error": out.stderr.strip().splitlines()[-1:]}
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {
        "bench": "hf_load",
        "loader": "model.io.hf.load" if loader == "ours" else "transformers.from_pretrained",
        "checkpoint_gib": round(ckpt_bytes / GIB, 3),
        "params_m": round(r["params"] / 1e6, 1),
        "load_s": round(r["seconds"], 2),
        "rss_before_gib": round(r["before"] / GIB, 3),
        "rss_peak_gib": round(r["peak"] / GIB, 3),
        "peak_over_checkpoint": round(r["peak"] / ckpt_bytes, 3),
        "net_over_checkpoint": round((r["peak"] - r["before"]) / ckpt_bytes, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16, help="16 layers: ~0.94B parameters, 1.75 GiB in bf16")
    ap.add_argument("--dir", default=None, help="checkpoint directory (written if it has no config.json)")
    ap.add_argument("--skip_transformers", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(a.dir or tmp)
        path.mkdir(parents=True, exist_ok=True)
        if not (path / "config.json").exists():
            write_checkpoint(path, a.layers)
        ckpt_bytes = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        rows = [measure("ours", path, ckpt_bytes)]
        emit(rows[-1])
        if not a.skip_transformers:
            try:
                import transformers  # noqa: F401

                rows.append(measure("transformers", path, ckpt_bytes))
                emit(rows[-1])
            except ImportError:
                pass
    ours = rows[0]
    summary = {
        "bench": "hf_load_summary",
        "peak_over_checkpoint": ours.get("peak_over_checkpoint"),
        "target": 1.3,
        "met": ours.get("peak_over_checkpoint", 99) <= 1.3,
    }
    if len(rows) > 1 and "load_s" in rows[1] and "load_s" in ours:
        summary["load_time_ratio_ours_vs_transformers"] = round(ours["load_s"] / rows[1]["load_s"], 3)
    emit(summary)


if __name__ == "__main__":
    main()
