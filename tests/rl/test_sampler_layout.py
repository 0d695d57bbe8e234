"""rl.sampler in one process of 8 fake devices: the sampler layout from rl.engine.mesh, its refusals (named
fields, before any work), the push's stage mesh, and a group's share of the samples. Two processes:
tests/inference/test_engine_hosts.py and tests/rl/test_multihost.py."""

import types

import jax
import numpy as np
import pytest

from configs import grpo
from configs.schema import ConfigError
from rl import distributed, sampler


def _cfg(**engine_mesh):
    cfg = grpo.get_config("test")
    cfg.mesh.shape.update(data=1, fsdp=8)
    cfg.rl.engine.mesh.update(engine_mesh)
    return cfg


def test_layout_shapes_and_refusals():
    cfg = _cfg(expert=2, tensor=2)
    place = sampler.layout(cfg, distributed.trainer_mesh(cfg))
    assert dict(place.mesh.shape) == {"data": 2, "fsdp": 1, "expert": 2, "tensor": 2, "sequence": 1}
    assert place.members == (0,) and place.leader and not place.lockstep and not place.placed
    with pytest.raises(ConfigError, match=r"rl\.engine\.mesh\.tensor=3 does not divide"):
        bad = _cfg(tensor=3)
        sampler.layout(bad, distributed.trainer_mesh(bad))
    with pytest.raises(ConfigError, match=r"rl\.engine\.mesh\.processes=2 does not divide the 1 processes"):
        bad = _cfg(processes=2)
        sampler.layout(bad, distributed.trainer_mesh(bad))


def test_disaggregated_stage_mesh_and_push():
    """rl.sampler_devices=2: the trainer's 6 devices stage 3 copies of the engine's 2-device layout, each
    engine device's sources on its own process; the push lands the trainer's values in the engine layout."""
    cfg = _cfg(tensor=2)
    cfg.mesh.shape.update(fsdp=2, data=-1)
    cfg.rl.sampler_devices = 2
    trainer = distributed.trainer_mesh(cfg)
    place = sampler.layout(cfg, trainer)
    assert sorted(d.id for d in place.mesh.devices.flat) == [6, 7]
    stage = place._stage_mesh
    assert stage.devices.shape[:2] == (3, 1) and set(stage.devices.flat) == set(trainer.devices.flat)
    x = jax.device_put(
        np.arange(64 * 6, dtype=np.float32).reshape(64, 6),
        jax.sharding.NamedSharding(trainer, jax.sharding.PartitionSpec("fsdp")),
    )
    target = jax.sharding.NamedSharding(place.mesh, jax.sharding.PartitionSpec(None, "tensor"))
    out, moved = place.push({"w": x}, {"w": target})
    assert out["w"].sharding == target
    np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(x))
    assert moved == 64 * 6 * 4  # every byte crosses to the engine's devices, each half to one of them


def test_share_takes_this_process_groups_in_order():
    place = sampler.Layout(0, (0, 1), (), None)
    samples = [types.SimpleNamespace(group=g) for g in (5, 5, 2, 9, 2, 7)]
    assert [s.group for s in place.share(samples, 2)] == [5, 5, 2, 2]  # groups 2 and 5 of 2, 5, 7, 9
