"""python -m rl.train --config=configs/grpo.py:tiny --workdir=runs/tiny

GRPO post-training of the `tiny` (tests, CPU) or `small` (Colab) MoE model: `configs/grpo.py:small`.
The model and mesh blocks come from `configs/tiny.py` / `configs/small.py`; everything the trainer adds
lives under `cfg.rl`:

  rl.loss       the GRPO objective, read by `rl.grpo.loss_from_config` (see `default_loss_config`)
  rl.optim      AdamW + warmup/cosine schedule + clipping, read by `rl.train_step.make_optimizer`
  rl.*          batch geometry and step options read by `rl.train_step` (documented below)

Other owners add their own blocks beside these (rollout, async, checkpoint).
"""

import ml_collections

from configs import small, tiny

MODELS = {"tiny": tiny, "small": small}


# test: the tiny model on the `debug` domain, small budgets (tests/test_train.py).
# demo: `make demo`, a ~0.66M-parameter MoE that learns two toy domains on a CPU in minutes.
VARIANTS = ("test", "demo")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    name = arg or "tiny"
    if name in VARIANTS:
        return _variant(name)
    if name not in MODELS:
        raise ValueError(
            f"configs/grpo.py: unknown argument {name!r}; use one of {sorted(MODELS) + list(VARIANTS)}"
        )
    from rl import grpo  # lazy: `configs` stays importable without pulling in the trainer

    cfg = MODELS[name].get_config()
    rl = cfg.rl = ml_collections.ConfigDict()

    # Clip ranges, ratio kind, aggregation, KL and truncated-IS cap; field docs in rl/grpo.py.
    rl.loss = grpo.default_loss_config()

    o = rl.optim = ml_collections.ConfigDict()
    # Peak learning rate. RL fine-tuning of a pretrained model wants ~1e-6..1e-5; the tiny model starts
    # from random weights in tests and demos, where 3e-4 makes visible progress in a few steps.
    o.lr = 3e-4 if name == "tiny" else 1e-5
    o.b1 = 0.9  # Adam first-moment decay
    o.b2 = 0.999  # Adam second-moment decay
    o.eps = 1e-8  # Adam denominator epsilon
    o.weight_decay = 0.01  # decoupled (AdamW), on every parameter, scaled by the scheduled lr
    o.warmup_steps = 10  # linear warmup: step s < warmup_steps uses lr * (s + 1) / warmup_steps
    o.total_steps = 1000  # cosine decay from lr (at warmup_steps) to min_lr_ratio * lr (at total_steps)
    o.min_lr_ratio = 0.1  # final lr as a fraction of the peak; held after total_steps
    o.max_grad_norm = 1.0  # global-norm gradient clipping, applied before AdamW

    # Gradient accumulation: the batch of one step is split into this many micro-batches (the batch size
    # must divide by it); grads add up exactly to the full-batch gradient (see rl/train_step.py).
    rl.micro_batches = 1
    # Sampling temperature: training log-probs are of logits / temperature, as the sampler saw them.
    rl.temperature = 1.0
    # Routing replay (R3): the engine records the experts each MoE layer chose for every sampled token and
    # the training forward replays them, so the ratio compares the same sparse sub-network on both sides.
    rl.routing_replay = False
    # PPO-style updates: passes over each rollout batch, and optimizer steps per pass (the batch's rows
    # split evenly). The proximal log-probs are computed once before the first update; with 1 and 1 the
    # current policy is the proximal one (ratio 1) and clipping never engages.
    rl.ppo_epochs = 1
    rl.mini_batches = 1
    # The train-inference mismatch metrics count tokens whose trainer/sampler ratio is outside [1/c, c].
    rl.mismatch_band = 2.0
    # KL to a frozen reference (rl.loss.kl_kind, kl_coef): the policy at step 0 (after SFT), kept as a
    # second copy of the parameters on the same devices: "" keeps their dtype, "bfloat16" halves the cost.
    rl.reference_dtype = ""
    rl.group_size = 8  # completions sampled per prompt (n); advantages are relative within a group
    rl.prompts_per_step = 4 if name == "tiny" else 16  # groups per step (batch = this * group_size)
    rl.advantage_std = "group"  # rl.grpo.group_advantages(std=...): group | batch | none (Dr. GRPO)
    # Prompt and completion budgets (byte-level tokens for the tiny model: math prompts are ~130 bytes).
    rl.max_prompt_len = 160 if name == "tiny" else 256
    rl.max_new_tokens = 32 if name == "tiny" else 256  # completion tokens sampled per prompt
    _add_loop_config(cfg, name)
    cfg.batch_size = rl.prompts_per_step * rl.group_size
    cfg.seq_len = rl.max_prompt_len + rl.max_new_tokens
    return cfg


def _add_loop_config(cfg: ml_collections.ConfigDict, name: str) -> None:
    """The main job's fields (rl/train.py): domains, rollout, async pipeline, checkpoints, SFT, evaluation."""
    rl = cfg.rl
    rl.seed = 0  # model init, task streams, sampling keys
    rl.steps = 20 if name == "tiny" else 500  # GRPO steps
    rl.domains = ("math",)  # task domains (envs.registry names)
    rl.levels = ml_collections.ConfigDict()  # domain -> difficulty levels to draw from (default: all)
    rl.curriculum = "adaptive"  # adaptive (reward gain per unit of compute) | static
    rl.static_weights = ml_collections.ConfigDict()  # domain -> weight, for curriculum="static"
    rl.curriculum_floor = 0.1  # exploration floor of every domain's sampling weight
    # Adaptive mode (rl/curriculum.py's docstring has the rule): each domain's reward gain per step and its
    # standard error from a discounted regression over its last `window` observations; weights move towards
    # the target the evidence supports, at most `max_step` per step.
    rl.curriculum_window = 192  # observations per domain in the regression (>= 3)
    rl.curriculum_half_life = 48.0  # steps after which an observation counts half (> 0; inf: no discount)
    rl.curriculum_warmup = 16  # observations before a domain's estimate counts (0..window)
    rl.curriculum_z = 1.0  # standard errors by which score differences shrink before setting shares (>= 0)
    rl.curriculum_saturation_z = 3.0  # z of "gaining" (score > z se) and of a lead that saturates a domain
    rl.curriculum_max_step = 0.01  # largest change of a weight per step (0, 1]
    rl.curriculum_temperature = 1.0  # shares ∝ score ** (1 / T): < 1 sharpens, > 1 flattens (> 0)
    rl.curriculum_token_cost = 1.0  # compute of one generated token (>= 0)
    rl.curriculum_sandbox_second_cost = 1000.0  # compute of one sandbox second, in tokens (>= 0)
    rl.quality_gate = True  # refuse domains that fail envs.qa (run once at start, n=quality_gate_n)
    rl.quality_gate_n = 4
    rl.top_p, rl.top_k = 1.0, 0  # sampling filters (temperature is rl.temperature)
    rl.max_turns = 1  # model turns per episode in multi-turn domains (terminal)
    rl.chat = False  # format prompts with the tokenizer's chat template
    rl.tokenizer = ""  # HF tokenizer dir; "" = byte-level (ByteTokenizer(vocab_size))
    rl.env_workers = 2  # environment worker processes
    rl.env_timeout_s = 30.0
    rl.max_attempts = 4  # rollout rounds per batch to back-fill groups dropped by the filters
    rl.reward_tol = 1e-6  # float rewards within this are "equal" for the zero-variance filter
    rl.async_rollout = False  # overlap sampling with training (bounded staleness)
    rl.max_staleness = 1  # versions a batch may lag the trainer (async); 0 = on-policy
    rl.max_queue = 2  # batches the producer may run ahead
    rl.log_samples = 2  # episodes per logged step written to <workdir>/samples.jsonl (0: none)
    rl.checkpoint_every = 10
    rl.max_to_keep = 2
    rl.log_every = 1
    rl.tensorboard = True  # when tensorboardX is installed
    e = rl.engine = ml_collections.ConfigDict()  # inference.EngineConfig fields
    e.max_batch = 32 if name == "tiny" else 64
    e.page_size = 16
    e.prefill_chunk = 64 if name == "tiny" else 256
    e.prefill_batch = 4
    e.min_bucket = 16
    # Speculative decoding in the rollout (exact: the samples' distribution is unchanged):
    # none | ngram (prompt lookup) | group (the other samples of the same prompt) | model (rl.draft_model).
    e.draft = "none"
    e.num_draft = 4  # tokens proposed per speculative step
    e.draft_ngram = 3  # longest suffix matched by the ngram and group drafters
    # The model drafter: overrides of cfg.model for the smaller draft model. It is warm-started by the same
    # SFT as the policy and kept in step with it: rl.draft_train_steps cross-entropy steps on the tokens
    # just sampled after each policy update, so acceptance does not decay as the policy moves.
    rl.draft_model = ml_collections.ConfigDict({"num_layers": 1})
    rl.draft_train_steps = 1
    # Environment options: rl.env.<domain>.<kwarg> goes to that domain's constructor in every worker and
    # in the trainer's task streams, e.g. --config.rl.env.code.reward=fraction (checked at start).
    # Blocks listed here can be set from the command line (absl adds no new keys); a config file may add any
    # domain's block (e.g. rl.env.math = {"train_jsonl": ..., "test_jsonl": ...} for GSM8K data).
    rl.env = ml_collections.ConfigDict()
    rl.env.code = ml_collections.ConfigDict({"reward": "all_or_nothing"})  # or "fraction" of tests passed
    rl.env.terminal = ml_collections.ConfigDict({"disturbance": False})  # True: the world changes mid-task
    sft = rl.sft = ml_collections.ConfigDict()  # warm start on reference solutions (no checkpoint yet)
    sft.steps = 20 if name == "tiny" else 200
    sft.rows = 16
    sft.noise = 0.0  # fraction of demonstrations with one character wrong (a noisy teacher)
    sft.weights = ml_collections.ConfigDict()  # domain -> share of SFT rows (default: the curriculum's)
    sft.optim = ml_collections.ConfigDict()  # overrides of rl.optim for the SFT phase (e.g. lr)
    ev = rl.eval = ml_collections.ConfigDict()  # held-out evaluation before and after training
    ev.n_tasks = 8 if name == "tiny" else 64  # per domain
    ev.k = 4  # samples per task (pass@1 over all samples, pass@k)


def _variant(name: str) -> ml_collections.ConfigDict:
    cfg = get_config("tiny")
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
    if name == "demo":
        _demo(cfg)
    cfg.batch_size = rl.prompts_per_step * rl.group_size
    cfg.seq_len = rl.max_prompt_len + rl.max_new_tokens
    return cfg


def _demo(cfg: ml_collections.ConfigDict) -> None:
    """The recipe found with benchmarks/demo_recipe.py: `arith` level 2 ("47+8=") and `strings` levels 2-3
    ("rev kqbdx=", "sort kqbdxa="); a short warm start on a noisy teacher's demonstrations (65% with one
    character wrong) leaves the model knowing the skill but sampling near misses (pass@1 at temperature 1
    far below pass@k), the gap GRPO turns into pass@1."""
    m, rl = cfg.model, cfg.rl
    m.d_model, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim = 128, 2, 4, 2, 32
    m.d_ff = 256
    m.moe.num_experts, m.moe.top_k, m.moe.d_ff, m.moe.shared_d_ff = 4, 2, 128, 128
    rl.domains = ("arith", "strings")
    rl.levels = ml_collections.ConfigDict({"arith": (2,), "strings": (2, 3)})
    rl.curriculum_floor = 0.25
    rl.max_prompt_len, rl.max_new_tokens = 16, 8
    rl.prompts_per_step, rl.group_size = 16, 8
    rl.steps, rl.checkpoint_every = 300, 50
    rl.optim.update(lr=3e-4, warmup_steps=30, total_steps=300, b2=0.999)
    rl.sft.steps, rl.sft.rows, rl.sft.noise = 1500, 64, 0.65
    rl.sft.weights = ml_collections.ConfigDict({"arith": 48, "strings": 16})
    rl.sft.optim = ml_collections.ConfigDict({"lr": 3e-3, "warmup_steps": 5, "total_steps": 1500})
    rl.engine.update(max_batch=128, prefill_chunk=16, prefill_batch=16, min_bucket=16)
    rl.eval.n_tasks, rl.eval.k = 200, 4
    rl.tensorboard = False
