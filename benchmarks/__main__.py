"""python -m benchmarks NAME [flags]

Runs benchmark NAME (the module benchmarks/NAME.py) with its own flags (`python -m benchmarks NAME --help`
lists them); with no NAME, lists the benchmarks, one line each. Run it from the repository root.
"""

from __future__ import annotations

import runpy
import sys

# Every benchmark, with what it measures. The helper modules (record, hosts, common, timing) are not
# benchmarks.
BENCHMARKS = {
    "attention_memory": "attention's compiled temp memory by impl and sequence length (XLA, nothing run)",
    "attention_speed": "forward+backward time of the model's attention impls by sequence length",
    "curriculum": "how the curriculum's weights moved in a run (--workdir), or its failure odds (--derive)",
    "decode": "decoding engine: cache, continuous batching, prefill sharing, speculative decoding, peers",
    "decode_floor": "the weight-matmul floor of one decode step on the peer shapes",
    "demo_recipe": "the `make demo` recipe as a fast stand-alone loop, for choosing it",
    "env_throughput": "environment layer: sandbox start, pool overhead, episodes/s, mixed load",
    "grpo_ab": "A/B checks behind the GRPO step's logit window and warm-up thread",
    "grpo_job": "the GRPO main job: async vs sync steps/s, train-step MFU, PPO clipping, drafters",
    "grpo_step": "seconds per GRPO step of the main job on the Tunix peer's shapes, beside Tunix",
    "hf_load": "wall time and peak host memory of loading a ~1B Hugging Face checkpoint",
    "init_compile": "compile time of the main job's sharded parameter init",
    "learning": "does the adaptive curriculum pay: held-out accuracy per (arm, seed) against compute",
    "matmul_peak": "the best f32 GFLOP/s of one jitted square matmul (the MFU yardstick)",
    "memory_layouts": "per-device live bytes of the main job, measured and planned, per sampler layout",
    "metrics_diff": "whether two runs of the main job computed the same numbers (metrics, evaluations)",
    "moe_decode": "MoE at decode-size token counts: the gather path against the dispatch path",
    "mtp_draft": "the model's own MTP head as the speculative drafter",
    "peer_table": "the README's speed-beside-the-peers table, built from the committed results",
    "plan_pod": "the planner's largest model per pod layout (TPU v5p slices, one H100 node)",
    "profile_ops": "a jax.profiler trace summarised as XLA op thread time by kind",
    "restart_compile": "what the persistent compilation cache saves a second run of the main job",
    "routing_replay": "routing replay's train-inference mismatch, paired on the same batches",
    "rss_slope": "how a process's host memory grows with the model (two main-job processes)",
    "sandbox_memory": "how far past its memory limit a sandboxed run gets on a busy machine",
    "serve": "the OpenAI server's latency and throughput over a config's random weights",
    "small_dots": "XLA:CPU's two dot kernels at decode-size row counts",
    "train_step": "training-step throughput and MFU on the default device (`make bench`)",
    "weight_sync": "weight-sync seconds and bytes per step from the trainer to the engine",
}


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    lines = [__doc__.splitlines()[0], ""]
    lines += [f"  {name:<{width}}  {what}" for name, what in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, flags = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}: python -m benchmarks lists them", file=sys.stderr)
        return 2
    # The benchmark runs as __main__ with its own flags; its usage line names the runner's command.
    sys.argv = [f"python -m benchmarks {name}", *flags]
    runpy.run_module(f"benchmarks.{name}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
