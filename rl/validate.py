"""The main job's config, checked in one place before any work (no pool, no model, no SFT).

`validate(cfg)` raises a `ConfigError` naming the first bad field and the fix: every field against its table
(`configs.fields.MODEL`, `configs.fields.RL`: type, range, choices; unknown names refused), then each choice
a registry implements against that registry (`check_registries`), then the rules that tie fields together
(divisors of the batch, domains named in two places, environment kwargs against the constructor, the
engine's sizes, the draft model, the MTP loss). `rl.train` (and `rl.sft` through it) calls it first. With
rl.init_from the model fields checked are the checkpoint's (`init_from_config`).
"""

from __future__ import annotations

import os

import ml_collections

from configs import schema
from configs.engine import EngineConfig
from configs.errors import require
from configs.fields import RL
from envs import registry
from envs.base import has_reference_solution
from model import config as model_config
from model.attention import ATTENTION_IMPLS
from model.config import ConfigError
from rl import curriculum, grpo, train_state

DECODE_STEPS = 8  # rl.engine.decode_steps=0 without a drafter or with draft="model": steps per device call
MANY_STEP_DRAFTS = ("none", "model")  # rl.engine.draft values whose engine runs several steps per call
# rl.engine fields the main job reads; the rest are EngineConfig's
ENGINE_EXTRAS = ("draft", "draft_ngram", "mesh")


def _check(ok: bool, field: str, value, why: str) -> None:
    if not ok:
        raise ConfigError(f"rl.{field}={value!r} {why}")


def _get(node, dotted: str):
    for part in dotted.split("."):
        node = node[part]
    return node


def engine_config(cfg: ml_collections.ConfigDict):
    """`inference.EngineConfig` of the main job: rl.engine less the draft fields, sized for seq_len, with
    routing recorded when rl.routing_replay is on."""
    fields = {k: v for k, v in cfg.rl.engine.items() if k not in ENGINE_EXTRAS}
    fields["max_seq_len"] = cfg.rl.max_prompt_len + cfg.rl.max_new_tokens
    if not fields.get("decode_steps"):
        fields["decode_steps"] = DECODE_STEPS if cfg.rl.engine.draft in MANY_STEP_DRAFTS else 1
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


def init_from_config(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The config the main job runs with rl.init_from (cfg itself when it is ""): a copy whose `model` is
    the checkpoint's (`model.io.hf.read_config`, keeping this config's
    `model.io.hf_config.RUNTIME_FIELDS`), with `hf` (its architecture and config.json, what `rl.export`
    writes back) and rl.tokenizer set to the directory when that is "" and the directory holds a
    tokenizer.json."""
    path = cfg.rl.init_from
    if not path:
        return cfg
    require("safetensors", "rl.init_from (a Hugging Face checkpoint)")
    from model.io import hf, hf_config

    _check(
        os.path.isdir(path),
        "init_from",
        path,
        "is not a directory; give a Hugging Face checkpoint directory (config.json, *.safetensors)",
    )
    _check(
        os.path.isfile(os.path.join(path, "config.json")),
        "init_from",
        path,
        "holds no config.json; give a Hugging Face checkpoint directory (config.json, *.safetensors)",
    )
    try:
        ckpt = hf.read_config(path, overrides=hf_config.runtime_fields(cfg.model))
    except (ValueError, KeyError) as e:
        raise ConfigError(f"rl.init_from={path!r}: {e}") from None
    out = ml_collections.ConfigDict(cfg.to_dict())
    out.model = ckpt.model
    out.hf = ckpt.hf
    if not out.rl.tokenizer and os.path.isfile(os.path.join(path, "tokenizer.json")):
        out.rl.tokenizer = path
    return out


def validate(cfg: ml_collections.ConfigDict) -> None:
    """Raises ConfigError naming the first field that cannot work (see the module docstring)."""
    schema.check(cfg.rl, RL, "rl")
    cfg = init_from_config(cfg)
    rl = cfg.rl
    model_config.validate_model(cfg.model)
    check_registries(cfg)
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
    grpo.validate_loss_config(rl.loss)
    train_state.check_optim(rl.optim)
    sft_optim = ml_collections.ConfigDict(rl.optim.to_dict())
    sft_optim.update(rl.sft.optim.to_dict())
    train_state.check_optim(sft_optim, "rl.optim (with rl.sft.optim)")
    _check(
        not rl.routing_replay or cfg.model.moe.num_experts > 0,
        "routing_replay",
        rl.routing_replay,
        "needs an MoE model (model.moe.num_experts > 0): a dense model has no routing to replay",
    )
    _check(
        rl.sft.mtp_weight == 0 or cfg.model.mtp_layers > 0,
        "sft.mtp_weight",
        rl.sft.mtp_weight,
        f"needs multi-token-prediction modules, and the checkpoint rl.init_from={rl.init_from!r} has no MTP "
        "tensors (whatever its config.json's num_nextn_predict_layers says); set rl.sft.mtp_weight=0"
        if rl.init_from
        else "needs multi-token-prediction modules (model.mtp_layers > 0); the model has "
        f"{cfg.model.mtp_layers}",
    )
    _check(
        not rl.gradient_projection or len(rl.domains) >= 2,
        "gradient_projection",
        rl.gradient_projection,
        f"projects one domain's gradient against another's: it needs two or more rl.domains, not "
        f"{tuple(rl.domains)} (set rl.gradient_projection=False)",
    )
    _check_domains(cfg, registry, curriculum)
    _check_engine(cfg)


def registries() -> dict[str, tuple[str, dict]]:
    """Config field -> (the registry's name, the registry) for every choice the tables list as plain strings
    (`configs.fields`) and a registry implements; rl.domains is resolved by `_check_domains`."""
    return {
        "model.attention_impl": ("model.attention.ATTENTION_IMPLS", ATTENTION_IMPLS),
        "rl.advantage_std": ("rl.grpo.ADVANTAGES", grpo.ADVANTAGES),
        "rl.loss.ratio": ("rl.grpo.RATIOS", grpo.RATIOS),
        "rl.loss.aggregation": ("rl.grpo.AGGREGATIONS", grpo.AGGREGATIONS),
        "rl.loss.kl_kind": ("rl.grpo.KL", {**grpo.KL, "none": None}),
        "rl.loss.correction": ("rl.grpo.CORRECTIONS", grpo.CORRECTIONS),
    }


def check_registries(cfg: ml_collections.ConfigDict) -> None:
    """Each choice the table allows names an entry of the registry that implements it: a ConfigError naming
    the field, the registry and its names otherwise (the table and the registry have drifted apart)."""
    for field, (where, names) in registries().items():
        value = _get(cfg, field)
        if value not in names:
            raise ConfigError(
                f"{field}={value!r} is not registered in {where}; choose one of {sorted(names)}"
            )


# GSPO (Zheng et al., 2025, "Group Sequence Policy Optimization"): sequence-level ratios, averaged per
# sequence, clipped to [1 - 3e-4, 1 + 4e-4]: a length-normalised ratio moves far less than a token's.
GSPO_CLIP = (3e-4, 4e-4)


def notes(cfg: ml_collections.ConfigDict) -> list[str]:
    """Settings that run but are probably not what was meant, one line each (the main job prints them at
    start): GSPO's sequence ratio with token-mean aggregation or PPO-sized clip ranges; unscanned layers on
    an FSDP mesh."""
    loss, out = cfg.rl.loss, []
    if loss.ratio == "sequence" and (
        loss.aggregation == "token-mean" or max(loss.clip_low, loss.clip_high) >= 0.01
    ):
        out.append(
            f"rl.loss.ratio='sequence' (GSPO) with aggregation={loss.aggregation!r}, "
            f"clip_low={loss.clip_low}, clip_high={loss.clip_high}: the published GSPO recipe averages per "
            f"sequence (aggregation='seq-mean-token-mean') and clips to clip_low={GSPO_CLIP[0]}, "
            f"clip_high={GSPO_CLIP[1]} (a sequence's length-normalised ratio moves far less than a token's)"
        )
    fsdp = int(cfg.mesh.shape.get("fsdp", 1))
    if fsdp != 1 and not cfg.model.scan_layers:
        out.append(
            f"model.scan_layers=False on mesh.shape.fsdp={fsdp}: the train step gathers every layer's "
            "weights and gradients at once (XLA's temp per device: several times the whole model's bytes, "
            "against a fraction with model.scan_layers=True and model.remat='full'; python -m rl.plan --xla "
            "prints it); set those two for a model near a device's memory"
        )
    return out


def check_mesh(cfg: ml_collections.ConfigDict, processes: int, *, batch_shards: int) -> None:
    """What the processes and the trainer's mesh (`rl.distributed`) need of the config, checked once the
    mesh exists and before any other array does."""
    rl = cfg.rl
    rows = rl.prompts_per_step * rl.group_size
    if processes > 1:
        _check(
            rl.prompts_per_step % processes == 0,
            "prompts_per_step",
            rl.prompts_per_step,
            f"must divide over the {processes} processes (each rolls out an equal share of the groups)",
        )
        _check(
            rows % batch_shards == 0,
            "group_size",
            rl.group_size,
            f"gives {rows} rows (rl.prompts_per_step * rl.group_size), which must divide over the "
            f"{batch_shards} devices of the batch axes (mesh.shape data * fsdp * expert) when the run spans "
            "processes; change either, or the mesh",
        )
        _check(
            rl.sft.rows % processes == 0,
            "sft.rows",
            rl.sft.rows,
            f"must divide over the {processes} processes",
        )
        _check(
            not rl.async_rollout,
            "async_rollout",
            rl.async_rollout,
            "is not supported across processes yet (the producer thread's collectives would interleave "
            "with the trainer's); set rl.async_rollout=False for a multi-process run",
        )
        _check(
            rl.weight_sync_delta < 0,
            "weight_sync_delta",
            rl.weight_sync_delta,
            "(delta weight sync) works within one process only; set it negative for a multi-process run",
        )
        _check(
            rl.advantage_std != "batch",
            "advantage_std",
            rl.advantage_std,
            "'batch' would divide by each process's own reward std; use 'group' or 'none' across processes",
        )


def _check_domains(cfg, registry, curriculum) -> None:
    """Every rl.domains name resolves to an environment (built in; else an entry point or an import path
    "package.module:Class", imported now, a factory called once with its rl.env options); rl.levels,
    rl.sft.weights and rl.static_weights name only those domains; rl.env fits each constructor; every
    domain the SFT warm start or the quality gate will ask has reference solutions; the curriculum's
    fields."""
    rl = cfg.rl
    domains = list(rl.domains)
    named = f"rl.domains={tuple(domains)!r} names"
    user = {}  # domain -> its class or factory, for the domains that are not built in
    for d in domains:
        try:
            registry.target(d)  # a built-in's name taken by an installed entry point is refused here too
            if d not in registry.BUILTIN:
                user[d] = registry.resolve(d)
        except (KeyError, ValueError) as e:  # the reason names the target: an import path only once
            raise ConfigError(f"{named} {d!r}: {registry.reason(e).removeprefix(f'{d}: ')}") from None
    paths = [d for d in domains if registry.is_import_path(d)]
    for block in ("levels", "sft.weights", "static_weights"):
        extra = sorted(set(_get(rl, block)) - set(domains))
        hint = (
            f"; a domain given by import path ({paths[0]!r}) is named by that path, which cannot be a key "
            f"here: give it a short name with an entry point (group {registry.ENTRY_POINT_GROUP!r})"
            if extra and paths
            else ""
        )
        _check(not extra, block, extra, f"names domains not in rl.domains={tuple(domains)}{hint}")
    env = rl.get("env", ml_collections.ConfigDict())
    options = {}
    for d in domains:  # a built-in without options is not imported: its constructor needs none
        try:
            given = env[d].to_dict() if d in env else {}
            options[d] = registry.check_kwargs(d, given) if d in env or d in user else {}
        except (TypeError, ValueError, KeyError) as e:
            raise ConfigError(str(e)) from None
    for d, made in user.items():
        if not isinstance(made, type):  # a factory: what it makes is known once it is called
            try:
                made = registry.make(d, **options[d])
            except registry.DomainError as e:
                raise ConfigError(f"{named} {d!r}: {e}") from None
            except Exception as e:  # the user's factory may raise anything: one line, named
                raise ConfigError(f"{named} {d!r}, whose factory raised {type(e).__name__}: {e}") from None
            made.close()
        needs, fixes = [], []  # who will ask this domain for reference solutions
        if rl.sft.steps and (dict(rl.sft.weights).get(d, 0) if len(rl.sft.weights) else 1):
            needs.append(f"the SFT warm start (rl.sft.steps={rl.sft.steps})")
            fixes.append("rl.sft.steps=0")
        if rl.quality_gate:
            needs.append("the quality gate (rl.quality_gate=True)")
            fixes.append("rl.quality_gate=False")
        _check(
            has_reference_solution(made) or not needs,
            "domains",
            tuple(domains),
            f"names {d!r}, which has no reference_solution(task) (a completion that scores 1.0); "
            f"{' and '.join(needs)} need{'s' if len(needs) == 1 else ''} one: implement it, or set "
            f"{' and '.join(fixes)}",
        )
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
    engine_config(cfg)
    _check(
        e.draft in MANY_STEP_DRAFTS or e.decode_steps in (0, 1),
        "engine.decode_steps",
        e.decode_steps,
        f"must be 0 or 1 with rl.engine.draft={e.draft!r} (its proposals come from the host or the last step:"
        " one device call per speculative step; draft='model' runs several per call)",
    )
    _check(
        e.draft != "mtp" or cfg.model.mtp_layers >= 1,
        "engine.draft",
        e.draft,
        f"needs multi-token-prediction modules, and the checkpoint rl.init_from={rl.init_from!r} has no MTP "
        "tensors (whatever its config.json's num_nextn_predict_layers says); pick another drafter"
        if rl.init_from
        else "needs multi-token-prediction modules: set model.mtp_layers >= 1 (or pick another drafter)",
    )
    if e.draft == "model":
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
