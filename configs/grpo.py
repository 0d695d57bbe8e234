"""python -m rl.train --config=configs/grpo.py:test --workdir=runs/test

GRPO post-training of the `tiny` (tests, CPU) or `small` (Colab) MoE model: `configs/grpo.py:small`, and the
variants `test` (learns in a minute on a CPU) and `demo` (`make demo`), both of the tiny model. `:tiny` alone
is a shape check: its warm start is too short for the tiny model to answer `math`, so its groups carry no
reward signal and the run stops after rl.max_skipped_steps steps, saying so. The model and mesh blocks come
from `configs/tiny.py` / `configs/small.py`, which get the arguments after the first, comma-separated
(`configs/grpo.py:test,deepseek` is the test variant on tiny's DeepSeek-V3-like model); with `rl.init_from`
the model is a Hugging Face checkpoint's instead. Everything the main job adds lives under `cfg.rl`, built
from the table `RL` (each field's default, meaning and allowed values; `python -m configs.schema` prints it,
and the README's field list is that output):

  rl.loss       the GRPO objective (`rl.grpo.LOSS`, read by `rl.grpo.loss_from_config`)
  rl.optim      AdamW + warmup/cosine schedule + clipping (`rl.train_step.OPTIM`)
  rl.engine     the decoding engine (`inference.EngineConfig`) and its speculative drafter
  rl.sft        the warm start; rl.eval the held-out evaluation
  rl.*          batch geometry, updates, domains and curriculum, rollout, pipeline, checkpoints

`rl/validate.py` checks a config against the table, then the rules that tie fields together, before the
main job does any work.
"""

import dataclasses

import ml_collections

from configs import schema, small, tiny
from configs.base import DTYPES, MODEL
from configs.schema import Block, Bool, Choice, ConfigError, Field, Float, Int, Ints, Text

MODELS = {"tiny": tiny, "small": small}


# test: the tiny model on the `debug` domain, small budgets (tests/test_train.py).
# demo: `make demo`, a ~0.66M-parameter MoE that learns two toy domains on a CPU in minutes.
VARIANTS = ("test", "demo")


def _domains() -> tuple:
    from envs import registry  # late: configs stay importable without the environments

    return tuple(sorted(registry.BUILTIN))


@dataclasses.dataclass(frozen=True)
class _Domains(Field):
    """rl.domains: distinct domain names, each built in, an installed entry point or an import path
    "package.module:Class" (`envs.registry`). The table checks the shape; `rl/validate.py` resolves each
    name (imports it) and says what is wrong with one that does not resolve."""

    def check(self, path: str, v) -> None:
        names = isinstance(v, (tuple, list)) and v and all(isinstance(d, str) and d.strip() for d in v)
        if not names or len(set(v)) != len(v):
            raise ConfigError(
                f"{path}={v!r} must be a non-empty tuple of distinct domain names ({self.describe()})"
            )

    def describe(self) -> str:
        from envs import registry

        return (
            f"distinct names: {', '.join(repr(c) for c in self.allowed())}, an entry point of group "
            f"'{registry.ENTRY_POINT_GROUP}' or an import path 'package.module:Class'"
        )


def _rl_table() -> dict:
    """Every `rl.*` field: default (the tiny config's; `SMALL` has the small one's), meaning, allowed values.
    Rules tying fields together (divisors of the batch, domains named in two places, a draft model's vocab)
    are in rl/validate.py."""
    from rl import grpo, train_step  # lazy: `configs` stays importable without the trainer

    weight = Float(0.0, "", lo=0)
    return {
        **{f"loss.{k}": f for k, f in grpo.LOSS.items()},
        **{f"optim.{k}": f for k, f in train_step.OPTIM.items()},
        # --- where the weights come from
        "init_from": Text(
            "",
            'Hugging Face checkpoint dir to post-train ("": random init): model.* becomes its config.json\'s,'
            " dtypes included (only model.hf_config.RUNTIME_FIELDS, e.g. scan_layers, remat, moe.impl, stay"
            ' this config\'s); its tokenizer.json is used when rl.tokenizer is ""; a resumed run restores its'
            " own checkpoint (python -m rl.export writes a run back as one)",
        ),
        # --- batch geometry and sampling
        "seed": Int(
            0, "model init, task streams, sampling keys: any size, hashed into each RNG's domain", lo=0
        ),
        "steps": Int(20, "GRPO steps (small: 500)", lo=0),
        "prompts_per_step": Int(4, "groups per step; the batch is this * group_size rows (small: 16)", lo=1),
        "group_size": Int(
            8, "completions per prompt; advantages are relative within a group (1 has none)", lo=2
        ),
        "max_prompt_len": Int(160, "prompt token budget (small: 256)", lo=1),
        "max_new_tokens": Int(32, "completion tokens sampled per prompt (small: 256)", lo=1),
        "temperature": Float(
            1.0, "sampling temperature; the trainer's log-probs use the same", lo=0, lo_open=True
        ),
        "top_p": Float(
            1.0, "nucleus filter (1: off); the trainer's log-probs use the same", lo=0, hi=1, lo_open=True
        ),
        "top_k": Int(0, "top-k filter (0: off); the trainer's log-probs use the same", lo=0),
        "advantage_std": Choice(
            "group", "advantage scale: group, batch or none (Dr. GRPO)", schema.registered(grpo.ADVANTAGES)
        ),
        # --- updates
        "micro_batches": Int(1, "gradient accumulation: micro-batches of one optimizer step (exact)", lo=1),
        "ppo_epochs": Int(
            1, "passes over each rollout batch (clipping engages from the second update)", lo=1
        ),
        "mini_batches": Int(1, "optimizer steps per pass (the batch's rows split evenly)", lo=1),
        "routing_replay": Bool(False, "the training forward replays the experts the engine chose (MoE only)"),
        "mismatch_band": Float(
            2.0, "mismatch metrics count trainer/sampler ratios outside [1/c, c]", lo=1, lo_open=True
        ),
        "reference_dtype": Choice(
            "", 'dtype of the frozen KL reference copy ("": the params\')', ("", "float32", "bfloat16")
        ),
        # --- domains and curriculum
        "domains": _Domains(
            ("math",),
            "task domains; a domain's name in metrics and in rl.levels / rl.env / rl.static_weights / "
            "rl.sft.weights is the name as written here (README: Your own environment)",
            "names",
            choices=_domains,
        ),
        "levels": Block(
            "domain -> difficulty levels to draw from (default: all)", value=Ints("levels", lo=-1)
        ),
        "data.holdout": Float(
            0.125, "fraction of prompts held out (eval split: reported only)", lo=0, hi=1, lo_open=True
        ),
        "data.selection": Float(
            0.125,
            "fraction of prompts kept for choosing recipes (selection split; holdout + selection < 1)",
            lo=0,
            hi=1,
            hi_open=True,
        ),
        "curriculum": Choice(
            "adaptive", "adaptive (reward gain per unit of compute) or static weights", ("adaptive", "static")
        ),
        "static_weights": Block("domain -> weight, for curriculum=static (default: equal)", value=weight),
        "curriculum_floor": Float(
            0.1, "exploration floor of every domain's weight (floor * domains <= 1)", lo=0, hi=1
        ),
        "curriculum_window": Int(192, "adaptive: observations per domain in the gain regression", lo=3),
        "curriculum_half_life": Float(
            48.0, "adaptive: steps after which an observation counts half", lo=0, lo_open=True, inf_ok=True
        ),
        "curriculum_warmup": Int(
            16, "adaptive: observations before a domain's estimate counts (<= window)", lo=0
        ),
        "curriculum_z": Float(1.0, "adaptive: standard errors by which gain differences shrink", lo=0),
        "curriculum_saturation_z": Float(
            3.0, "adaptive: z of 'still gaining' and of a lead that saturates a domain", lo=0
        ),
        "curriculum_max_step": Float(
            0.01, "adaptive: largest change of a weight per step", lo=0, hi=1, lo_open=True
        ),
        "curriculum_temperature": Float(1.0, "adaptive: shares ~ score ** (1 / T)", lo=0, lo_open=True),
        "curriculum_token_cost": Float(1.0, "compute of one generated token", lo=0),
        "curriculum_sandbox_second_cost": Float(1000.0, "compute of one sandbox second, in tokens", lo=0),
        "gradient_projection": Bool(
            False, "PCGrad between domains' gradients (one backward per domain; >= 2 domains)"
        ),
        "quality_gate": Bool(True, "refuse domains that fail envs.qa (once, at start)"),
        "quality_gate_n": Int(4, "tasks per domain of the quality gate", lo=1),
        # --- rollout and environments
        "max_turns": Int(1, "model turns per episode in multi-turn domains (terminal)", lo=1),
        "chat": Bool(False, "format prompts with the tokenizer's chat template"),
        "tokenizer": Text("", 'Hugging Face tokenizer dir; "": byte-level (vocab_size)'),
        "env_workers": Int(2, "environment worker processes", lo=1),
        "env_timeout_s": Float(30.0, "seconds an environment step may take", lo=0, lo_open=True),
        "max_attempts": Int(4, "rollout rounds per batch to back-fill groups dropped by the filters", lo=1),
        "reward_tol": Float(1e-6, "rewards within this are equal for the zero-variance filter", lo=0),
        "max_skipped_steps": Int(
            20,
            "stop (saved, with the cause and counts) after this many steps in a row without an update "
            "(every group filtered out); 0: never",
            lo=0,
        ),
        "env": Block(
            "domain -> constructor kwargs (checked against its signature), e.g. rl.env.code.reward=fraction",
            {"code": {"reward": "all_or_nothing"}, "terminal": {"disturbance": False}},
        ),
        # --- where the engine runs, and how the weights reach it
        "sampler_devices": Int(
            0,
            "devices of each process kept for the engine (disaggregated: the trainer's mesh takes the rest); "
            "0: the engine shares the trainer's devices (colocated)",
            lo=0,
        ),
        "weight_sync_delta": Float(
            -1.0,
            "delta weight sync: push only parameters whose largest change since last pushed exceeds this "
            "(0: every changed one); negative: push all",
        ),
        # --- async pipeline, checkpoints, logs
        "async_rollout": Bool(False, "overlap sampling with training (bounded staleness)"),
        "max_staleness": Int(1, "policy versions a batch may lag the trainer (async); 0: on-policy", lo=0),
        "max_queue": Int(2, "batches the producer may run ahead (async)", lo=1),
        "checkpoint_every": Int(
            10, "steps between checkpoints (SIGTERM / Ctrl-C save the current step too)", lo=1
        ),
        "max_to_keep": Int(2, "checkpoints kept", lo=1),
        "log_every": Int(1, "steps between metric lines", lo=1),
        "log_samples": Int(
            2, "episodes per logged step written to samples.jsonl, kept and dropped ones each (0: none)", lo=0
        ),
        "tensorboard": Bool(True, "TensorBoard events too, when tensorboardX is installed"),
        # --- decoding engine (inference.EngineConfig) and speculative drafts
        "engine.max_batch": Int(32, "decode slots (small: 64)", lo=1),
        "engine.page_size": Int(16, "tokens per KV page", lo=1),
        "engine.num_pages": Int(
            0, "KV pool pages (0: room for max_batch sequences + the prefix cache)", lo=0
        ),
        "engine.prefix_cache_pages": Int(
            -1, "pages the prefix cache keeps (0: off; -1: half the slots')", lo=-1
        ),
        "engine.host_cache_pages": Int(0, "host-tier pages for cold prefix blocks (0: off)", lo=0),
        "engine.prefill_chunk": Int(64, "longest prefill call, a power of two (small: 256)", lo=1),
        "engine.prefill_batch": Int(4, "rows per prefill call, a power of two", lo=1),
        "engine.min_prefill_batch": Int(
            1, "fewest rows per prefill call (fewer are padded), a power of two <= prefill_batch", lo=1
        ),
        "engine.min_bucket": Int(16, "shortest prefill / score length bucket, a power of two", lo=1),
        "engine.score_batch": Int(8, "rows per scoring call, a power of two", lo=1),
        "engine.decode_steps": Int(
            0,
            "decode steps per device call of plain decoding, or speculative steps with draft='model' (a "
            "finished row idles at most this - 1); 0: 8 without a drafter or with draft='model', 1 with the "
            "others (their proposals come from the host: one call per speculative step)",
            lo=0,
        ),
        "engine.scheduler": Choice(
            "continuous", "continuous batching or static batches", ("continuous", "static")
        ),
        "engine.mesh.processes": Int(
            1,
            "processes one engine spans, run in lockstep (1: an engine per process; 0: one engine over all)",
            lo=0,
        ),
        "engine.mesh.expert": Int(0, "expert-parallel size of each engine (0: mesh.shape.expert)", lo=0),
        "engine.mesh.tensor": Int(0, "tensor-parallel size of each engine (0: mesh.shape.tensor)", lo=0),
        "engine.cache_dtype": Choice("", 'KV cache dtype ("": model.compute_dtype)', ("", *DTYPES)),
        "engine.draft": Choice(
            "none",
            "speculative drafter: none, ngram, group (the prompt's other samples), model, mtp (the "
            "model's own MTP head: model.mtp_layers >= 1)",
            ("none", "ngram", "group", "model", "mtp"),
        ),
        "engine.num_draft": Int(4, "tokens proposed per speculative step", lo=1),
        "engine.draft_ngram": Int(3, "longest suffix matched by the ngram and group drafters", lo=1),
        "draft_model": Block(
            "engine.draft=model: overrides of model.* for the draft", {"num_layers": 1}, of=MODEL
        ),
        "draft_train_steps": Int(1, "distillation steps of the draft model after each policy update", lo=0),
        # --- SFT warm start and evaluation
        "sft.steps": Int(20, "warm-start steps on reference solutions (small: 200)", lo=0),
        "sft.rows": Int(16, "rows per SFT step", lo=1),
        "sft.noise": Float(0.0, "fraction of demonstrations with one character wrong", lo=0, hi=1),
        "sft.mtp_weight": Float(
            0.0, "weight of the MTP modules' loss on the solution tokens (needs model.mtp_layers > 0)", lo=0
        ),
        "sft.weights": Block("domain -> share of SFT rows (default: the curriculum's)", value=weight),
        "sft.optim": Block("overrides of rl.optim for the SFT phase", of=train_step.OPTIM),
        "eval.n_tasks": Int(8, "held-out tasks per domain, before and after training (small: 64)", lo=1),
        "eval.k": Int(4, "samples per task (pass@1 over all, pass@k)", lo=1),
        "eval.greedy": Bool(
            True, "also one greedy completion per held-out task: the table's greedy accuracy before and after"
        ),
    }


RL = _rl_table()

# The small config's defaults where they differ from the tiny one's.
SMALL = {
    "optim.lr": 1e-5,
    "steps": 500,
    "prompts_per_step": 16,
    "max_prompt_len": 256,
    "max_new_tokens": 256,
    "engine.max_batch": 64,
    "engine.prefill_chunk": 256,
    "sft.steps": 200,
    "eval.n_tasks": 64,
}


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
    cfg.batch_size = rl.prompts_per_step * rl.group_size
    cfg.seq_len = rl.max_prompt_len + rl.max_new_tokens
    return cfg


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
        # per-layer residual with its own update and slice kernels): this config's main job 23.4 -> 19.8 s,
        # its GRPO update compile 6.5 -> 4.9 s. `configs/tiny.py` itself and the pod configs scan.
        cfg.model.scan_layers = False
        # Prefill in batches of 4 rows only: 2 prefill programs (16 and 32 tokens) instead of 6 (batches of 1,
        # 2 and 4), ~3 s less compiling per cold main job; the 8 prompts of a step fill them anyway.
        rl.engine.min_prefill_batch = 4
    if name == "demo":
        _demo(cfg)
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
