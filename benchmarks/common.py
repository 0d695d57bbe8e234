"""What the decoding and GRPO-step benchmarks share: the peers' model shapes and the speculative pair, a
Qwen3-like model config, engines that remember themselves for the recompile count, timed `generate` calls,
the Markov chain the speculative pairs learn, the peers' subprocess commands, and the `--sections` check.

    cfg = model_config(**PEER_DIMS, **PEER_MOE)
    engines = Engines(); eng = engines.make("plain", cfg, params, **peer_engine_kwargs())
    out, seconds, delta = best_run(eng, prompts, SamplingParams(max_new_tokens=64), repeats=2)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

import model
from benchmarks.train_step import make_train_step
from configs import base
from inference.engine import Engine, EngineConfig
from inference.sampling import SamplingParams
from rl import batch as batch_lib
from rl import losses

# Peer dims (the peers' README figures use them): 4 layers, d_model 256, 4/2 heads of 64, vocab 8192.
PEER_DIMS = dict(layers=4, d_model=256, heads=4, kv_heads=2, head_dim=64, ffn=1024, vocab=8192)
PEER_MOE = dict(experts=8, top_k=2, expert_ffn=256)
# Speculative pair: the target's forward dominates, the drafter costs < 1/8 of it per token.
TARGET_DIMS = dict(layers=8, d_model=512, heads=8, kv_heads=4, head_dim=64, ffn=1024, vocab=1024)
DRAFT_DIMS = dict(layers=2, d_model=128, heads=4, kv_heads=2, head_dim=32, ffn=256, vocab=1024)
BRANCH_PROBS = (0.6, 0.25, 0.1, 0.05)  # successor probabilities of every state of the Markov chain


def pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def model_config(
    layers, d_model, heads, kv_heads, head_dim, ffn, vocab, experts=0, top_k=2, expert_ffn=256
) -> ml_collections.ConfigDict:
    """A Qwen3-like config (qk-norm, rope theta 1e6, untied) with unrolled layers (faster on CPU)."""
    cfg = base.get_config()
    m = cfg.model
    m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.head_dim = (
        layers,
        d_model,
        heads,
        kv_heads,
        head_dim,
    )
    m.d_ff, m.vocab_size, m.qk_norm, m.scan_layers = ffn, vocab, True, False
    m.rope.theta = 1_000_000.0
    m.moe.num_experts, m.moe.top_k, m.moe.d_ff = experts, top_k, expert_ffn
    return cfg


def random_prompts(rng: np.random.Generator, num: int, length: int, vocab: int) -> list[list[int]]:
    return rng.integers(3, vocab, (num, length)).tolist()


class Engines:
    """Builds, warms and remembers every engine, for the recompile count."""

    def __init__(self):
        self.all: dict[str, Engine] = {}

    def make(self, name: str, cfg, params, draft=None, **engine_kwargs) -> Engine:
        eng = Engine(cfg, params, EngineConfig(**engine_kwargs), draft=draft)
        t0 = time.perf_counter()
        eng.warmup()
        print(f"# engine {name}: warmup {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        self.all[name] = eng
        return eng

    def recompiles(self) -> dict:
        per = {name: eng.stats()["compiles_after_warmup"] for name, eng in self.all.items()}
        return {"bench": "decode_recompiles", "compiles_after_warmup": per, "total": sum(per.values())}


def run(eng: Engine, prompts, sampling) -> tuple[list, float, dict]:
    """generate() wall time and the change in the engine's counters."""
    before = eng.stats()
    t0 = time.perf_counter()
    out = eng.generate(prompts, sampling)
    seconds = time.perf_counter() - t0
    after = eng.stats()
    delta = {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, int) or k.endswith("_s")}
    return out, seconds, delta


def best_run(eng: Engine, prompts, sampling, repeats: int) -> tuple[list, float, dict]:
    """The fastest of `repeats` identical calls (same seeds, so the same outputs)."""
    runs = [run(eng, prompts, sampling) for _ in range(repeats)]
    return min(runs, key=lambda r: r[1])


class MarkovChain:
    """A sparse order-1 Markov chain over `alphabet` random token ids: every state has len(BRANCH_PROBS)
    random successors with those probabilities."""

    def __init__(self, vocab: int, alphabet: int, seed: int):
        rng = np.random.default_rng(seed)
        self.ids = rng.choice(np.arange(3, vocab), alphabet, replace=False)
        # The most likely successors form cycles of 8 states: greedy walks repeat with period 8 >= k.
        perm = rng.permutation(alphabet)
        top = np.empty(alphabet, int)
        for c in range(0, alphabet, 8):
            cycle = perm[c : c + 8]
            top[cycle] = np.roll(cycle, -1)
        others = [
            rng.choice(np.delete(np.arange(alphabet), top[s]), len(BRANCH_PROBS) - 1, replace=False)
            for s in range(alphabet)
        ]
        self.succ = np.concatenate([top[:, None], np.stack(others)], axis=1)
        self.cum = np.cumsum(BRANCH_PROBS)
        self.entropy = float(-np.sum(np.asarray(BRANCH_PROBS) * np.log(BRANCH_PROBS)))  # nats per token

    def sample(self, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
        state = rng.integers(0, len(self.ids), batch)
        out = np.empty((batch, length), np.int32)
        for t in range(length):
            out[:, t] = self.ids[state]
            branch = np.minimum((rng.random(batch)[:, None] > self.cum[None]).sum(1), len(self.cum) - 1)
            state = self.succ[state, branch]
        return out

    def greedy_walk(self, start: int, length: int) -> list[int]:
        state, out = start, []
        for _ in range(length):
            out.append(int(self.ids[state]))
            state = self.succ[state, 0]
        return out


def train(cfg, chain: MarkovChain, steps: int, batch: int, seq_len: int, lr: float, seed: int):
    """AdamW on next-token loss over chain samples; returns (graphdef, params, mean loss of the last 10%)."""
    graphdef, params, rest = nnx.split(model.build(cfg, seed=seed), nnx.Param, ...)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(steps // 10, 1), steps, lr / 10)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))
    state = (params, optimizer.init(params), rest)
    step = make_train_step(graphdef, optimizer)
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        state, loss = step(state, jnp.asarray(chain.sample(rng, batch, seq_len)))
        losses.append(loss)
    tail = jax.device_get(losses[-max(steps // 10, 1) :])
    return graphdef, state[0], float(np.mean(tail))


def peer_command(python: str, script: str, arch: str, repeats: int) -> list[str]:
    """The peer script's command line on the anchor shapes (both peers take the same flags)."""
    d, moe = PEER_DIMS, arch == "qwen3moe"
    cmd = [python, script, "--arch", arch, "--layers", str(d["layers"]), "--d-model", str(d["d_model"])]
    cmd += ["--heads", str(d["heads"]), "--kv-heads", str(d["kv_heads"]), "--head-dim", str(d["head_dim"])]
    cmd += ["--vocab", str(d["vocab"]), "--batches", "16", "--prompt-len", "32", "--new-tokens", "64"]
    cmd += ["--temperature", "1.0", "--repeats", str(repeats)]
    if moe:
        cmd += ["--ffn", str(PEER_MOE["expert_ffn"]), "--experts", str(PEER_MOE["experts"])]
        return cmd + ["--top-k", str(PEER_MOE["top_k"])]
    return cmd + ["--ffn", str(d["ffn"])]


def run_peer(name: str, python: str, script: str, arch: str, repeats: int) -> dict:
    """{name_tok_s, name_call_s, name_versions} from the peer's JSON line, or name_error."""
    proc = subprocess.run(
        peer_command(python, script, arch, repeats), capture_output=True, text=True, timeout=900
    )
    if proc.returncode:
        return {f"{name}_error": proc.stderr.strip().splitlines()[-1:]}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    run16 = out["runs"]["b16"]
    return {
        f"{name}_tok_s": run16["tok_per_s"],
        f"{name}_call_s": run16["call_s_all"],
        f"{name}_versions": out["versions"],
    }


def peer_engine_kwargs() -> dict:
    return dict(max_batch=16, max_seq_len=320, page_size=16, prefill_chunk=64, prefill_batch=4, min_bucket=16)


def check_peers(p: argparse.ArgumentParser, peers: dict[str, str], args) -> list[str]:
    """The peers given whole: `peers` maps an interpreter flag to its script flag (dests without "--"). A peer
    needs both, and neither has a default (the peers' venvs and scripts are not part of this repository):
    one without the other, or a script that does not exist, is an argparse error naming the flag."""
    given = []
    for python_flag, script_flag in peers.items():
        python, script = getattr(args, python_flag), getattr(args, script_flag)
        if bool(python) != bool(script):
            have, missing = (python_flag, script_flag) if python else (script_flag, python_flag)
            p.error(
                f"--{have} needs --{missing}=PATH too (no default: the peers live outside this repository)"
            )
        if script and not os.path.isfile(script):
            p.error(f"--{script_flag}={script}: no such file")
        if python:
            given.append(python_flag)
    return given


def plain_vs_speculative(plain: Engine, spec: Engine, prompts, new_tokens: int, repeats: int, side: str):
    """At T=1 and greedy: the fastest of `repeats` calls of each engine on `prompts`. Per name ("t1",
    "greedy"): (plain outputs, speculative outputs, figures), the speculative side's keys named `side`."""
    out = {}
    for name, temperature in (("t1", 1.0), ("greedy", 0.0)):
        sp = SamplingParams(temperature=temperature, max_new_tokens=new_tokens, seed=5)
        out_p, sec_p, _ = best_run(plain, prompts, sp, repeats)
        out_s, sec_s, d = best_run(spec, prompts, sp, repeats)
        figures = {
            "acceptance_rate": round(d["accepted_tokens"] / max(d["proposed_tokens"], 1), 4),
            "tokens_per_target_forward": round(d["generated_tokens"] / d["target_row_forwards"], 3),
            "plain_s": round(sec_p, 3),
            f"{side}_s": round(sec_s, 3),
            "plain_tok_s": round(d["generated_tokens"] / sec_p, 1),
            f"{side}_tok_s": round(d["generated_tokens"] / sec_s, 1),
            "speedup": round(sec_p / sec_s, 2),
        }
        out[name] = (out_p, out_s, figures)
    return out


def greedy_identical(plain_outputs, other_outputs) -> str:
    """ "same/total": completions with the same tokens on both sides."""
    same = sum(x.tokens == y.tokens for x, y in zip(plain_outputs, other_outputs))
    return f"{same}/{len(plain_outputs)}"


def job_batch(cfg, samples, routing: bool = False):
    """The main job's train batch of `samples` (rl.train's `make_batch` arguments: rows and length from the
    config, the logit window); (batch, stats)."""
    return batch_lib.make_batch(
        samples,
        adv_std=cfg.rl.advantage_std,
        length_bucket=cfg.seq_len,
        max_len=cfg.seq_len,
        rows=cfg.batch_size,
        routing=routing,
        window=losses.logit_window(cfg, cfg.seq_len),
    )


def chosen_sections(p: argparse.ArgumentParser, value: str, sections: tuple[str, ...]) -> list[str]:
    """The comma-separated `--sections` value as a list; an unknown name is an argparse error."""
    chosen = [s for s in value.split(",") if s]
    unknown = sorted(set(chosen) - set(sections))
    if unknown:
        p.error(f"unknown --sections {unknown}; choose from {sections}")
    return chosen
