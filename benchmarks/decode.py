"""python -m benchmarks decode

Decoding-engine figures (`inference.Engine`) on the default device, each a ratio of two runs made in this
process (absolute times drift on a shared CPU). One JSON line per section, then one `decode_summary` line
with every headline figure, its target and whether it was met:

- cache: engine tok/s vs a no-cache decode (a plain jitted `model(tokens_BT)` over the whole sequence every
  step, lengths bucketed to multiples of --bucket, compiles excluded), batch 16, T=1.
- continuous: wall-clock of 64 requests with heavy-tailed max_new_tokens (truncated Pareto, 8..256) under
  scheduler="static" / "continuous", max_batch 16; also whether both produced the same tokens.
- prefill: prefill tokens of one prompt sampled n=8 vs the prompt repeated as 8 prompts (one call, 8
  sequential calls, and one call with the prefix cache off).
- speculative: a target and a drafter (<= 1/8 of its FLOPs per token) trained briefly on a sparse order-1
  Markov chain, then decoded from prompts of that chain at T=1 and greedy: acceptance, tokens per target
  forward vs (1 - a^(k+1)) / (1 - a), wall-clock speedup over plain decoding (batch 16, and by batch
  --spec_batches with engines sized to the batch: one speculative step per call against one and 8 plain steps
  per call, and 8 speculative steps per call against 8 plain ones), greedy identical,
  chi-square of the first two tokens (T=1, plain and speculative) against the target's exact distribution;
  then NgramDrafter(3) on repetitive prompts (greedy walks of the chain).
- peer (only when asked for): our tok/s (engine.decode_steps=8, the main job's default, and 1) vs
  transformers `generate` (--hf_python: the interpreter of a venv with torch + transformers, with
  --peer_script: the peer's hf_generate_bench.py) and/or the Tunix sampler (--tunix_python: a venv with
  google-tunix, with --tunix_script: tunix_sampler_bench.py), each a subprocess, on the same shapes: 16 x
  32-token prompts, 64 new tokens, T=1, dense and MoE; every side one warmup call and --peer_repeats timed
  calls. The peers' scripts and venvs are not part of this repository: the flags have no defaults.
- recompiles: stats()["compiles_after_warmup"] of every engine above (all must be 0).

    python -m benchmarks decode --sections=cache,continuous --quick
    python -m benchmarks decode --sections=speculative --train_steps=150
    python -m benchmarks decode --sections=peer \
        --hf_python=HF_VENV/bin/python --peer_script=PEERS/hf_generate_bench.py \
        --tunix_python=TUNIX_VENV/bin/python --tunix_script=PEERS/tunix_sampler_bench.py
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import model
from benchmarks.common import (
    DRAFT_DIMS,
    PEER_DIMS,
    PEER_MOE,
    TARGET_DIMS,
    Engines,
    MarkovChain,
    best_run,
    check_peers,
    chosen_sections,
    greedy_identical,
    model_config,
    peer_engine_kwargs,
    plain_vs_speculative,
    pow2_floor,
    random_prompts,
    run,
    run_peer,
    train,
)
from benchmarks.record import emit, loadavg
from inference.drafters import ModelDrafter, NgramDrafter
from inference.engine import Engine
from inference.sampling import SamplingParams
from model import plan

SECTIONS = ("cache", "continuous", "prefill", "speculative", "peer")
OWN_SECTIONS = SECTIONS[:-1]  # the default: every section that needs no peer
TARGETS = dict(
    cache_speedup=10.0, continuous_vs_static=1.5, spec_speedup=2.0, draft_flops_ratio=1 / 8, chi2_p=1e-3
)


# --- cache: engine vs no-cache decode -------------------------------------------------------------------


def nocache_decode(cfg, params, prompts: list[list[int]], new: int, bucket: int, seed: int) -> dict:
    """Decodes `new` tokens by recomputing the whole sequence each step: one jitted forward per length
    bucket (compiled before the clock starts), sampling at T=1 from the last real position."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: model.Transformer(cfg, rngs=nnx.Rngs(0))))

    @jax.jit
    def step(params, tokens_BT, last, key):
        logits_BTV, _ = nnx.merge(graphdef, params)(tokens_BT)
        logits_BV = jax.lax.dynamic_index_in_dim(logits_BTV, last, axis=1, keepdims=False)
        return jax.random.categorical(key, logits_BV).astype(jnp.int32)

    b, p = len(prompts), len(prompts[0])
    tokens = np.zeros((b, p + new + bucket), np.int32)
    tokens[:, :p] = prompts
    size = lambda length: -(-length // bucket) * bucket
    buckets = sorted({size(length) for length in range(p, p + new)})
    for t in buckets:
        step(params, tokens[:, :t], t - 1, jax.random.key(0)).block_until_ready()
    key = jax.random.key(seed)
    t0 = time.perf_counter()
    for length in range(p, p + new):
        nxt = step(params, tokens[:, : size(length)], length - 1, jax.random.fold_in(key, length))
        tokens[:, length] = np.asarray(nxt)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tok_s": b * new / seconds, "buckets": buckets}


def section_cache(a, eng: Engine, cfg, params) -> dict:
    rng = np.random.default_rng(1)
    prompts = random_prompts(rng, 16, a.cache_prompt, cfg.model.vocab_size)
    sp = SamplingParams(temperature=1.0, max_new_tokens=a.cache_new, seed=1)
    _, seconds, delta = best_run(eng, prompts, sp, a.repeats)
    engine_tok_s = delta["generated_tokens"] / seconds
    base_run = nocache_decode(cfg, params, prompts, a.cache_new, a.bucket, seed=1)
    ratio = engine_tok_s / base_run["tok_s"]
    return emit(
        {
            "bench": "decode_cache",
            "batch": 16,
            "prompt_len": a.cache_prompt,
            "new_tokens": a.cache_new,
            "engine_tok_s": round(engine_tok_s, 1),
            "engine_s": round(seconds, 3),
            "nocache_tok_s": round(base_run["tok_s"], 1),
            "nocache_s": round(base_run["seconds"], 3),
            "nocache_buckets": base_run["buckets"],
            "cache_speedup": round(ratio, 2),
            "target": TARGETS["cache_speedup"],
            "met": ratio >= TARGETS["cache_speedup"],
        }
    )


# --- continuous vs static batching -----------------------------------------------------------------------


def section_continuous(a, engines: Engines, cont: Engine, cfg, params, engine_kwargs) -> dict:
    rng = np.random.default_rng(2)
    n = a.requests
    lengths = rng.integers(16, 49, n)
    prompts = [rng.integers(3, cfg.model.vocab_size, int(length)).tolist() for length in lengths]
    # Truncated Pareto(alpha=1) from 8: P(L > x) = 8 / x, clipped at 256 (about 1 request in 32 there).
    new = np.clip((8 / (1 - rng.random(n))).astype(int), 8, a.max_new).tolist()
    sps = [SamplingParams(temperature=1.0, max_new_tokens=int(m), seed=2) for m in new]
    static = engines.make("static", cfg, params, **dict(engine_kwargs, scheduler="static"))
    out_c, sec_c, d_c = best_run(cont, prompts, sps, a.repeats)
    out_s, sec_s, d_s = best_run(static, prompts, sps, a.repeats)
    same = sum(x.tokens == y.tokens for x, y in zip(out_c, out_s))
    ratio = sec_s / sec_c
    return emit(
        {
            "bench": "decode_continuous_vs_static",
            "requests": n,
            "max_batch": engine_kwargs["max_batch"],
            "max_new_tokens": {
                "min": min(new),
                "median": int(np.median(new)),
                "mean": round(float(np.mean(new)), 1),
                "max": max(new),
            },
            "generated_tokens": d_c["generated_tokens"],
            "static_s": round(sec_s, 3),
            "continuous_s": round(sec_c, 3),
            "decode_steps": {"static": d_s["decode_steps"], "continuous": d_c["decode_steps"]},
            "identical_completions": f"{same}/{n}",
            "continuous_vs_static": round(ratio, 2),
            "target": TARGETS["continuous_vs_static"],
            "met": ratio >= TARGETS["continuous_vs_static"],
        }
    )


# --- prefill sharing -------------------------------------------------------------------------------------


def section_prefill(a, engines: Engines, eng: Engine, cfg, params, engine_kwargs) -> dict:
    """Each measurement uses a fresh random prompt, so nothing earlier sits in the prefix cache."""
    rng = np.random.default_rng(3)
    length, vocab = a.prefill_prompt, cfg.model.vocab_size
    sp = SamplingParams(temperature=1.0, max_new_tokens=4, seed=3)
    prefill = lambda e, prompts, s: run(e, prompts, s)[2]["prefill_tokens"]
    n8 = prefill(eng, random_prompts(rng, 1, length, vocab), dataclasses.replace(sp, n=8))
    same_call = prefill(eng, random_prompts(rng, 1, length, vocab) * 8, sp)
    prompt = random_prompts(rng, 1, length, vocab)
    sequential = sum(prefill(eng, prompt, sp) for _ in range(8))
    off = engines.make("no_prefix_cache", cfg, params, **dict(engine_kwargs, prefix_cache_pages=0))
    no_cache = prefill(off, random_prompts(rng, 1, length, vocab) * 8, sp)
    n8_off = prefill(off, random_prompts(rng, 1, length, vocab), dataclasses.replace(sp, n=8))
    bound = no_cache / 8 + engine_kwargs["min_bucket"]
    return emit(
        {
            "bench": "decode_prefill_sharing",
            "prompt_len": length,
            "prefill_tokens": {
                "n8": n8,
                "n8_prefix_cache_off": n8_off,
                "8_prompts_one_call": same_call,
                "8_prompts_sequential_calls": sequential,
                "8_prompts_prefix_cache_off": no_cache,
            },
            "sharing_ratio": round(no_cache / n8, 2),
            "target": f"n8 <= {bound:.1f} (8-prompt figure without sharing / 8 + one bucket)",
            "met": n8 <= bound,
        }
    )


# --- speculative decoding --------------------------------------------------------------------------------


def mean_overlap(tcfg, tparams, dcfg, dparams, completions, prompts, greedy: bool) -> float:
    """alpha = E[sum_x min(p(x), q(x))] (greedy: E[argmax p == argmax q]) over the contexts of `completions`:
    the per-token acceptance probability of the theory (1 - alpha^(k+1)) / (1 - alpha)."""
    tokens = np.asarray([pr + c.tokens for pr, c in zip(prompts, completions)], np.int32)
    p0 = len(prompts[0])

    def probs(cfg, params):
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: model.Transformer(cfg, rngs=nnx.Rngs(0))))
        logits_BTV = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t)[0])(params, tokens)
        return jax.nn.softmax(logits_BTV[:, p0 - 1 : -1], axis=-1)

    p_BTV, q_BTV = probs(tcfg, tparams), probs(dcfg, dparams)
    if greedy:
        return float(jnp.mean(jnp.argmax(p_BTV, -1) == jnp.argmax(q_BTV, -1)))
    return float(jnp.mean(jnp.sum(jnp.minimum(p_BTV, q_BTV), axis=-1)))


def chi_square(samples: list[tuple[int, int]], exact: dict[tuple[int, int], float]) -> dict:
    """Pearson chi-square of observed (token0, token1) pairs against exact probabilities; cells with an
    expected count under 5 are pooled into one."""
    n = len(samples)
    counts: dict = {}
    for pair in samples:
        counts[pair] = counts.get(pair, 0) + 1
    big = {c for c, p in exact.items() if p * n >= 5}
    obs = [counts.get(c, 0) for c in sorted(big)]
    exp = [exact[c] * n for c in sorted(big)]
    rest_obs, rest_exp = n - sum(obs), n - sum(exp)
    if rest_exp >= 1:
        obs.append(rest_obs)
        exp.append(rest_exp)
    obs_a, exp_a = np.asarray(obs, float), np.asarray(exp, float)
    stat = float(np.sum((obs_a - exp_a) ** 2 / exp_a))
    dof = len(obs) - 1
    p_value = float(jax.scipy.special.gammaincc(dof / 2, stat / 2))
    return {"chi2": round(stat, 2), "dof": dof, "p_value": round(p_value, 4)}


def exact_pairs(graphdef, params, prompt: list[int], first_tokens) -> dict[tuple[int, int], float]:
    """p(t0, t1 | prompt) from plain forwards of the target, for t0 in `first_tokens` and every t1."""
    forward = jax.jit(lambda p, tokens_BT: jax.nn.softmax(nnx.merge(graphdef, p)(tokens_BT)[0][:, -1], -1))
    p0 = np.asarray(forward(params, jnp.asarray([prompt])))[0]
    firsts = sorted(first_tokens)
    p1 = np.asarray(forward(params, jnp.asarray([prompt + [t] for t in firsts])))
    return {
        (t0, int(t1)): float(p0[t0] * p1[i, t1])
        for i, t0 in enumerate(firsts)
        for t1 in np.flatnonzero(p1[i] > 1e-6)
    }


def section_speculative(a, engines: Engines) -> list[dict]:
    tcfg, dcfg = model_config(**TARGET_DIMS), model_config(**DRAFT_DIMS)
    seq = a.spec_prompt + a.spec_new
    t_flops = plan.flops_per_token(tcfg, seq, training=False)
    d_flops = plan.flops_per_token(dcfg, seq, training=False)
    chain = MarkovChain(TARGET_DIMS["vocab"], a.alphabet, seed=4)
    t0 = time.perf_counter()
    graphdef, tparams, tloss = train(tcfg, chain, a.train_steps, 8, 32, 1e-3, seed=0)
    t_train = time.perf_counter() - t0
    _, dparams, dloss = train(dcfg, chain, a.train_steps, 8, 32, 3e-3, seed=1)
    d_train = time.perf_counter() - t0 - t_train
    print(f"# trained target {t_train:.0f} s, drafter {d_train:.0f} s", file=sys.stderr, flush=True)

    kwargs = dict(max_batch=16, max_seq_len=seq + 8, prefill_chunk=32, prefill_batch=16, min_bucket=32)
    plain = engines.make("spec_plain", tcfg, tparams, **kwargs)
    spec = engines.make("spec_model", tcfg, tparams, draft=ModelDrafter(dcfg, dparams), **kwargs)
    prompts = chain.sample(np.random.default_rng(5), 16, a.spec_prompt).tolist()
    lines = []
    line = {
        "bench": "decode_speculative",
        "target_params_m": round(plan.count_params(tcfg)["active"] / 1e6, 2),
        "draft_params_m": round(plan.count_params(dcfg)["active"] / 1e6, 2),
        "draft_flops_ratio": round(d_flops / t_flops, 4),
        "flops_ratio_met": d_flops / t_flops <= TARGETS["draft_flops_ratio"],
        "train": {
            "steps": a.train_steps,
            "target_loss": round(tloss, 3),
            "draft_loss": round(dloss, 3),
            "chain_entropy": round(chain.entropy, 3),
            "target_s": round(t_train, 1),
            "draft_s": round(d_train, 1),
        },
        "batch": 16,
        "prompt_len": a.spec_prompt,
        "new_tokens": a.spec_new,
        "num_draft": 4,
    }
    outputs = plain_vs_speculative(plain, spec, prompts, a.spec_new, a.repeats, side="spec")
    for name, (out_p, _, figures) in outputs.items():
        alpha = mean_overlap(tcfg, tparams, dcfg, dparams, out_p, prompts, name == "greedy")
        theory = (1 - alpha**5) / (1 - alpha) if alpha < 1 else 5.0
        line[name] = {**figures, "alpha": round(alpha, 4), "theory": round(theory, 3)}
    # Latency-bound batches (engines sized to the batch, as a server at that batch would be), T=1, against
    # plain decoding one step per call and engine.decode_steps=8 steps per call (the main job's default).
    sp = SamplingParams(temperature=1.0, max_new_tokens=a.spec_new, seed=5)
    line["by_batch"] = {}
    for batch in [int(b) for b in a.spec_batches.split(",")]:
        kw = dict(kwargs, max_batch=batch, prefill_batch=min(pow2_floor(batch), 16))
        engs = {
            "plain": plain if batch == 16 else engines.make(f"spec_plain_b{batch}", tcfg, tparams, **kw),
            "plain_n8": engines.make(f"spec_plain_n8_b{batch}", tcfg, tparams, decode_steps=8, **kw),
            "spec": spec
            if batch == 16
            else engines.make(f"spec_model_b{batch}", tcfg, tparams, draft=ModelDrafter(dcfg, dparams), **kw),
            "spec_n8": engines.make(
                f"spec_model_n8_b{batch}",
                tcfg,
                tparams,
                draft=ModelDrafter(dcfg, dparams),
                decode_steps=8,
                **kw,
            ),
        }
        sec, delta = {}, {}
        for name, eng in engs.items():
            _, sec[name], delta[name] = best_run(eng, prompts[:batch], sp, a.repeats)
        d = delta["spec"]
        line["by_batch"][f"b{batch}"] = {
            "acceptance_rate": round(d["accepted_tokens"] / max(d["proposed_tokens"], 1), 4),
            "tokens_per_target_forward": round(d["generated_tokens"] / d["target_row_forwards"], 3),
            **{f"{name}_s": round(t, 3) for name, t in sec.items()},
            "speedup": round(sec["plain"] / sec["spec"], 2),
            "speedup_vs_decode_steps_8": round(sec["plain_n8"] / sec["spec"], 2),
            # 8 speculative steps per call against 8 plain steps per call (like for like), and against one
            "speedup_n8": round(sec["plain_n8"] / sec["spec_n8"], 2),
            "speedup_n8_vs_decode_steps_1": round(sec["plain"] / sec["spec_n8"], 2),
        }
    out_p, out_s, _ = outputs["greedy"]
    line["greedy_identical"] = greedy_identical(out_p, out_s)
    same = sum(x.tokens == y.tokens for x, y in zip(out_p, out_s))
    # Exactness at T=1: first two tokens of many samples of one prompt vs the target's exact distribution.
    sp = SamplingParams(temperature=1.0, max_new_tokens=2, n=a.chi2_samples, seed=6)
    prompt = prompts[0]
    pairs = {}
    for name, eng in (("plain", plain), ("speculative", spec)):
        pairs[name] = [tuple(c.tokens) for c in eng.generate([prompt], sp)]
    exact = exact_pairs(graphdef, tparams, prompt, {p[0] for v in pairs.values() for p in v})
    line["chi2_first_two_tokens"] = {
        "samples": a.chi2_samples,
        **{name: chi_square(v, exact) for name, v in pairs.items()},
    }
    small = [v["speedup"] for k, v in line["by_batch"].items() if int(k[1:]) <= 4]
    small_n8 = [v["speedup_n8"] for k, v in line["by_batch"].items() if int(k[1:]) <= 4]
    line["target"] = (
        f"speedup >= {TARGETS['spec_speedup']} at batch 1-4 (one step per call each side; met_n8: 8 steps per"
        " call each side), greedy identical"
    )
    line["met"] = bool(small) and min(small) >= TARGETS["spec_speedup"] and same == len(out_p)
    line["met_n8"] = bool(small_n8) and min(small_n8) >= TARGETS["spec_speedup"] and same == len(out_p)
    lines.append(emit(line))

    # Prompt lookup: greedy walks of the chain (they cycle), no draft model.
    ngram = engines.make("spec_ngram3", tcfg, tparams, draft=NgramDrafter(3), **kwargs)
    walks = [chain.greedy_walk(s, a.spec_prompt) for s in range(16)]
    line = {
        "bench": "decode_speculative_ngram",
        "drafter": "NgramDrafter(3)",
        "prompts": "greedy chain walks",
    }
    for name, temperature in (("t1", 1.0), ("greedy", 0.0)):
        sp = SamplingParams(temperature=temperature, max_new_tokens=a.spec_new, seed=7)
        out_p, sec_p, _ = best_run(plain, walks, sp, a.repeats)
        out_n, sec_n, d = best_run(ngram, walks, sp, a.repeats)
        acc = d["accepted_tokens"] / max(d["proposed_tokens"], 1)
        line[name] = {
            "acceptance_rate": round(acc, 4),
            "proposed_per_step": round(d["proposed_tokens"] / d["target_row_forwards"], 3),
            "tokens_per_target_forward": round(d["generated_tokens"] / d["target_row_forwards"], 3),
            "plain_s": round(sec_p, 3),
            "spec_s": round(sec_n, 3),
            "speedup": round(sec_p / sec_n, 2),
        }
        if temperature == 0.0:
            line["greedy_identical"] = greedy_identical(out_p, out_n)
    lines.append(emit(line))
    return lines


# --- peer: transformers generate on the same shapes -----------------------------------------------------


def section_peer(a, engines: Engines, dense_eng: Engine) -> list[dict]:
    """Ours (engine.decode_steps=8, the main job's default, and 1) vs each peer given by interpreter, on the
    anchor shapes: every side one warmup call, then --peer_repeats timed calls of 16 fresh prompts (no
    prefix-cache hits), median."""
    peers = [
        (name, python, script)
        for name, python, script in (
            ("transformers", a.hf_python, a.peer_script),
            ("tunix", a.tunix_python, a.tunix_script),
        )
        if python
    ]
    lines = []
    for arch in a.peer_archs.split(","):
        moe = arch == "qwen3moe"
        cfg = model_config(**PEER_DIMS, **(PEER_MOE if moe else {}))
        params = nnx.state(model.build(cfg, seed=0), nnx.Param)
        line = {
            "bench": "decode_peer",
            "arch": arch,
            "shapes": "16 x 32-token prompts, 64 new tokens, T=1",
            "loadavg_start": loadavg(),
        }
        for steps in (8, 1):
            if steps == 1 and not moe:
                eng = dense_eng
            else:
                eng = engines.make(
                    f"peer_{arch}_n{steps}", cfg, params, **peer_engine_kwargs(), decode_steps=steps
                )
            rng = np.random.default_rng(8)
            warm = random_prompts(rng, 16, 32, PEER_DIMS["vocab"])
            run(
                eng, warm, SamplingParams(temperature=1.0, max_new_tokens=64, seed=99)
            )  # the peers' warmup call
            times, step_s, wait_s = [], 0.0, 0.0
            for r in range(a.peer_repeats):
                prompts = random_prompts(rng, 16, 32, PEER_DIMS["vocab"])
                _, seconds, d = run(eng, prompts, SamplingParams(temperature=1.0, max_new_tokens=64, seed=r))
                times.append(seconds)
                step_s, wait_s = step_s + d["step_s"], wait_s + d["device_wait_s"]
            key = "ours" if steps == 8 else "ours_decode_steps_1"
            line[f"{key}_tok_s"] = round(16 * 64 / float(np.median(times)), 1)
            line[f"{key}_call_s"] = [round(t, 3) for t in times]
            # the engine steps' time not spent waiting for the device: what overlapping the host's
            # bookkeeping with the next device call could save at most
            line[f"{key}_host_share"] = round(1 - wait_s / step_s, 4)
        for name, python, script in peers:
            line.update(run_peer(name, python, script, arch, a.peer_repeats))
            if f"{name}_tok_s" in line:
                line[f"ours_vs_{name}"] = round(line["ours_tok_s"] / line[f"{name}_tok_s"], 2)
        line["loadavg_end"] = loadavg()
        lines.append(emit(line))
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(OWN_SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    p.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run, not the figures)")
    p.add_argument("--repeats", type=int, default=2, help="timed engine calls per measurement (fastest kept)")
    p.add_argument("--cache_prompt", type=int, default=32)
    p.add_argument("--cache_new", type=int, default=128)
    p.add_argument("--bucket", type=int, default=32, help="no-cache baseline: lengths round up to this")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max_new", type=int, default=256, help="continuous: longest max_new_tokens")
    p.add_argument("--prefill_prompt", type=int, default=100)
    p.add_argument("--train_steps", type=int, default=200, help="AdamW steps for target and drafter each")
    p.add_argument("--alphabet", type=int, default=48, help="states of the Markov chain")
    p.add_argument("--spec_prompt", type=int, default=32)
    p.add_argument("--spec_new", type=int, default=96)
    p.add_argument("--chi2_samples", type=int, default=512)
    p.add_argument(
        "--spec_batches", default="1,4,16", help="speculative: batch sizes (engines sized to each)"
    )
    p.add_argument("--peer_archs", default="qwen3,qwen3moe")
    p.add_argument("--peer_repeats", type=int, default=3)
    p.add_argument("--peer_script", default="", help="transformers peer: PATH of hf_generate_bench.py")
    p.add_argument("--hf_python", default="", help="interpreter of a venv with torch + transformers")
    p.add_argument("--tunix_script", default="", help="Tunix peer: PATH of tunix_sampler_bench.py")
    p.add_argument("--tunix_python", default="", help="interpreter of a venv with google-tunix")
    a = p.parse_args()
    chosen = chosen_sections(p, a.sections, SECTIONS)
    peers = check_peers(p, {"hf_python": "peer_script", "tunix_python": "tunix_script"}, a)
    if "peer" in chosen and not peers:
        p.error(
            "--sections=peer needs a peer: --hf_python=PATH with --peer_script=PATH (transformers) and/or "
            "--tunix_python=PATH with --tunix_script=PATH (Tunix)"
        )
    if a.quick:
        a.cache_new, a.requests, a.max_new, a.train_steps = 32, 16, 64, 30
        a.spec_new, a.chi2_samples, a.peer_repeats, a.repeats = 32, 64, 1, 1

    t_start = time.perf_counter()
    engines, summary = Engines(), {"bench": "decode_summary"}
    kwargs = peer_engine_kwargs()
    cfg = model_config(**PEER_DIMS)
    params = nnx.state(model.build(cfg, seed=0), nnx.Param)
    dense = engines.make("dense", cfg, params, **kwargs) if set(chosen) - {"speculative"} else None
    if "cache" in chosen:
        summary["cache_speedup"] = section_cache(a, dense, cfg, params)["cache_speedup"]
    if "continuous" in chosen:
        summary["continuous_vs_static"] = section_continuous(a, engines, dense, cfg, params, kwargs)[
            "continuous_vs_static"
        ]
    if "prefill" in chosen:
        line = section_prefill(a, engines, dense, cfg, params, kwargs)
        summary["prefill_tokens"] = line["prefill_tokens"]
        summary["prefill_met"] = line["met"]
    if "speculative" in chosen:
        spec, ngram = section_speculative(a, engines)
        summary["speculative"] = {
            "acceptance_t1": spec["t1"]["acceptance_rate"],
            "alpha_t1": spec["t1"]["alpha"],
            "tokens_per_target_forward_t1": spec["t1"]["tokens_per_target_forward"],
            "theory_t1": spec["t1"]["theory"],
            "speedup_t1": spec["t1"]["speedup"],
            "speedup_t1_by_batch": {k: v["speedup"] for k, v in spec["by_batch"].items()},
            "speedup_t1_vs_decode_steps_8_by_batch": {
                k: v["speedup_vs_decode_steps_8"] for k, v in spec["by_batch"].items()
            },
            "speedup_t1_n8_by_batch": {k: v["speedup_n8"] for k, v in spec["by_batch"].items()},
            "speculative_met": spec["met"],
            "speculative_met_n8": spec["met_n8"],
            "speedup_greedy": spec["greedy"]["speedup"],
            "greedy_identical": spec["greedy_identical"],
            "chi2_p_speculative": spec["chi2_first_two_tokens"]["speculative"]["p_value"],
            "draft_flops_ratio": spec["draft_flops_ratio"],
            "ngram3_speedup_greedy": ngram["greedy"]["speedup"],
        }
    if "peer" in chosen:
        peer_lines = section_peer(a, engines, dense)
        for peer in ("transformers", "tunix"):
            summary[f"peer_ours_vs_{peer}"] = {
                line["arch"]: line.get(f"ours_vs_{peer}") for line in peer_lines
            }
        summary["decode_targets"] = "ours >= 2x tunix (dense, MoE), MoE >= 1.5x transformers"
        summary["decode_met"] = all((line.get("ours_vs_tunix") or 0) >= 2.0 for line in peer_lines) and all(
            (line.get("ours_vs_transformers") or 0) >= 1.5
            for line in peer_lines
            if line["arch"] == "qwen3moe"
        )
    summary["recompiles_after_warmup"] = emit(engines.recompiles())["total"]
    summary["wall_s"] = round(time.perf_counter() - t_start, 1)
    emit(summary)


if __name__ == "__main__":
    main()
