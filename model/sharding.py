"""Logical axis names -> mesh axes.

Model code names logical axes only (`("embed", "mlp")`); `cfg.mesh.rules` says which mesh axes those are.
Parameters carry their names as `logical_axes` metadata on each `nnx.Param`; activations are constrained
with `constrain(x, ("act_batch", "act_length", "act_embed"), rules)` at block boundaries.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "expert", "tensor", "sequence")

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]


def resolve_mesh_shape(shape: dict, num_devices: int) -> dict[str, int]:
    """Mesh axis sizes with a `-1` axis filled in; errors name the field and the fix."""
    unknown = set(shape) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"mesh.shape has unknown axes {sorted(unknown)}; the mesh axes are {MESH_AXES}")
    sizes = {a: int(shape.get(a, 1)) for a in MESH_AXES}
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ValueError(f"mesh.shape: only one axis may be -1, got {free}; give the others sizes")
    for a, s in sizes.items():
        if s == 0 or s < -1:
            raise ValueError(f"mesh.shape.{a}={s}: sizes must be positive (or -1 for the rest)")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if num_devices % fixed:
            raise ValueError(
                f"mesh.shape: the fixed axes multiply to {fixed}, which does not divide the "
                f"{num_devices} devices; change the sizes so their product divides {num_devices}"
            )
        sizes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(
            f"mesh.shape multiplies to {fixed} but there are {num_devices} devices; make the product "
            f"equal the device count (or set one axis, e.g. mesh.shape.data, to -1)"
        )
    return sizes


def make_mesh(mesh_shape: dict, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over `devices` (default: all) with axes `MESH_AXES`, GSPMD-style (Auto) axis types."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_mesh_shape(dict(mesh_shape), len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    try:
        from jax.experimental import mesh_utils

        device_array = mesh_utils.create_device_mesh(shape, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
        device_array = np.asarray(devices).reshape(shape)
    return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(logical_axes: Sequence[str | None], rules: Rules) -> PartitionSpec:
    """PartitionSpec for a tuple of logical names; a mesh axis is used at most once (first wins)."""
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name in logical_axes:
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise KeyError(
                f"logical axis {name!r} has no entry in mesh.rules; add ({name!r}, <mesh axes or None>)"
            )
        target = table[name]
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a not in used)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


def _drop_trivial(spec: PartitionSpec, mesh) -> PartitionSpec:
    """Remove mesh axes of size 1 (keeps specs readable and avoids no-op constraints)."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))

    def keep(entry):
        if entry is None:
            return None
        axes = (entry,) if isinstance(entry, str) else tuple(entry)
        axes = tuple(a for a in axes if sizes.get(a, 1) > 1)
        return None if not axes else axes[0] if len(axes) == 1 else axes

    return PartitionSpec(*(keep(e) for e in spec))


def mesh_spec(logical_axes: Sequence[str | None], rules: Rules, mesh) -> PartitionSpec:
    """PartitionSpec of logical names on `mesh`, without its size-1 axes."""
    return _drop_trivial(logical_to_spec(logical_axes, rules), mesh)


def constrain(x: jax.Array, logical_axes: Sequence[str | None], rules: Rules) -> jax.Array:
    """`with_sharding_constraint` by logical names; a no-op when no mesh is set."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, mesh_spec(logical_axes, rules, mesh))


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def variable_value(v: nnx.Variable):
    """The array (or ShapeDtypeStruct) inside a variable, across flax versions."""
    return v.get_value() if hasattr(v, "get_value") else v.value


def logical_axes_of(v: nnx.Variable) -> tuple:
    """The `logical_axes` metadata of a variable, checked against its rank."""
    axes = v.get_metadata().get("logical_axes")
    shape = variable_value(v).shape
    if axes is None:
        raise ValueError(f"a variable of shape {shape} has no logical_axes metadata")
    if len(axes) != len(shape):
        raise ValueError(f"logical_axes {axes} do not match the rank of shape {shape}")
    return tuple(axes)


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules):
    """NamedShardings for every variable of `state`, checking each dimension divides its mesh axes."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))

    def sharding(v):
        names = logical_axes_of(v)
        spec = _drop_trivial(logical_to_spec(names, rules), mesh)
        for dim, entry, name in zip(variable_value(v).shape, spec, names):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
            n = math.prod(sizes[a] for a in axes)
            if dim % n:
                raise ValueError(
                    f"a parameter dimension {name!r} of size {dim} does not divide over mesh axes "
                    f"{axes} of size {n}; change the model size or the mesh (or map {name!r} to "
                    f"another axis in mesh.rules)"
                )
        return NamedSharding(mesh, spec)

    return jax.tree.map(sharding, state, is_leaf=_is_var)
