"""The main job's config, checked in one place before any work (no pool, no model, no SFT: well under 1 s).

`validate(cfg)` raises a `ConfigError` naming the first bad field and the fix. It covers every `rl.*` block
the main job reads (batch geometry, loss, optimizer, updates, pipeline, engine and draft, evaluation, SFT,
curriculum, environment options) and the model config; `rl.train` and `rl.sft` call it first.
"""

from __future__ import annotations

import ml_collections

from model.config import ConfigError

DRAFTS = ("none", "ngram", "group", "model")
REFERENCE_DTYPES = ("", "float32", "bfloat16")
CURRICULA = ("adaptive", "static")
ENGINE_EXTRAS = ("draft", "draft_ngram")  # rl.engine fields the main job reads; the rest are EngineConfig's


def _check(ok: bool, field: str, value, why: str) -> None:
    if not ok:
        raise ConfigError(f"rl.{field}={value!r} {why}")


def _positive_ints(rl, fields: tuple[str, ...], *, minimum: int = 1) -> None:
    for f in fields:
        v = _get(rl, f)
        _check(
            isinstance(v, int) and not isinstance(v, bool) and v >= minimum,
            f,
            v,
            f"must be an int >= {minimum}",
        )


def _get(node, dotted: str):
    for part in dotted.split("."):
        node = node[part]
    return node


def engine_config(cfg: ml_collections.ConfigDict):
    """`inference.EngineConfig` of the main job: rl.engine less the draft fields, sized for seq_len, with
    routing recorded when rl.routing_replay is on."""
    from inference import EngineConfig

    fields = {k: v for k, v in cfg.rl.engine.items() if k not in ENGINE_EXTRAS}
    fields["max_seq_len"] = cfg.rl.max_prompt_len + cfg.rl.max_new_tokens
    if cfg.rl.routing_replay:
        fields["record_routing"] = True
    try:
        return EngineConfig.from_config(fields)
    except ValueError as e:
        raise ConfigError(f"rl.{e}" if str(e).startswith("engine") else f"rl.engine: {e}") from None


def draft_model_config(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The draft model's config: cfg with `model` updated by rl.draft_model."""
    draft = ml_collections.ConfigDict(cfg.to_dict())
    unknown = sorted(set(cfg.rl.draft_model) - set(cfg.model))
    if unknown:
        raise ConfigError(
            f"rl.draft_model has fields {unknown} that model has not; known: {sorted(cfg.model)}"
        )
    draft.model.update(cfg.rl.draft_model.to_dict())
    return draft


def validate(cfg: ml_collections.ConfigDict) -> None:
    """Raises ConfigError naming the first field that cannot work (see the module docstring)."""
    from envs import registry
    from model import config as model_config
    from rl import curriculum, grpo, train_step

    rl = cfg.rl
    model_config.validate_model(cfg.model)
    _positive_ints(rl, ("prompts_per_step", "max_prompt_len", "max_new_tokens", "ppo_epochs", "mini_batches"))
    _positive_ints(rl, ("micro_batches", "env_workers", "max_attempts", "max_turns", "max_queue"))
    _positive_ints(rl, ("checkpoint_every", "max_to_keep", "log_every", "eval.n_tasks", "eval.k", "sft.rows"))
    _positive_ints(
        rl, ("steps", "max_staleness", "sft.steps", "draft_train_steps", "quality_gate_n"), minimum=0
    )
    _positive_ints(rl, ("log_samples",), minimum=0)
    _positive_ints(rl, ("group_size",), minimum=2)
    _check(isinstance(rl.seed, int) and rl.seed >= 0, "seed", rl.seed, "must be an int >= 0 (any size)")
    rows = rl.prompts_per_step * rl.group_size
    _check(
        rows % rl.mini_batches == 0,
        "mini_batches",
        rl.mini_batches,
        f"must divide the batch of rl.prompts_per_step * rl.group_size = {rows} rows",
    )
    per = rows // rl.mini_batches
    _check(
        per % rl.micro_batches == 0,
        "micro_batches",
        rl.micro_batches,
        f"must divide a mini-batch of {per} rows (rl.mini_batches={rl.mini_batches})",
    )
    _check(rl.temperature > 0, "temperature", rl.temperature, "must be > 0: greedy samples have no log-prob")
    _check(isinstance(rl.top_k, int) and rl.top_k >= 0, "top_k", rl.top_k, "must be an int >= 0 (0 = off)")
    _check(0 < rl.top_p <= 1, "top_p", rl.top_p, "must be in (0, 1] (1 = off)")
    _check(rl.mismatch_band > 1, "mismatch_band", rl.mismatch_band, "must be > 1 (the band is [1/c, c])")
    _check(rl.env_timeout_s > 0, "env_timeout_s", rl.env_timeout_s, "must be > 0 seconds")
    _check(rl.reward_tol >= 0, "reward_tol", rl.reward_tol, "must be >= 0")
    _check(
        rl.advantage_std in grpo.ADVANTAGES,
        "advantage_std",
        rl.advantage_std,
        f"is unknown; choose one of {sorted(grpo.ADVANTAGES)}",
    )
    try:
        grpo.validate_loss_config(rl.loss)
        train_step._check_optim(rl.optim)
        sft_optim = ml_collections.ConfigDict(rl.optim.to_dict())
        sft_optim.update(rl.sft.optim.to_dict())
        train_step._check_optim(sft_optim)
    except ValueError as e:
        raise ConfigError(str(e).replace("rl.optim.", "rl.optim (or rl.sft.optim).", 1)) from None
    _check(
        rl.reference_dtype in REFERENCE_DTYPES,
        "reference_dtype",
        rl.reference_dtype,
        f"is unknown; choose one of {REFERENCE_DTYPES}",
    )
    _check(
        not rl.routing_replay or cfg.model.moe.num_experts > 0,
        "routing_replay",
        rl.routing_replay,
        "needs an MoE model (model.moe.num_experts > 0): a dense model has no routing to replay",
    )
    _check_domains(cfg, registry, curriculum)
    _check_engine(cfg)
    _check(0 <= rl.sft.noise <= 1, "sft.noise", rl.sft.noise, "must be in [0, 1]")


def _check_domains(cfg, registry, curriculum) -> None:
    rl = cfg.rl
    domains = list(rl.domains)
    known = registry.names()
    for d in domains:
        _check(d in known, "domains", tuple(domains), f"names {d!r}, not a registered domain; known: {known}")
    for block in ("levels", "sft.weights", "static_weights"):
        extra = sorted(set(_get(rl, block)) - set(domains))
        _check(not extra, block, extra, f"names domains not in rl.domains={tuple(domains)}")
    env = rl.get("env", ml_collections.ConfigDict())
    for d in domains:
        if d in env:
            try:
                registry.check_kwargs(d, env[d].to_dict())
            except (TypeError, ValueError, KeyError) as e:
                raise ConfigError(str(e)) from None
    try:
        curriculum.from_config(rl, domains)
    except ValueError as e:
        msg = str(e)
        raise ConfigError(
            msg if msg.startswith("rl.") else f"rl.static_weights / rl.domains: {msg}"
        ) from None


def _check_engine(cfg) -> None:
    rl = cfg.rl
    e = rl.engine
    _check(e.draft in DRAFTS, "engine.draft", e.draft, f"is unknown; choose one of {DRAFTS}")
    _positive_ints(rl, ("engine.draft_ngram",))
    engine_config(cfg)
    if e.draft == "model":
        from model import config as model_config

        draft = draft_model_config(cfg)
        try:
            model_config.validate_model(draft.model)
        except ValueError as err:
            raise ConfigError(f"rl.draft_model: {err}") from None
        _check(
            draft.model.vocab_size == cfg.model.vocab_size,
            "draft_model.vocab_size",
            draft.model.vocab_size,
            f"must equal model.vocab_size={cfg.model.vocab_size} (the draft proposes the target's tokens)",
        )
