"""python -m rl.train --config=configs/grpo.py:test --workdir=runs/test

GRPO post-training of the `tiny` (tests, CPU) or `small` (Colab) MoE model: `configs/grpo.py:small`, and the
variants `test` (learns in a minute on a CPU) and `demo` (`make demo`), both of the tiny model. `:tiny` alone
is a shape check: its warm start is too short for the tiny model to answer `math`, so its groups carry no
reward signal and the run stops after rl.max_skipped_steps steps, saying so. The model and mesh blocks come
from `configs/tiny.py` / `configs/small.py`, which get the arguments after the first, comma-separated
(`configs/grpo.py:test,deepseek` is the test variant on tiny's DeepSeek-V3-like model); with `rl.init_from`
the model is a Hugging Face checkpoint's instead. Everything the main job adds lives under `cfg.rl`, built
from the table `configs.fields.RL` (each field's default, meaning and allowed values; `python -m
configs.fields` prints it, and the README's field list is that output):

  rl.loss       the GRPO objective (`configs.fields.LOSS`, read by `rl.grpo.loss_from_config`)
  rl.optim      AdamW + warmup/cosine schedule + clipping (`configs.fields.OPTIM`)
  rl.engine     the decoding engine (`configs.engine.EngineConfig`, its defaults) and its speculative drafter
  rl.sft        the warm start; rl.eval the held-out evaluation
  rl.*          batch geometry, updates, domains and curriculum, rollout, pipeline, checkpoints

`rl/validate.py` checks a config against the table, then the rules that tie fields together, before the
main job does any work.
"""

import ml_collections

from configs import schema, small, tiny
from configs.fields import RL, SMALL

MODELS = {"tiny": tiny, "small": small}


# test: the tiny model on the `debug` domain, small budgets (tests/test_train.py).
# demo: `make demo`, a ~0.66M-parameter MoE that learns two toy domains on a CPU in minutes.
VARIANTS = ("test", "demo")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    name, _, model_arg = (arg or "tiny").partition(",")
    if name in VARIANTS:
        return _variant(name, model_arg)
    if name not in MODELS:
        raise ValueError(
            f"configs/grpo.py: unknown argument {name!r}; use one of {sorted(MODELS) + list(VARIANTS)}, "
            "optionally followed by the model file's arguments (test,deepseek)"
        )
    cfg = MODELS[name].get_config(model_arg or None)
    rl = cfg.rl = schema.build(RL)
    if name == "small":
        for dotted, value in SMALL.items():
            schema.set_path(rl, dotted, value)
    return _with_sizes(cfg)


def _variant(name: str, model_arg: str = "") -> ml_collections.ConfigDict:
    cfg = get_config(",".join(("tiny", model_arg)) if model_arg else "tiny")
    rl = cfg.rl
    if name == "test":
        # "Reply with: ok": a few SFT steps make the tiny model answer right most of the time, so some groups
        # carry a reward signal; the domain is deliberately non-deterministic, so no quality gate.
        rl.domains = ("debug",)
        rl.quality_gate = False
        rl.sft.steps, rl.sft.rows = 6, 8
        rl.steps, rl.checkpoint_every = 4, 2
        rl.prompts_per_step, rl.group_size = 2, 4
        rl.max_prompt_len, rl.max_new_tokens = 24, 8
        rl.env_workers = 1
        rl.optim.lr, rl.optim.warmup_steps = 3e-3, 1
        rl.tensorboard = False
        # Two layers compile faster unrolled than under the layer scan (whose autodiff stacks every
        # per-layer residual with its own update and slice kernels). `configs/tiny.py` itself and the pod
        # configs scan.
        cfg.model.scan_layers = False
        # Prefill in batches of 4 rows only: 2 prefill programs (16 and 32 tokens) to compile instead of 6
        # (batches of 1, 2 and 4); the 8 prompts of a step fill them anyway.
        rl.engine.min_prefill_batch = 4
    if name == "demo":
        _demo(cfg)
    return _with_sizes(cfg)


def _with_sizes(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`cfg` with the batch and sequence sizes (the planner's, the demo's) the rl block gives."""
    rl = cfg.rl
    cfg.batch_size = rl.prompts_per_step * rl.group_size
    cfg.seq_len = rl.max_prompt_len + rl.max_new_tokens
    return cfg


def _demo(cfg: ml_collections.ConfigDict) -> None:
    """The mission domain `math` at its easiest level (-1: "Compute 47 + 8.", answered in \\boxed{}) beside
    the toy `strings` levels 2-3 ("rev kqbdx=", "sort kqbdxa="); benchmarks/demo_recipe.py runs the same
    recipe on the selection split. A short warm start on a noisy teacher's demonstrations (65% with one
    digit, or for strings one letter, wrong) leaves the model knowing the skill (greedy mostly right) but
    sampling near misses (pass@1 at temperature 1 far below pass@k), the gap GRPO turns into pass@1.
    Held out: 150 distinct prompts per domain."""
    m, rl = cfg.model, cfg.rl
    m.d_model, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim = 128, 2, 4, 2, 32
    m.d_ff = 256
    m.moe.num_experts, m.moe.top_k, m.moe.d_ff, m.moe.shared_d_ff = 4, 2, 128, 128
    rl.domains = ("math", "strings")
    rl.levels = ml_collections.ConfigDict({"math": (-1,), "strings": (2, 3)})
    rl.curriculum_floor = 0.25
    rl.max_prompt_len, rl.max_new_tokens = 40, 12
    rl.prompts_per_step, rl.group_size = 16, 8
    rl.steps, rl.checkpoint_every = 300, 50
    rl.optim.update(lr=3e-4, warmup_steps=30, total_steps=300, b2=0.999)
    rl.sft.steps, rl.sft.rows, rl.sft.noise = 1500, 64, 0.65
    rl.sft.weights = ml_collections.ConfigDict({"math": 48, "strings": 16})
    rl.sft.optim = ml_collections.ConfigDict({"lr": 3e-3, "warmup_steps": 5, "total_steps": 1500})
    rl.engine.update(max_batch=128, prefill_chunk=16, prefill_batch=16, min_bucket=16)
    rl.eval.n_tasks, rl.eval.k = 150, 4
    rl.tensorboard = False
