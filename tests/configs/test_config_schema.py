"""The main job's config schema (`configs/schema.py`; tables `configs.fields.MODEL`, `configs.fields.RL`).

Property-based: every value the schema allows starts `rl.train` and runs a GRPO step; every value it refuses
is refused before any work, with the field's dotted name in the error. The valid configs come from the
schema's ranges, including the extremes the issue names (seed 0 and 2**63 - 1, one prompt, group size 2, a
single domain, one new token); each costs a real run of the tiny model, so there are few of them
(`derandomize`: CI draws the same ones every time). The refusals cost milliseconds, so there are many.
"""

import glob
import importlib
import json
import math
import os
import re
import time

import jax
import ml_collections
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from configs import base, fields, grpo, schema
from configs.schema import ConfigError
from model import seeds
from rl import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --- seeds --------------------------------------------------------------------------------------------------


def test_seed_key_matches_jax_below_2_32_and_separates_larger_seeds():
    for s in (0, 5, 2**31 - 1, 2**31, 2**32 - 1):
        assert np.array_equal(jax.random.key_data(seeds.key(s)), jax.random.key_data(jax.random.key(s)))
    # jax.random.key keeps only the low 32 bits here: 5 and 2**32 + 5 collide there, not in seeds.key.
    data = lambda k: tuple(np.asarray(jax.random.key_data(k)).tolist())
    assert data(jax.random.key(5)) == data(jax.random.key(2**32 + 5))
    # By the definition: the high chunk (1) folded into the key of the low chunk (5).
    assert data(seeds.key(2**32 + 5)) == data(jax.random.fold_in(jax.random.key(5), 1))
    keys = {data(seeds.key(s)) for s in (5, 2**32 + 5, 2**63 - 2, 2**63 - 1, 2**64, 2**64 + 5, 10**30)}
    assert len(keys) == 7
    for bad in (-1, 1.0, True, "3"):
        with pytest.raises(ValueError, match="seed="):
            seeds.key(bad)


def test_engine_seed_of_any_size():
    from inference.sampling import SamplingParams

    assert SamplingParams(seed=7).key_seed == 7
    big = {SamplingParams(seed=s).key_seed for s in (2**31, 2**40, 2**63 - 1, 2**80, -3)}
    assert len(big) == 5 and all(0 <= s < 2**31 for s in big)
    with pytest.raises(TypeError, match="seed=1.5 must be an int"):
        SamplingParams(seed=1.5)


# --- every config file passes its schema -------------------------------------------------------------------


ARGS = {"grpo": ("tiny", "small", *grpo.VARIANTS, "test,deepseek"), "tiny": (None, "dense", "deepseek")}


def _config_files():
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))):
        name = os.path.basename(path)[:-3]
        if name in ("__init__", "schema", "fields", "engine", "cli", "errors", "runs"):  # not config files
            continue
        module = importlib.import_module(f"configs.{name}")
        for arg in ARGS.get(name, (None,)):
            yield f"{name}:{arg}", module.get_config(arg)


def test_every_config_file_passes_the_schema():
    from model import config as model_config

    names = []
    for name, cfg in _config_files():
        model_config.validate_model(cfg.model)
        if "rl" in cfg:
            validate.validate(cfg)
        names.append(name)
    assert {"base:None", "tiny:None", "tiny:deepseek", "grpo:demo", "grpo:test", "grpo:small"} <= set(names)
    assert "grpo:test,deepseek" in names


def test_tables_give_the_config_files_defaults():
    """The table's defaults are the values the config files used before the table (written out here)."""
    cfg = grpo.get_config("tiny")
    assert (cfg.rl.group_size, cfg.rl.prompts_per_step, cfg.rl.max_new_tokens, cfg.rl.optim.lr) == (
        8,
        4,
        32,
        3e-4,
    )
    small = grpo.get_config("small")
    assert (small.rl.prompts_per_step, small.rl.max_new_tokens, small.rl.optim.lr, small.rl.sft.steps) == (
        16,
        256,
        1e-5,
        200,
    )
    assert dict(cfg.rl.env.code) == {"reward": "all_or_nothing"} and cfg.rl.draft_model.num_layers == 1
    m = base.model_defaults()
    assert (m.vocab_size, m.d_model, m.moe.num_experts, m.rope.theta, m.moe.capacity_factor) == (
        256,
        64,
        0,
        10_000.0,
        1.25,
    )


# --- refusals: drawn from the schema -----------------------------------------------------------------------


def _leaf_fields():
    """(config path, field) of every leaf field the main job reads: model.* and rl.*."""
    out = [(f"model.{n}", f) for n, f in fields.MODEL.items()]
    out += [(f"rl.{n}", f) for n, f in fields.RL.items()]
    return out


FIELDS = _leaf_fields()


def _bad_values(f: schema.Field) -> list:
    """Values outside what `f` allows, from its declared kind and range."""
    if f.kind == "bool":
        return [1, "yes", None]
    if f.kind in ("int", "float"):
        bad = ["3", None, [1]]
        if f.kind == "int":
            bad += [1.5, True]
        else:
            bad += [math.nan, -math.inf] + ([] if f.inf_ok else [math.inf])
        if f.lo is not None:
            bad.append(f.lo if f.lo_open else f.lo - 1)
        if f.hi is not None:
            bad.append(f.hi if f.hi_open else f.hi + 1)
        return bad
    if f.kind == "str":
        return [3, None]
    if f.kind in ("choice", "registered"):
        return ["no-such-choice", 3, None]
    if f.kind == "names":
        return [(), ("no-such-domain",), "debug", ("debug", "debug")]
    if f.kind == "block":
        if f.of is not None:
            return [3, {"no_such_field": 1}]
        if f.value is not None:
            return [3, {"debug": "x"}, {"debug": -1.0 if f.value.kind == "float" else ()}]
        return [3]
    raise AssertionError(f.kind)


BAD = [(path, v) for path, f in FIELDS for v in _bad_values(f)]


def _set(cfg, path: str, value) -> None:
    *parents, leaf = path.split(".")
    node = cfg
    for p in parents:
        node = node[p]
    with cfg.unlocked():
        # ConfigDict refuses a value of another type; the command line and a config file can still produce
        # one (a dict literal, a None), so the entry is replaced outright.
        if isinstance(node, ml_collections.ConfigDict):
            node._fields[leaf] = value  # noqa: SLF001
        else:
            node[leaf] = value


def _test_cfg():
    cfg = grpo.get_config("test")
    return cfg


def test_every_field_has_bad_values():
    assert len({p for p, _ in BAD}) == len(FIELDS) > 100


def test_bad_values_are_refused_naming_the_field():
    """Every bad value of every field (a few hundred, milliseconds each)."""
    for path, value in BAD:
        cfg = _test_cfg()
        _set(cfg, path, value)
        with pytest.raises(ConfigError) as err:
            validate.validate(cfg)
        # The message starts with the field (or a field under it, for blocks).
        assert str(err.value).startswith(path), (path, value, str(err.value))


def test_unknown_field_is_refused():
    cfg = _test_cfg()
    with cfg.unlocked():
        cfg.rl.ppo_epoch = 2  # a typo of ppo_epochs
        with pytest.raises(ConfigError, match=r"rl.ppo_epoch is not a field of rl"):
            validate.validate(cfg)
        del cfg.rl["ppo_epoch"]
        cfg.model.moe.topk = 4
    with pytest.raises(ConfigError, match=r"model.moe.topk is not a field of model"):
        validate.validate(cfg)


def test_main_job_refuses_before_any_work(tmp_path):
    """A refused config costs no time and writes nothing: the workdir (with a file of an earlier run) is as
    it was, no process started."""
    from rl import train

    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "metrics.jsonl").write_text('{"step": 1}\n')
    cases = [
        ("rl.seed", -1, "rl.seed"),
        ("rl.loss.kl_kind", "k2", "rl.loss.kl_kind"),
        ("rl.engine.draft", "eagle", "rl.engine.draft"),
        # Found by the property test below: the chat template makes every debug prompt longer than 24 tokens;
        # this failed at the first GRPO step, after the warm start and the first evaluation.
        ("rl.chat", True, "rl.max_prompt_len=24 is shorter than every prompt of debug"),
        ("rl.levels", {"debug": (0, 3)}, "rl.levels.debug=(0, 3) names levels [3]"),
    ]
    for path, value, message in cases:
        cfg = _test_cfg()
        _set(cfg, path, value)
        start = time.perf_counter()
        with pytest.raises(ConfigError, match=re.escape(message)):
            train.train(cfg, str(workdir))
        assert time.perf_counter() - start < 5.0
        assert sorted(os.listdir(workdir)) == ["metrics.jsonl"]
        assert (workdir / "metrics.jsonl").read_text() == '{"step": 1}\n'


# --- valid configs: drawn from the schema, each runs a GRPO step -------------------------------------------

SEEDS = st.one_of(st.sampled_from([0, 2**63 - 1, 20261201]), st.integers(0, 2**64))


@st.composite
def valid_overrides(draw):
    """rl.* values inside the schema and the rules tying fields together (the divisors of the batch)."""
    prompts, group = draw(st.integers(1, 2)), draw(st.integers(2, 3))
    rows = prompts * group
    minis = draw(st.sampled_from([d for d in range(1, rows + 1) if rows % d == 0]))
    micros = draw(st.sampled_from([d for d in range(1, rows // minis + 1) if (rows // minis) % d == 0]))
    new_tokens = draw(st.integers(1, 6))
    aggregation = draw(st.sampled_from(sorted(fields.RL["loss.aggregation"].allowed())))
    return {
        "seed": draw(SEEDS),
        "prompts_per_step": prompts,
        "group_size": group,
        "mini_batches": minis,
        "micro_batches": micros,
        "ppo_epochs": draw(st.integers(1, 2)),
        "max_new_tokens": new_tokens,
        "temperature": draw(st.floats(0.25, 2.0)),
        "top_k": draw(st.sampled_from([0, 1, 7, 1000])),
        "top_p": draw(st.sampled_from([1.0, 0.9, 0.01])),
        "advantage_std": draw(st.sampled_from(fields.RL["advantage_std"].allowed())),
        "routing_replay": draw(st.booleans()),
        "async_rollout": draw(st.booleans()),
        "max_staleness": draw(st.integers(0, 2)),
        "max_attempts": draw(st.integers(1, 2)),
        "log_samples": draw(st.integers(0, 2)),
        "loss.ratio": draw(st.sampled_from(fields.RL["loss.ratio"].allowed())),
        "loss.aggregation": aggregation,
        "loss.max_tokens": new_tokens if aggregation == "seq-mean-token-sum-norm" else 0,
        "loss.kl_kind": draw(st.sampled_from(fields.RL["loss.kl_kind"].allowed())),
        "loss.kl_coef": draw(st.sampled_from([0.0, 0.05])),
        "loss.correction": draw(st.sampled_from(fields.RL["loss.correction"].allowed())),
        "reference_dtype": draw(st.sampled_from(fields.RL["reference_dtype"].allowed())),
        "engine.draft": draw(st.sampled_from(fields.RL["engine.draft"].allowed())),
        "engine.page_size": draw(st.sampled_from([4, 16])),
        "engine.scheduler": draw(st.sampled_from(fields.RL["engine.scheduler"].allowed())),
        "engine.cache_dtype": draw(st.sampled_from(fields.RL["engine.cache_dtype"].allowed())),
        "domains": draw(st.sampled_from([("debug",), ("arith",), ("arith", "debug")])),
        "curriculum": draw(st.sampled_from(fields.RL["curriculum"].allowed())),
        "chat": (chat := draw(st.booleans())),
        # The byte tokenizer's chat template adds ~18 tokens (debug: 15 -> 33); the start-up check refuses
        # a budget no prompt fits (tested above), so valid configs give the template room.
        "max_prompt_len": 40 if chat else 24,
        "env_workers": draw(st.integers(1, 2)),
        "sft.steps": draw(st.sampled_from([0, 6])),
    }


# The extremes that can still learn: one prompt, a group of 2, the fewest new tokens that spell the debug
# domain's answer ("ok" + end of sequence), two PPO epochs of two mini-batches of one row each. A short warm
# start at temperature 2 makes the two samples differ in some back-fill round, so this example updates (the
# test checks it); the next example (one new token, which cannot spell "ok") checks the skipped step.
EXTREMES = {
    "seed": 2**63 - 1,
    "prompts_per_step": 1,
    "group_size": 2,
    "max_new_tokens": 3,
    "mini_batches": 2,
    "micro_batches": 1,
    "ppo_epochs": 2,
    "sft.steps": 6,
    "temperature": 2.0,
    "max_attempts": 8,
}


def _run_cfg(overrides: dict):
    cfg = _test_cfg()  # one domain (debug), the tiny model
    cfg.rl.steps, cfg.rl.checkpoint_every = 1, 1
    cfg.rl.eval.n_tasks, cfg.rl.eval.k = 1, 1
    for path, value in overrides.items():
        _set(cfg, f"rl.{path}", value)
    return cfg


# CI runs the two explicit configs (every field at an extreme; the smallest batch); SCHEMA_EXAMPLES=50
# explores (random draws besides them). A derandomized draw of one is hypothesis's simplest config, close to
# the test config's defaults that every other main-job test runs.
EXPLORE = int(os.environ.get("SCHEMA_EXAMPLES", "0"))


@settings(
    max_examples=EXPLORE or 1,
    phases=(Phase.explicit, Phase.generate) if EXPLORE else (Phase.explicit,),
    deadline=None,
    derandomize=not EXPLORE,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(valid_overrides())
@example(EXTREMES)
@example({"seed": 0, "prompts_per_step": 1, "group_size": 2, "max_new_tokens": 1, "top_k": 1})
def test_valid_configs_run_a_grpo_step(tmp_path_factory, overrides):
    from rl import train

    cfg = _run_cfg(overrides)
    validate.validate(cfg)
    workdir = tmp_path_factory.mktemp("run")
    out = train.train(cfg, str(workdir), run_eval=overrides.get("seed") == 2**63 - 1)
    assert out["steps"] == 1 and out["engine"]["compiles_after_warmup"] == 0, overrides
    with open(workdir / "metrics.jsonl") as f:
        steps = [r for r in map(json.loads, f) if "train/loss" in r or "train/skipped" in r]
    assert len(steps) == 1, overrides
    # A step trains (finite loss) or is skipped because no group had a reward signal (e.g. one new token
    # cannot spell the debug domain's answer), and says so.
    r = steps[0]
    if overrides == EXTREMES:
        assert np.isfinite(r["train/loss"]) and r["train/clip_fraction"] >= 0, r  # it updated
    if "train/loss" in r:
        assert np.isfinite(r["train/loss"]), (overrides, r)
    else:
        assert r["train/skipped"] == 1.0 and r["rollout/kept_groups"] == 0.0, (overrides, r)
    assert os.listdir(workdir / "checkpoints"), overrides


def test_readme_field_list_is_current():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    listed = text.split(fields.BEGIN, 1)[1].split(fields.END, 1)[0]
    assert listed == "\n" + fields.markdown(), (
        "README's field list is stale: python -m configs.fields --write README.md"
    )
    for path, _ in FIELDS:
        assert f"| `{path}` |" in listed


# --- choices from registries ----------------------------------------------------------------------------


def test_table_choices_are_the_registries_names():
    """The tables list a registry's names as plain strings (configs import nothing above them); they are
    the registries' built-in names, and `rl.validate` checks a chosen one against the registry itself."""
    from envs import registry

    for field, (_, names) in validate.registries().items():
        table = fields.MODEL if field.startswith("model.") else fields.RL
        assert table[field.split(".", 1)[1]].allowed() == tuple(sorted(names)), field
    assert tuple(sorted(registry.BUILTIN)) == fields.DOMAINS
    assert registry.ENTRY_POINT_GROUP == fields.ENTRY_POINT_GROUP


def test_a_choice_the_registry_lacks_is_refused_naming_the_field_and_the_registry(monkeypatch):
    from rl import grpo as grpo_lib

    cfg = grpo.get_config("test")
    validate.check_registries(cfg)
    monkeypatch.delitem(grpo_lib.RATIOS, "sequence")
    cfg.rl.loss.ratio = "sequence"
    with pytest.raises(
        ConfigError,
        match=r"rl.loss.ratio='sequence' is not registered in rl.grpo.RATIOS; choose one of \['token'\]",
    ):
        validate.validate(cfg)


def test_a_name_the_user_registers_is_a_valid_choice(monkeypatch):
    """A ratio registered by the user's code (rl.grpo.register) is accepted by the config check; an
    unregistered one is refused by the registry check, naming the field."""
    from rl import grpo as grpo_lib

    cfg = grpo.get_config("test")
    cfg.rl.loss.ratio = "mine"
    with pytest.raises(ConfigError, match=r"rl.loss.ratio='mine' is not registered in rl.grpo.RATIOS"):
        validate.validate(cfg)
    monkeypatch.setitem(grpo_lib.RATIOS, "mine", grpo_lib.RATIOS["token"])
    validate.validate(cfg)


def test_engine_defaults_are_engine_configs():
    from configs.engine import EngineConfig

    engine = grpo.get_config("tiny").rl.engine
    defaults = EngineConfig()
    for name in engine:
        if hasattr(defaults, name) and name != "decode_steps":  # 0: the main job's "per drafter" default
            assert engine[name] == getattr(defaults, name), name


def test_parse_arg():
    assert base.parse_arg("dense,experts=32,,capacity", "x.py", ("dense", "capacity", "experts=N")) == [
        ("dense", ""),
        ("experts", "32"),
        ("capacity", ""),
    ]
    assert base.parse_arg(None, "x.py", ("dense",)) == []
    for bad in ("bogus", "dense=1", "experts"):
        with pytest.raises(
            ValueError, match=rf"configs/x.py: unknown argument '{bad}'; use dense, experts=N"
        ):
            base.parse_arg(bad, "x.py", ("dense", "experts=N"))
