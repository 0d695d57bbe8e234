"""Configs load, and bad values fail with an error that names the field and the fix."""

import importlib

import pytest

import model
from configs import tiny
from model import sharding


@pytest.mark.parametrize("name", ["base", "tiny", "small", "moe_30b", "moe_1t"])
def test_every_config_validates(name):
    cfg = importlib.import_module(f"configs.{name}").get_config()
    model.validate(cfg)
    doc = importlib.import_module(f"configs.{name}").__doc__
    assert doc.startswith("python -m "), "a config's docstring starts with the command that runs it"


def test_config_arguments():
    assert tiny.get_config("dense").model.moe.num_experts == 0
    assert tiny.get_config("capacity").model.moe.impl == "capacity"
    with pytest.raises(ValueError, match="unknown argument 'bogus'"):
        tiny.get_config("bogus")


BAD = [
    ("model.num_heads", 6, r"model.num_heads=6 is not divisible by model.num_kv_heads=4"),
    ("model.head_dim", 15, r"model.head_dim=15 must be even"),
    ("model.attention_impl", "magic", r"model.attention_impl='magic' is unknown; choose one of"),
    ("model.remat", "some", r"model.remat='some' is unknown"),
    ("model.compute_dtype", "float8", r"model.compute_dtype='float8' is unknown"),
    ("model.rope.scaling", "ntk", r"model.rope.scaling='ntk'"),
    ("model.moe.top_k", 5, r"model.moe.top_k=5 must be between 1 and model.moe.num_experts=4"),
    ("model.moe.impl", "dense", r"model.moe.impl='dense' is unknown"),
    ("model.moe.router", "hash", r"model.moe.router='hash' is unknown"),
    ("model.moe.first_dense_layers", 3, r"model.moe.first_dense_layers=3 must be between 0"),
]


@pytest.mark.parametrize("field,value,message", BAD, ids=[b[0] for b in BAD])
def test_bad_model_fields(field, value, message):
    cfg = tiny.get_config()
    if field == "model.num_heads":
        cfg.model.num_kv_heads = 4
    *parents, leaf = field.split(".")
    node = cfg
    for p in parents:
        node = node[p]
    node[leaf] = value
    with pytest.raises(model.ConfigError, match=message):
        model.validate(cfg)


def _with_mesh(**shape):
    cfg = tiny.get_config()
    cfg.mesh.shape.update({a: 1 for a in sharding.MESH_AXES})
    cfg.mesh.shape.update(shape)
    return cfg


def test_mesh_errors():
    with pytest.raises(model.ConfigError, match=r"mesh.shape multiplies to 4 but there are 8 devices"):
        model.validate(_with_mesh(data=4), num_devices=8)
    with pytest.raises(model.ConfigError, match=r"only one axis may be -1"):
        model.validate(_with_mesh(data=-1, fsdp=-1), num_devices=8)
    with pytest.raises(
        model.ConfigError, match=r"model.moe.num_experts=4 is not divisible by mesh.shape.expert=8"
    ):
        model.validate(_with_mesh(expert=8), num_devices=8)
    with pytest.raises(
        model.ConfigError, match=r"model.num_kv_heads=2 is not divisible by mesh.shape.tensor=4"
    ):
        model.validate(_with_mesh(tensor=4, data=2), num_devices=8)
    assert model.validate(_with_mesh(data=-1, expert=2), num_devices=8)["data"] == 4


def test_build_refuses_a_mesh_that_does_not_match():
    cfg = _with_mesh(data=2)
    with pytest.raises(model.ConfigError, match="there are 8 devices"):
        model.build(cfg, mesh=sharding.make_mesh({"data": 8}))


def test_unscanned_layers_on_an_fsdp_mesh_are_noted():
    from configs import grpo
    from rl import validate

    cfg = grpo.get_config("test")  # unrolled layers (scan_layers False), mesh data=-1
    assert not cfg.model.scan_layers
    assert not [n for n in validate.notes(cfg) if "scan_layers" in n]
    cfg.mesh.shape.update(data=1, fsdp=8)
    (note,) = [n for n in validate.notes(cfg) if "scan_layers" in n]
    assert note.startswith("model.scan_layers=False on mesh.shape.fsdp=8")
    cfg.model.scan_layers = True
    assert not [n for n in validate.notes(cfg) if "scan_layers" in n]
