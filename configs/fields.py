"""python -m configs.fields [--write README.md]   (prints / rewrites the README's field list)

Every config field in one place: its default, what it does and its allowed values (`configs.schema.Field`).
`MODEL` is the `model` block of every config (`configs/base.py`); `RL` is what the main job adds under
`cfg.rl` (`configs/grpo.py`), with `LOSS` (`rl.loss`, read by `rl.grpo.loss_from_config`), `OPTIM`
(`rl.optim`, read by `rl.train_state.make_schedule`) and the `rl.engine` sizes, whose defaults are
`configs.engine.EngineConfig`'s. `SMALL` has the `:small` config's values where they differ.

Data only: no import of ours but `configs`. A choice implemented by a registry elsewhere (attention impls,
GRPO variants, environments) is listed here as plain strings, the registry's built-in names;
`rl/validate.py` checks the chosen name against the registry itself before any work. Rules that tie fields
together (a divisor of the batch, a domain named in two places) stay with the code that needs them
(`model/config.py`, `rl/validate.py`).
"""

from __future__ import annotations

import dataclasses
import sys

from configs import schema
from configs.engine import SCHEDULERS, EngineConfig
from configs.schema import Block, Bool, Choice, ConfigError, Field, Float, Int, Ints, Registered, Text

DTYPES = ("float32", "bfloat16", "float16")

# Built-in names of the registries a choice picks from (sorted, as the errors list them).
ATTENTION_IMPLS = ("auto", "chunked", "flash", "query_blocked", "reference", "ring")  # model.attention
ADVANTAGES = ("batch", "group", "none")  # rl.grpo.ADVANTAGES
RATIOS = ("sequence", "token")  # rl.grpo.RATIOS
AGGREGATIONS = ("seq-mean-token-mean", "seq-mean-token-sum-norm", "token-mean")  # rl.grpo.AGGREGATIONS
KL_KINDS = ("k1", "k3", "none")  # rl.grpo.KL, and "none"
CORRECTIONS = ("icepop", "none", "seq-mask", "seq-reject", "tis")  # rl.grpo.CORRECTIONS
# envs.registry.BUILTIN, and the entry-point group through which installed packages add domains
DOMAINS = ("arith", "code", "debug", "finance", "math", "scene3d", "strings", "terminal")
ENTRY_POINT_GROUP = "moe_post_train.environments"

# Every model field. Rules tying fields together (heads divisible by kv heads, top_k <= num_experts, sizes
# divisible by mesh axes) are in model/config.py.
MODEL = {
    "vocab_size": Int(256, "token vocabulary size", lo=1),
    "d_model": Int(64, "residual stream width", lo=1),
    "num_layers": Int(2, "transformer blocks", lo=1),
    "num_heads": Int(4, "query heads (a multiple of num_kv_heads)", lo=1),
    "num_kv_heads": Int(2, "key/value heads (GQA)", lo=1),
    "head_dim": Int(16, "width of one attention head (even, for RoPE)", lo=2),
    "d_ff": Int(128, "width of dense (non-MoE) SwiGLU layers", lo=1),
    "norm_eps": Float(1e-6, "RMSNorm epsilon", lo=0, lo_open=True),
    "tie_embeddings": Bool(False, "the output projection is the embedding matrix"),
    "qk_norm": Bool(False, "Qwen3-style per-head RMSNorm on queries and keys"),
    "attention_impl": Registered(
        "auto",
        "auto: flash on TPU/GPU, chunked elsewhere (model/attention.py)",
        ATTENTION_IMPLS,
        "model.attention.ATTENTION_IMPLS",
    ),
    "attention_bias": Bool(False, "a bias on the q/k/v projections (Qwen2)"),
    "attention_kind": Choice(
        "gqa", "gqa: grouped-query attention; mla: multi-head latent attention (DeepSeek-V3)", ("gqa", "mla")
    ),
    "mla.q_lora_rank": Int(0, "mla: width of the query low-rank path; 0: a full query projection", lo=0),
    "mla.kv_lora_rank": Int(32, "mla: width of the compressed KV latent (what the cache holds)", lo=1),
    "mla.qk_nope_head_dim": Int(16, "mla: per-head query/key width without RoPE", lo=1),
    "mla.qk_rope_head_dim": Int(
        8, "mla: query/key RoPE width, the key part shared by all heads (even)", lo=2
    ),
    "mla.v_head_dim": Int(16, "mla: per-head value width", lo=1),
    "mla.rope_interleave": Bool(
        True, "mla: RoPE pairs are adjacent dims (x0, x1) as in DeepSeek checkpoints"
    ),
    "rope.theta": Float(10_000.0, "RoPE base", lo=0, lo_open=True),
    "rope.scaling": Choice("none", "context extension of RoPE", ("none", "linear", "llama3", "yarn")),
    "rope.factor": Float(1.0, "context extension factor (scaling != none)", lo=1),
    "rope.original_max_position": Int(4096, "pre-training context of a scaled RoPE", lo=1),
    "rope.low_freq_factor": Float(1.0, "llama3 scaling: low-frequency band edge", lo=0, lo_open=True),
    "rope.high_freq_factor": Float(
        4.0, "llama3 scaling: high-frequency band edge (> low)", lo=0, lo_open=True
    ),
    "rope.beta_fast": Float(32.0, "yarn scaling: fast ramp edge (rotations)", lo=0, lo_open=True),
    "rope.beta_slow": Float(1.0, "yarn scaling: slow ramp edge (rotations)", lo=0, lo_open=True),
    "rope.mscale": Float(
        0.0, "yarn: cos/sin scale numerator coefficient (0 with mscale_all_dim 0: default)", lo=0
    ),
    "rope.mscale_all_dim": Float(
        0.0, "yarn: cos/sin scale denominator; mla also scales the softmax by its mscale^2 (DeepSeek)", lo=0
    ),
    "moe.num_experts": Int(0, "routed experts per MoE layer; 0: every layer is dense", lo=0),
    "moe.top_k": Int(2, "experts per token (<= num_experts)", lo=1),
    "moe.d_ff": Int(128, "width of one routed expert", lo=1),
    "moe.num_shared_experts": Int(0, "experts every token goes through", lo=0),
    "moe.shared_d_ff": Int(128, "width of one shared expert", lo=1),
    "moe.first_dense_layers": Int(0, "the first N layers use the dense MLP (DeepSeek/Kimi style)", lo=0),
    "moe.router": Choice(
        "softmax", "sigmoid: DeepSeek-V3 scores with a selection bias", ("softmax", "sigmoid")
    ),
    "moe.n_group": Int(1, "group-limited routing: expert groups (DeepSeek-V3: 8); 1: plain top-k", lo=1),
    "moe.topk_group": Int(1, "group-limited routing: groups a token may use (<= n_group)", lo=1),
    "moe.renormalize": Bool(True, "renormalise the top-k weights to sum to one"),
    "moe.routed_scaling": Float(1.0, "multiplies the routed output (DeepSeek-V3: 2.5)", lo=0, lo_open=True),
    "moe.impl": Choice(
        "ragged", "ragged (dropless) or capacity (fixed slots per expert)", ("ragged", "capacity")
    ),
    "moe.capacity_factor": Float(
        1.25, "capacity impl: slots per expert = factor * tokens * top_k / E", lo=0, lo_open=True
    ),
    "moe.expert_parallel": Choice(
        "auto",
        "with experts sharded: auto (shard_map + all-to-all where the layout allows, else GSPMD), "
        "shard_map (refuse layouts it cannot run), gspmd",
        ("auto", "shard_map", "gspmd"),
    ),
    "moe.ep_exchange": Choice(
        "auto",
        "the expert-parallel shard_map's all-to-all: padded (every slot sent), ragged "
        "(jax.lax.ragged_all_to_all, only the filled slots; TPU/GPU, not yet run on any); auto: padded",
        ("auto", "padded", "ragged"),
    ),
    "moe.ep_capacity_factor": Float(
        0.0,
        "expert-parallel shard_map: slots per (sender, receiver) shard pair "
        "C = ceil(factor * T' * top_k / J) (T' tokens per shard, J expert shards); assignments past C are "
        "dropped and counted (moe/dropped_fraction); 0: dropless, C = T' * min(top_k, experts per shard)",
        lo=0,
    ),
    "moe.gather_max_tokens": Int(
        0,
        "token counts (batch x length) at or below this gather each token's top-k experts' weights instead "
        "of sort/dispatch; -1: while tokens * top_k <= num_experts; 0: never",
        lo=-1,
    ),
    "moe.every_expert_max_tokens": Int(
        -1,
        "token counts (batch x length) at or below this run every expert on every token (three matmuls over "
        "the stacked experts, the top-k routing weights zeroing the rest) instead of sort/dispatch; -1: in "
        "the decoding engine's calls of up to max_batch x (num_draft + 1) tokens, never training; 0: never",
        lo=-1,
    ),
    "moe.load_balance_weight": Float(0.01, "weight of the load-balancing auxiliary loss", lo=0),
    "moe.z_loss_weight": Float(1e-3, "weight of the router z-loss", lo=0),
    "moe.bias_update_rate": Float(1e-3, "aux-loss-free balancing: step size of the selection bias", lo=0),
    "mtp_layers": Int(
        0,
        "multi-token-prediction modules after the last layer (DeepSeek-V3: 1; HF num_nextn_predict_layers)",
        lo=0,
    ),
    "scan_layers": Bool(
        True, "one scanned block per layer kind: one layer compiled, not L (2 compile faster unrolled)"
    ),
    "remat": Choice(
        "none", "activation recomputation in the backward pass", ("none", "full", "dots_saveable")
    ),
    "param_dtype": Choice("float32", "dtype of the stored parameters", DTYPES),
    "compute_dtype": Choice("float32", "dtype of activations and matmuls", DTYPES),
}


# The `rl.loss` block: the GRPO objective.
LOSS = {
    "clip_low": Float(0.2, "the ratio is clipped below at 1 - clip_low (PPO)", lo=0),
    "clip_high": Float(0.28, "... and above at 1 + clip_high (DAPO clip-higher: > clip_low)", lo=0),
    "ratio": Registered(
        "token", "token ratios, or GSPO's length-normalised sequence ratio", RATIOS, "rl.grpo.RATIOS"
    ),
    "aggregation": Registered(
        "token-mean", "how token losses become the batch loss", AGGREGATIONS, "rl.grpo.AGGREGATIONS"
    ),
    "max_tokens": Int(0, "the constant divisor of seq-mean-token-sum-norm (> 0 there, else unused)", lo=0),
    "kl_kind": Registered("none", "KL estimator to the frozen step-0 reference", KL_KINDS, "rl.grpo.KL"),
    "kl_coef": Float(0.0, "weight of the KL term", lo=0),
    "correction": Registered(
        "tis",
        "weights from the sampler's log-probs (train-inference mismatch)",
        CORRECTIONS,
        "rl.grpo.CORRECTIONS",
    ),
    "correction_low": Float(
        0.5, "lower edge of the icepop / seq-mask / seq-reject band", lo=0, hi=1, lo_open=True
    ),
    "correction_high": Float(2.0, "upper edge of that band", lo=1),
    "tis_cap": Float(2.0, "cap of tis and seq-mask weights; tis with 0 is off", lo=0),
}


OPTIM = {
    "lr": Float(
        3e-4, "peak learning rate (RL on a pretrained model: ~1e-6..1e-5; small: 1e-5)", lo=0, lo_open=True
    ),
    "b1": Float(0.9, "Adam first-moment decay", lo=0, hi=1, hi_open=True),
    "b2": Float(0.999, "Adam second-moment decay", lo=0, hi=1, hi_open=True),
    "eps": Float(1e-8, "Adam denominator epsilon", lo=0, lo_open=True),
    "weight_decay": Float(0.01, "decoupled weight decay (AdamW), scaled by the scheduled lr", lo=0),
    "warmup_steps": Int(10, "linear warmup: step s < warmup_steps uses lr * (s + 1) / warmup_steps", lo=0),
    "total_steps": Int(1000, "cosine decay ends here (> warmup_steps); min_lr_ratio * lr after", lo=1),
    "min_lr_ratio": Float(0.1, "final lr as a fraction of the peak", lo=0, hi=1),
    "max_grad_norm": Float(1.0, "global-norm gradient clipping before AdamW", lo=0, lo_open=True),
}


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
        return (
            f"distinct names: {', '.join(repr(c) for c in self.allowed())}, an entry point of group "
            f"'{ENTRY_POINT_GROUP}' or an import path 'package.module:Class'"
        )


_WEIGHT = Float(0.0, "", lo=0)

# Every `rl.*` field: default (the tiny config's; `SMALL` has the small one's), meaning, allowed values. Rules
# tying fields together (divisors of the batch, domains named in two places, a draft model's vocab) are in
# rl/validate.py.
RL = {
    **{f"loss.{k}": f for k, f in LOSS.items()},
    **{f"optim.{k}": f for k, f in OPTIM.items()},
    # --- where the weights come from
    "init_from": Text(
        "",
        'Hugging Face checkpoint dir to post-train ("": random init): model.* becomes its config.json\'s,'
        " dtypes included (only model.io.hf_config.RUNTIME_FIELDS, e.g. scan_layers, remat, moe.impl,"
        ' stay this config\'s); its tokenizer.json is used when rl.tokenizer is ""; a resumed run'
        " restores its own checkpoint (python -m rl.export writes a run back as one)",
    ),
    # --- batch geometry and sampling
    "seed": Int(0, "model init, task streams, sampling keys: any size, hashed into each RNG's domain", lo=0),
    "steps": Int(20, "GRPO steps (small: 500)", lo=0),
    "prompts_per_step": Int(4, "groups per step; the batch is this * group_size rows (small: 16)", lo=1),
    "group_size": Int(8, "completions per prompt; advantages are relative within a group (1 has none)", lo=2),
    "max_prompt_len": Int(160, "prompt token budget (small: 256)", lo=1),
    "max_new_tokens": Int(32, "completion tokens sampled per prompt (small: 256)", lo=1),
    "temperature": Float(
        1.0, "sampling temperature; the trainer's log-probs use the same", lo=0, lo_open=True
    ),
    "top_p": Float(
        1.0, "nucleus filter (1: off); the trainer's log-probs use the same", lo=0, hi=1, lo_open=True
    ),
    "top_k": Int(0, "top-k filter (0: off); the trainer's log-probs use the same", lo=0),
    "advantage_std": Registered(
        "group", "advantage scale: group, batch or none (Dr. GRPO)", ADVANTAGES, "rl.grpo.ADVANTAGES"
    ),
    # --- updates
    "micro_batches": Int(1, "gradient accumulation: micro-batches of one optimizer step (exact)", lo=1),
    "ppo_epochs": Int(1, "passes over each rollout batch (clipping engages from the second update)", lo=1),
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
        choices=DOMAINS,
    ),
    "levels": Block("domain -> difficulty levels to draw from (default: all)", value=Ints("levels", lo=-1)),
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
    "static_weights": Block("domain -> weight, for curriculum=static (default: equal)", value=_WEIGHT),
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
    # --- decoding engine (configs.engine.EngineConfig, whose defaults these are) and speculative drafts;
    # decode_steps 0 is the main job's own default, resolved by rl.validate.engine_config
    "engine.max_batch": Int(EngineConfig.max_batch, "decode slots (small: 64)", lo=1),
    "engine.page_size": Int(EngineConfig.page_size, "tokens per KV page", lo=1),
    "engine.num_pages": Int(
        EngineConfig.num_pages, "KV pool pages (0: room for max_batch sequences + the prefix cache)", lo=0
    ),
    "engine.prefix_cache_pages": Int(
        EngineConfig.prefix_cache_pages, "pages the prefix cache keeps (0: off; -1: half the slots')", lo=-1
    ),
    "engine.host_cache_pages": Int(
        EngineConfig.host_cache_pages, "host-tier pages for cold prefix blocks (0: off)", lo=0
    ),
    "engine.prefill_chunk": Int(
        EngineConfig.prefill_chunk, "longest prefill call, a power of two (small: 256)", lo=1
    ),
    "engine.prefill_batch": Int(EngineConfig.prefill_batch, "rows per prefill call, a power of two", lo=1),
    "engine.min_prefill_batch": Int(
        EngineConfig.min_prefill_batch,
        "fewest rows per prefill call (fewer are padded), a power of two <= prefill_batch",
        lo=1,
    ),
    "engine.min_bucket": Int(
        EngineConfig.min_bucket, "shortest prefill / score length bucket, a power of two", lo=1
    ),
    "engine.score_batch": Int(EngineConfig.score_batch, "rows per scoring call, a power of two", lo=1),
    "engine.decode_steps": Int(
        0,
        "decode steps per device call of plain decoding, or speculative steps with draft='model' (a "
        "finished row idles at most this - 1); 0: 8 without a drafter or with draft='model', 1 with the "
        "others (their proposals come from the host: one call per speculative step)",
        lo=0,
    ),
    "engine.scheduler": Choice(EngineConfig.scheduler, "continuous batching or static batches", SCHEDULERS),
    "engine.mesh.processes": Int(
        1,
        "processes one engine spans, run in lockstep (1: an engine per process; 0: one engine over all)",
        lo=0,
    ),
    "engine.mesh.expert": Int(0, "expert-parallel size of each engine (0: mesh.shape.expert)", lo=0),
    "engine.mesh.tensor": Int(0, "tensor-parallel size of each engine (0: mesh.shape.tensor)", lo=0),
    "engine.cache_dtype": Choice(
        EngineConfig.cache_dtype, 'KV cache dtype ("": model.compute_dtype)', ("", *DTYPES)
    ),
    "engine.draft": Choice(
        "none",
        "speculative drafter: none, ngram, group (the prompt's other samples), model, mtp (the "
        "model's own MTP head: model.mtp_layers >= 1)",
        ("none", "ngram", "group", "model", "mtp"),
    ),
    "engine.num_draft": Int(EngineConfig.num_draft, "tokens proposed per speculative step", lo=1),
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
    "sft.weights": Block("domain -> share of SFT rows (default: the curriculum's)", value=_WEIGHT),
    "sft.optim": Block("overrides of rl.optim for the SFT phase", of=OPTIM),
    "eval.n_tasks": Int(8, "held-out tasks per domain, before and after training (small: 64)", lo=1),
    "eval.k": Int(4, "samples per task (pass@1 over all, pass@k)", lo=1),
    "eval.greedy": Bool(
        True, "also one greedy completion per held-out task: the table's greedy accuracy before and after"
    ),
}


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


def markdown() -> str:
    """The README's field list: one row per field of `MODEL` and `RL`."""
    rows = ["| field | allowed | default | what it does |", "|---|---|---|---|"]
    for prefix, table in (("model", MODEL), ("rl", RL)):
        for name, f in table.items():
            default = "" if f.kind == "block" and not f.default else f"`{_default(f.default)}`"
            rows.append(f"| `{prefix}.{name}` | {f.describe()} | {default} | {f.doc} |")
    return "\n".join(rows) + "\n"


def _default(value, prefix: str = "") -> str:
    if isinstance(value, dict):
        return ", ".join(_default(v, f"{prefix}{k}.") for k, v in value.items()) or "{}"
    return f"{prefix[:-1]}={value!r}" if prefix else repr(value)


BEGIN, END = "<!-- fields:begin (python -m configs.fields --write README.md) -->", "<!-- fields:end -->"


def write(path: str) -> None:
    """Replaces the field list between the BEGIN and END markers of `path` (the README)."""
    schema.write_between(path, BEGIN, END, markdown())


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"] and len(sys.argv) == 3:
        write(sys.argv[2])
    elif len(sys.argv) == 1:
        print(markdown(), end="")
    else:
        raise SystemExit("usage: python -m configs.fields [--write README.md]")
