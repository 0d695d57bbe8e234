"""python -m benchmarks demo_recipe

The `make demo` recipe on a CPU, as a fast stand-alone loop for choosing it: a toy MoE model (~0.66M
parameters) learns the mission domain `math` at its easiest level (-1: "Compute 47 + 8." with the level's
short instruction, answered in \\boxed{}; scored by the domain's answer parser) beside the toy `strings`
domain, by a supervised warm start and then GRPO with the decoding engine. Pass@1 per domain (temperature 1
and greedy; pass@8 after each phase) on the SELECTION split is printed to stderr as it goes, and one JSON line
at the end (arguments, pass rates, wall time per phase). `--domains` takes any registry domains with levels
("math:-1;strings:2,3").

The defaults are the `make demo` recipe (configs/grpo.py:demo): the noisy teacher misses one digit of the
answer (`rl.warm_start.corrupt`; a wrong character anywhere would mostly land in "boxed" and teach format
errors), and math level -1 asks for the boxed answer alone (a 38-token prompt), so the recipe learns within
1500 warm-start steps of 64 rows. An arith recipe: `--domains 'arith:2;strings:2,3' --seq_len 24
--max_new_tokens 8`.

Splits (`rl.data`): the loop trains on the train stream (`DomainTasks(split="train")`, as the trainer does)
and scores the first `--eval_n` distinct prompts of the selection split. The held-out (eval) split is never
read here: every choice of recipe made with this script is made without it, and `make demo` reports it.

The warm start imitates a noisy teacher: a fraction `--sft_noise` of the demonstrations has one character of
the answer wrong (`corrupt`). The model then knows the skill (its greedy answer is mostly right) but samples
the wrong near-misses it was shown, so pass@1 at temperature 1 sits well below greedy and pass@8: the gap
GRPO turns into pass@1. The greedy numbers show how much of the "before" gap is the noise (sharpening) and
how much the model could not do greedily either. With clean demonstrations the short warm start leaves
confidently wrong answers (all samples agree), which GRPO at this budget barely moves (see the report in the
commit history).

Dimension key: B rows, T token positions.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.record import emit
from configs import grpo as grpo_config  # noqa: E402
from envs import registry  # noqa: E402
from inference import Engine, EngineConfig, SamplingParams  # noqa: E402
from model.io.tokenizer import ByteTokenizer  # noqa: E402
from rl import (  # noqa: E402
    grpo,
    rollout,
    train_state,  # noqa: E402
)
from rl import train_step as ts  # noqa: E402
from rl.data import HOLDOUT, SELECTION, DomainTasks  # noqa: E402
from rl.warm_start import corrupt  # noqa: E402

TOK = ByteTokenizer(256)
EOS = TOK.eos_id


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[2])
    p.add_argument("--domains", default="math:-1;strings:2,3", help="domain:levels;...")
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--num_layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=52, help="prompt + completion tokens (max_prompt_len + 12)")
    p.add_argument("--holdout", type=float, default=HOLDOUT, help="rl.data.holdout (never scored here)")
    p.add_argument("--selection", type=float, default=SELECTION, help="rl.data.selection")
    p.add_argument("--sft_steps", type=int, default=1500)
    p.add_argument("--sft_batch", type=int, default=64)
    p.add_argument("--sft_lr", type=float, default=3e-3)
    p.add_argument(
        "--sft_noise",
        type=float,
        default=0.65,
        help="fraction of SFT demonstrations with one character wrong",
    )
    p.add_argument(
        "--sft_mix",
        default="48,16",
        help="rows of each SFT batch per domain, in --domains order (empty: equal)",
    )
    p.add_argument(
        "--sft_cache", default="", help="experiments: load the SFT params from / save them to here"
    )
    p.add_argument("--sft_eval_every", type=int, default=0, help="0: evaluate only after SFT")
    p.add_argument("--grpo_steps", type=int, default=300)
    p.add_argument("--prompts_per_step", type=int, default=16)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--grpo_lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--grpo_warmup", type=int, default=30)
    p.add_argument("--grpo_b2", type=float, default=0.999)
    p.add_argument("--advantage_std", default="group", help="group | batch | none (Dr. GRPO)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max_new_tokens", type=int, default=12)
    p.add_argument("--eval_n", type=int, default=150, help="selection-split prompts per domain")
    p.add_argument(
        "--eval_every", type=int, default=50, help="GRPO steps between selection-split evals (0: end)"
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# --- Config -------------------------------------------------------------------------------------------------


def make_config(args, *, lr: float, total_steps: int, warmup: int = 0, b2: float = 0.999):
    cfg = grpo_config.get_config("tiny")
    m = cfg.model
    m.d_model, m.num_layers = args.d_model, args.num_layers
    m.num_heads, m.num_kv_heads, m.head_dim = 4, 2, args.d_model // 4
    m.d_ff = 2 * args.d_model
    m.moe.num_experts, m.moe.top_k = args.experts, 2
    m.moe.d_ff = m.moe.shared_d_ff = args.d_model
    o = cfg.rl.optim
    o.lr, o.warmup_steps, o.total_steps, o.b2 = lr, warmup, max(total_steps, warmup + 1), b2
    cfg.rl.advantage_std = args.advantage_std
    cfg.rl.group_size = args.group_size
    cfg.rl.prompts_per_step = args.prompts_per_step
    cfg.rl.temperature = args.temperature
    cfg.seq_len = args.seq_len
    return cfg


# --- Tasks --------------------------------------------------------------------------------------------------


class Domain:
    """One environment's train stream and selection prompts (`rl.data` splits, disjoint by construction)."""

    def __init__(self, spec: str, args):
        name, _, levels = spec.partition(":")
        self.name, self.env = name, registry.make(name)
        self.levels = tuple(int(x) for x in levels.split(",")) if levels else None
        self._splits = dict(holdout=args.holdout, selection=args.selection)
        self.seed = args.seed
        self._train = DomainTasks(name, seed=args.seed, split="train", levels=self.levels, **self._splits)

    def train(self, n: int):
        return self._train.next_tasks(n)

    def selection(self, n: int):
        """The first `n` distinct prompts of the selection stream (as `rl.data.selection_tasks` picks)."""
        stream = DomainTasks(self.name, seed=self.seed, split="selection", levels=self.levels, **self._splits)
        tasks: dict[str, object] = {}
        for _ in range(64 * n):
            if len(tasks) == n:
                break
            task = stream.next_tasks(1)[0]
            tasks.setdefault(task.prompt, task)
        if len(tasks) < n:
            raise ValueError(f"{self.name}: only {len(tasks)} distinct selection prompts; lower --eval_n")
        return list(tasks.values())


def encode(task) -> list[int]:
    return rollout.format_prompt(task, TOK, chat=False)  # as the trainer's sampler sees it


# --- Batches ------------------------------------------------------------------------------------------------


def rows_to_batch(prompts, completions, T: int, *, logps=None, advantages=None):
    """Right-padded [B, T] batch; mask 1 on completion tokens (aligned with the token)."""
    B = len(prompts)
    tokens = np.zeros((B, T), np.int32)
    mask = np.zeros((B, T), np.float32)
    blogp = np.zeros((B, T), np.float32)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        seq = (p + c)[:T]
        tokens[i, : len(seq)] = seq
        end = min(len(p) + len(c), T)
        mask[i, len(p) : end] = 1.0
        if logps is not None:
            blogp[i, len(p) : end] = logps[i][: end - len(p)]
    batch = {
        "tokens_BT": jnp.asarray(tokens),
        "positions_BT": jnp.asarray(np.tile(np.arange(T, dtype=np.int32), (B, 1))),
        "mask_BT": jnp.asarray(mask),
    }
    if advantages is not None:
        batch["advantages_B"] = jnp.asarray(advantages, jnp.float32)
        batch["behaviour_logp_BT"] = jnp.asarray(blogp)
    return batch


def text_of(tokens) -> str:
    return TOK.decode([t for t in tokens if t != EOS])


# --- Evaluation ---------------------------------------------------------------------------------------------


def evaluate(engine, domains, eval_sets, *, temperature: float, n: int, max_new: int, seed: int):
    """Per domain: pass@1 (mean reward over all n samples) and pass@n (any of a task's n samples)."""
    out = {}
    for d in domains:
        tasks = eval_sets[d.name]
        sp = SamplingParams(
            temperature=temperature, max_new_tokens=max_new, n=n, seed=seed, stop_tokens=(EOS,)
        )
        comps = engine.generate([encode(t) for t in tasks], sp)
        r = np.array([d.env.score(tasks[i // n], text_of(c.tokens)).reward for i, c in enumerate(comps)])
        r = r.reshape(len(tasks), n)
        out[d.name] = {"pass@1": float(r.mean()), f"pass@{n}": float(r.max(axis=1).mean())}
    return out


def eval_all(engine, domains, eval_sets, args, tag: str, with_pass8: bool = False):
    t0 = time.perf_counter()
    res = {
        "t1": evaluate(engine, domains, eval_sets, temperature=1.0, n=1, max_new=args.max_new_tokens, seed=7),
        "greedy": evaluate(
            engine, domains, eval_sets, temperature=0.0, n=1, max_new=args.max_new_tokens, seed=7
        ),
    }
    if with_pass8:
        res["t1_n8"] = evaluate(
            engine, domains, eval_sets, temperature=1.0, n=8, max_new=args.max_new_tokens, seed=8
        )
    res["seconds"] = time.perf_counter() - t0
    summary = " ".join(
        f"{d.name}: t1 {res['t1'][d.name]['pass@1']:.2f} greedy {res['greedy'][d.name]['pass@1']:.2f}"
        + (f" pass@8 {res['t1_n8'][d.name]['pass@8']:.2f}" if with_pass8 else "")
        for d in domains
    )
    log(f"eval {tag}: {summary} ({res['seconds']:.1f} s)")
    return res


# --- Main ---------------------------------------------------------------------------------------------------


def copy_params(params):
    return jax.tree.map(jnp.copy, params)  # the train step donates its state: never share buffers with it


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    times = {}
    domains = [Domain(s, args) for s in args.domains.split(";")]
    eval_sets = {d.name: d.selection(args.eval_n) for d in domains}
    T = args.seq_len

    # Set up model, steps and engine (compiles)
    t0 = time.perf_counter()
    sft_cfg = make_config(args, lr=args.sft_lr, total_steps=args.sft_steps, warmup=args.warmup)
    model_def, state = train_state.init_state(sft_cfg, seed=args.seed)
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    sft_step = ts.make_sft_step(sft_cfg, model_def)
    ecfg = EngineConfig(
        max_batch=args.prompts_per_step * args.group_size,
        max_seq_len=-(-T // 16) * 16,
        page_size=16,
        prefill_chunk=128,
        prefill_batch=8,
        min_bucket=16,
        prefix_cache_pages=0,
    )
    engine = Engine(sft_cfg, copy_params(state.params), ecfg)
    engine.warmup()
    times["engine_warmup"] = time.perf_counter() - t0
    log(f"model {n_params} params; engine warmup {times['engine_warmup']:.1f} s")

    # SFT warm start on (noisy) reference solutions
    t0 = time.perf_counter()
    history = []
    mix = (
        [int(x) for x in args.sft_mix.split(",")]
        if args.sft_mix
        else [args.sft_batch // len(domains)] * len(domains)
    )
    if len(mix) != len(domains):
        raise ValueError(f"--sft_mix={args.sft_mix!r} needs one row count per domain of --domains")
    cached = args.sft_cache and os.path.exists(args.sft_cache)
    noise_rng = np.random.default_rng(args.seed)
    if cached:
        with open(args.sft_cache, "rb") as f:
            leaves = pickle.load(f)
        treedef = jax.tree.structure(state.params)
        state = state.replace(params=jax.tree.unflatten(treedef, [jnp.asarray(x) for x in leaves]))
    for step in range(0 if cached else args.sft_steps):
        prompts, comps = [], []
        for d, rows in zip(domains, mix):
            for t in d.train(rows):
                answer = d.env.reference_solution(t)
                if noise_rng.random() < args.sft_noise:
                    answer = corrupt(answer, noise_rng)
                prompts.append(encode(t))
                comps.append(TOK.encode(answer) + [EOS])
        state, metrics = sft_step(state, rows_to_batch(prompts, comps, T))
        if step == 0:
            times["sft_compile"] = time.perf_counter() - t0
        if (step + 1) % 50 == 0:
            log(f"sft {step + 1}: loss {float(metrics['cross_entropy']):.3f}")
        if args.sft_eval_every and (step + 1) % args.sft_eval_every == 0 and step + 1 < args.sft_steps:
            engine.update_params(copy_params(state.params))
            history.append(
                {"sft_step": step + 1, **eval_all(engine, domains, eval_sets, args, f"sft {step + 1}")}
            )
    jax.block_until_ready(state.params)
    times["sft"] = time.perf_counter() - t0
    if args.sft_cache and not cached:
        with open(args.sft_cache, "wb") as f:
            pickle.dump([np.asarray(x) for x in jax.tree.leaves(state.params)], f)
    engine.update_params(copy_params(state.params))
    sft_eval = eval_all(
        engine, domains, eval_sets, args, f"after SFT ({args.sft_steps} steps)", with_pass8=True
    )
    times["eval_sft"] = sft_eval["seconds"]

    # GRPO
    t0 = time.perf_counter()
    rl_cfg = make_config(
        args, lr=args.grpo_lr, total_steps=args.grpo_steps, warmup=args.grpo_warmup, b2=args.grpo_b2
    )
    model_def, state = train_state.init_state(rl_cfg, seed=args.seed, params=state.params)
    train_step = ts.make_train_step(rl_cfg, model_def)
    per_domain = args.prompts_per_step // len(domains)
    sp_train = dict(temperature=args.temperature, max_new_tokens=args.max_new_tokens, n=args.group_size)
    t_gen = t_train = t_eval = 0.0
    for step in range(args.grpo_steps):
        ta = time.perf_counter()
        tasks, envs_of = [], []
        for d in domains:
            for t in d.train(per_domain):
                tasks.append(t)
                envs_of.append(d.env)
        prompts = [encode(t) for t in tasks]
        comps = engine.generate(prompts, SamplingParams(**sp_train, seed=1000 + step, stop_tokens=(EOS,)))
        g = args.group_size
        rewards = np.array(
            [envs_of[i // g].score(tasks[i // g], text_of(c.tokens)).reward for i, c in enumerate(comps)]
        )
        adv = grpo.group_advantages(jnp.asarray(rewards), g, std=rl_cfg.rl.advantage_std)
        tb = time.perf_counter()
        batch = rows_to_batch(
            [prompts[i // g] for i in range(len(comps))],
            [c.tokens for c in comps],
            T,
            logps=[c.logprobs for c in comps],
            advantages=np.asarray(adv),
        )
        state, metrics = train_step(state, batch)
        engine.update_params(copy_params(state.params))
        tc = time.perf_counter()
        t_gen, t_train = t_gen + tb - ta, t_train + tc - tb
        r_G = rewards.reshape(-1, g)
        live = float((r_G.std(axis=1) > 0).mean())
        by_domain = " ".join(
            f"{d.name} {rewards.reshape(len(domains), -1)[k].mean():.2f}" for k, d in enumerate(domains)
        )
        if step % 5 == 0 or step + 1 == args.grpo_steps:
            log(
                f"grpo {step}: reward {by_domain} live groups {live:.2f} "
                f"kl {float(metrics['approx_kl']):.4f} gnorm {float(metrics['grad_norm']):.2f} "
                f"({tc - ta:.2f} s)"
            )
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.grpo_steps:
            te = time.perf_counter()
            history.append(
                {"grpo_step": step + 1, **eval_all(engine, domains, eval_sets, args, f"grpo {step + 1}")}
            )
            t_eval += time.perf_counter() - te
    times["grpo"] = time.perf_counter() - t0 - t_eval
    times["grpo_generate"], times["grpo_train"], times["grpo_midway_evals"] = t_gen, t_train, t_eval
    final = eval_all(
        engine, domains, eval_sets, args, f"after GRPO ({args.grpo_steps} steps)", with_pass8=True
    )
    times["eval_final"] = final["seconds"]
    times["total"] = time.perf_counter() - t_start
    result = {
        "args": vars(args),
        "params": n_params,
        "sft": sft_eval,
        "grpo": final,
        "history": history,
        "seconds": {k: round(v, 1) for k, v in times.items()},
    }
    emit(result)
    log(f"total {times['total']:.0f} s: " + json.dumps(result["seconds"]))
    return result


if __name__ == "__main__":
    main()
