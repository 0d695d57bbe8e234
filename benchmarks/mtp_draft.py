"""python -m benchmarks mtp_draft [--train_steps 200] [--num_draft 1,2,4]

The model's own MTP head as the drafter (`inference.MTPDrafter`, the "high-speed variant": same weights):
`benchmarks/decode.py`'s speculative target (8 layers, d_model 512, vocab 1024) with one MTP module
(DeepSeek-V3's num_nextn_predict_layers = 1), trained with next-token + MTP loss on decode.py's sparse order-1
Markov chain, then decoded from 16 prompts of that chain at T=1 and greedy, beside plain decoding of the same
weights in this process (same prompts, seeds, repeats; fastest of --repeats calls each). One JSON line per
num_draft: acceptance, tokens per target forward, tok/s of both and the speedup, greedy outputs identical,
compiles after warmup.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import model
from benchmarks.common import (
    TARGET_DIMS,
    Engines,
    MarkovChain,
    greedy_identical,
    model_config,
    plain_vs_speculative,
)
from benchmarks.record import emit
from inference import MTPDrafter
from model import mtp as mtp_lib
from model import plan
from model.transformer import next_token_loss


def train(cfg, chain: MarkovChain, steps: int, batch: int, seq_len: int, lr: float, seed: int):
    """AdamW on next-token + MTP loss over chain samples; returns (params, last-10% mean of both losses)."""
    m = model.build(cfg, seed=seed)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(steps // 10, 1), steps, lr / 10)
    opt = nnx.Optimizer(m, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule)), wrt=nnx.Param)

    @nnx.jit
    def step(m, opt, tokens_BT):
        def loss_fn(m):
            logits_BTV, aux = m(tokens_BT)
            main = next_token_loss(logits_BTV, tokens_BT)
            extra = mtp_lib.mtp_loss(m.mtp_logits(aux["hidden"], tokens_BT), tokens_BT)
            return main + extra, (main, extra)

        (_, losses), grads = nnx.value_and_grad(loss_fn, has_aux=True)(m)
        opt.update(m, grads)
        return losses

    rng = np.random.default_rng(seed)
    history = [step(m, opt, jnp.asarray(chain.sample(rng, batch, seq_len))) for _ in range(steps)]
    tail = np.asarray(jax.device_get(history[-max(steps // 10, 1) :]))
    return nnx.state(m, nnx.Param), tail.mean(axis=0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train_steps", type=int, default=200)
    p.add_argument("--alphabet", type=int, default=48, help="states of the Markov chain")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=96)
    p.add_argument("--num_draft", default="1,2,4", help="comma-separated k values")
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()

    cfg = model_config(**TARGET_DIMS)
    cfg.model.mtp_layers = 1
    chain = MarkovChain(TARGET_DIMS["vocab"], a.alphabet, seed=4)
    t0 = time.perf_counter()
    params, (main_loss, mtp_loss) = train(cfg, chain, a.train_steps, 8, 32, 1e-3, seed=0)
    train_s = time.perf_counter() - t0
    print(f"# trained {train_s:.0f} s", file=sys.stderr, flush=True)

    seq = a.prompt + a.new
    kwargs = dict(max_batch=16, max_seq_len=seq + 8, prefill_chunk=32, prefill_batch=16, min_bucket=32)
    engines = Engines()
    plain = engines.make("plain", cfg, params, **kwargs)
    prompts = chain.sample(np.random.default_rng(5), 16, a.prompt).tolist()
    for k in (int(x) for x in a.num_draft.split(",")):
        spec = engines.make(f"mtp_k{k}", cfg, params, draft=MTPDrafter(), num_draft=k, **kwargs)
        line = {
            "bench": "decode_mtp_draft",
            "params_m": round(plan.count_params(cfg)["total"] / 1e6, 2),
            "mtp_layers": 1,
            "train": {
                "steps": a.train_steps,
                "main_loss": round(float(main_loss), 3),
                "mtp_loss": round(float(mtp_loss), 3),
                "chain_entropy": round(chain.entropy, 3),
                "seconds": round(train_s, 1),
            },
            "batch": 16,
            "prompt_len": a.prompt,
            "new_tokens": a.new,
            "num_draft": k,
        }
        outputs = plain_vs_speculative(plain, spec, prompts, a.new, a.repeats, side="mtp")
        line.update({name: figures for name, (_, _, figures) in outputs.items()})
        out_p, out_s, _ = outputs["greedy"]
        line["greedy_identical"] = greedy_identical(out_p, out_s)
        line["compiles_after_warmup"] = engines.recompiles()["total"]
        emit(line)


if __name__ == "__main__":
    main()
