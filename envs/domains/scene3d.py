"""scene3d: emit a JSON 3D scene that satisfies stated constraints; the verifier checks schema and geometry.

A scene is `{"objects": [...], "lights": [...], "camera": {...}}`. Each object has a unique `id`, a `shape`
(box, sphere or cylinder; cylinders stand upright along z), a `position` (the centre of the object, z up,
the floor is z = 0), a `size` (box: [w, d, h]; sphere: radius; cylinder: [radius, height]) and a `material`
(`{"name": ..., "color": "#rrggbb" or [r, g, b] in 0..1}`). Geometry is checked on axis-aligned bounding
boxes with tolerance `TOL`.

Levels add constraints (all levels: exact counts, objects on or above the floor and inside the bounds, at
least one light, a camera whose view cone holds every object's centre):
    0: 2-3 objects, counts per shape.
    1: 3-5 objects, counts per (shape, material), no two objects overlap.
    2: 4-6 objects, plus one named object resting on another.
    3: 6-8 objects, plus a stack of three named objects, smaller bounds and a minimum object size.

reward = 1.0 only if every constraint holds; `details["fraction"]` is the fraction satisfied and
`details["failed"]` names each failed constraint (`kind[subject]`) with a reason. A completion holding no
scene, several scenes or a scene that breaks the schema is a `format_error`. `render_png` draws a preview
with matplotlib (imported only there).
"""

from __future__ import annotations

import json
import math
import random
import re
from typing import Any

from envs.base import Score, SingleTurnEnvironment, Task

TOL = 0.01  # metres: contact, overlap, floor and bounds tolerance
CAMERA_TOL_DEG = 0.5
MAX_CHARS = 100_000  # longer completions are rejected before parsing (the scan below is quadratic at worst)
MAX_OBJECTS = 64
SHAPES = ("box", "sphere", "cylinder")
SUPPORT_SHAPES = ("box", "cylinder")  # flat tops: what a named object may rest on
LIGHT_TYPES = ("point", "directional", "spot", "area")
MATERIALS = {
    "red": "#d62728",
    "green": "#2ca02c",
    "blue": "#1f77b4",
    "yellow": "#e6c619",
    "white": "#f0f0f0",
    "black": "#202020",
    "wood": "#8b5a2b",
    "metal": "#9ea7b0",
    "glass": "#a8d8e8",
}
_NAMES = ("table", "crate", "pedestal", "shelf", "block", "drum", "ball", "vase", "cube", "lamp")
_LEVELS = {  # objects (min, max), floor half-width range, height range, relations, min_size
    0: dict(n=(2, 3), half=(4.0, 5.0), height=(3.0, 4.0), chain=0, min_size=None),
    1: dict(n=(3, 5), half=(3.5, 4.5), height=(2.5, 3.5), chain=0, min_size=None),
    2: dict(n=(4, 6), half=(3.0, 3.5), height=(2.5, 3.0), chain=2, min_size=None),
    3: dict(n=(6, 8), half=(2.2, 3.0), height=(2.0, 3.0), chain=3, min_size=0.3),
}
_FENCE = re.compile(r"```[ \t]*(?:json)?[ \t]*\n(.*?)```", re.S | re.I)


class SchemaError(ValueError):
    pass


# ----------------------------------------------------------------------------------------------------------
# Parsing and schema


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a number")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _json_values(text: str) -> list[Any]:
    """Every top-level JSON object in `text` (objects nested in a decoded one are not counted again)."""
    found, i = [], text.find("{")
    while i != -1:
        try:
            value, end = _DECODER.raw_decode(text, i)
        except (ValueError, RecursionError):
            i = text.find("{", i + 1)
            continue
        found.append(value)
        i = text.find("{", end)
    return found


def extract_scene(completion: str) -> dict:
    """The one scene in `completion` (inside ```json fences when there are any); raises SchemaError."""
    if len(completion) > MAX_CHARS:
        raise SchemaError(f"completion has {len(completion)} characters; at most {MAX_CHARS}")
    blocks = _FENCE.findall(completion)
    values = [v for block in (blocks or [completion]) for v in _json_values(block)]
    scenes = [v for v in values if isinstance(v, dict) and "objects" in v]
    if not scenes:
        raise SchemaError("no JSON scene found (a JSON object with an 'objects' list)")
    if len(scenes) > 1:
        raise SchemaError(f"{len(scenes)} JSON scenes found; give exactly one")
    return scenes[0]


def _vec(value: Any, where: str, n: int = 3, positive: bool = False) -> list[float]:
    if (
        not isinstance(value, list)
        or len(value) != n
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    ):
        raise SchemaError(f"{where}: expected a list of {n} numbers, got {json.dumps(value)[:80]}")
    out = [float(v) for v in value]
    if not all(math.isfinite(v) for v in out):
        raise SchemaError(f"{where}: numbers must be finite")
    if positive and not all(v > 0 for v in out):
        raise SchemaError(f"{where}: sizes must be positive")
    return out


def _color(value: Any, where: str) -> None:
    if isinstance(value, str) and re.fullmatch(r"#[0-9a-fA-F]{6}", value):
        return
    if isinstance(value, list):
        rgb = _vec(value, where)
        if all(0.0 <= v <= 1.0 for v in rgb):
            return
    raise SchemaError(f"{where}: a color is '#rrggbb' or [r, g, b] with components in 0..1")


def _half_extents(shape: str, size: Any, where: str) -> list[float]:
    if shape == "box":
        w, d, h = _vec(size, f"{where}.size (box: [w, d, h])", 3, positive=True)
        return [w / 2, d / 2, h / 2]
    if shape == "sphere":
        r = size[0] if isinstance(size, list) and len(size) == 1 else size
        (r,) = _vec([r], f"{where}.size (sphere: radius)", 1, positive=True)
        return [r, r, r]
    r, h = _vec(size, f"{where}.size (cylinder: [radius, height])", 2, positive=True)
    return [r, r, h / 2]


def validate(scene: Any) -> list[dict]:
    """Checks the schema; returns the objects with bounding-box corners `lo`/`hi`. Raises SchemaError."""
    if not isinstance(scene, dict):
        raise SchemaError("the scene must be a JSON object")
    objects = scene.get("objects")
    if not isinstance(objects, list) or not objects:
        raise SchemaError("'objects' must be a non-empty list")
    if len(objects) > MAX_OBJECTS:
        raise SchemaError(f"{len(objects)} objects; at most {MAX_OBJECTS}")
    parsed, ids = [], set()
    for i, obj in enumerate(objects):
        where = f"objects[{i}]"
        if not isinstance(obj, dict):
            raise SchemaError(f"{where}: must be an object")
        oid = obj.get("id")
        if not isinstance(oid, str) or not oid:
            raise SchemaError(f"{where}.id: a non-empty string is required")
        if oid in ids:
            raise SchemaError(f"{where}.id: duplicate id {oid!r}")
        ids.add(oid)
        shape = obj.get("shape")
        if shape not in SHAPES:
            raise SchemaError(f"{where}.shape: {shape!r} is not one of {list(SHAPES)}")
        pos = _vec(obj.get("position"), f"{where}.position")
        half = _half_extents(shape, obj.get("size"), where)
        material = obj.get("material")
        if not isinstance(material, dict) or not isinstance(material.get("name"), str):
            raise SchemaError(f"{where}.material: an object with a 'name' string and a 'color' is required")
        _color(material.get("color"), f"{where}.material.color")
        lo = [p - h for p, h in zip(pos, half)]
        hi = [p + h for p, h in zip(pos, half)]
        mat = material["name"].strip().lower()
        parsed.append(dict(id=oid, shape=shape, material=mat, center=pos, lo=lo, hi=hi))
    lights = scene.get("lights")
    if not isinstance(lights, list):
        raise SchemaError("'lights' must be a list")
    for i, light in enumerate(lights):
        where = f"lights[{i}]"
        if not isinstance(light, dict) or light.get("type") not in LIGHT_TYPES:
            raise SchemaError(f"{where}: needs a 'type' in {list(LIGHT_TYPES)}")
        _vec(light.get("position"), f"{where}.position")
        intensity = light.get("intensity", 1.0)
        if not isinstance(intensity, (int, float)) or not math.isfinite(intensity) or intensity <= 0:
            raise SchemaError(f"{where}.intensity: a positive number")
    camera = scene.get("camera")
    if not isinstance(camera, dict):
        raise SchemaError("'camera' must be an object with position, look_at and fov")
    _vec(camera.get("position"), "camera.position")
    _vec(camera.get("look_at"), "camera.look_at")
    fov = camera.get("fov")
    if not isinstance(fov, (int, float)) or isinstance(fov, bool) or not 0 < fov < 180:
        raise SchemaError("camera.fov: degrees, strictly between 0 and 180")
    return parsed


# ----------------------------------------------------------------------------------------------------------
# Constraints


def _overlap(a: dict, b: dict) -> float:
    """Smallest penetration depth over the three axes (> 0 on every axis means the boxes intersect)."""
    return min(min(a["hi"][k], b["hi"][k]) - max(a["lo"][k], b["lo"][k]) for k in range(3))


def _on(a: dict, b: dict) -> str | None:
    """Why `a` does not rest on `b`, or None."""
    if b["shape"] not in SUPPORT_SHAPES:
        return f"{b['id']} is a {b['shape']}; only boxes and cylinders have flat tops"
    gap = a["lo"][2] - b["hi"][2]
    if abs(gap) > TOL:
        return f"{a['id']} bottom z={a['lo'][2]:.3f} is not at {b['id']} top z={b['hi'][2]:.3f}"
    for k, axis in enumerate("xy"):
        if a["lo"][k] < b["lo"][k] - TOL or a["hi"][k] > b["hi"][k] + TOL:
            return (
                f"{a['id']} footprint {axis}=[{a['lo'][k]:.3f}, {a['hi'][k]:.3f}] is not inside "
                f"{b['id']} {axis}=[{b['lo'][k]:.3f}, {b['hi'][k]:.3f}]"
            )
    return None


def _angle_deg(u: list[float], v: list[float]) -> float:
    nu, nv = math.hypot(*u), math.hypot(*v)
    cos = sum(a * b for a, b in zip(u, v)) / (nu * nv)
    return math.degrees(math.acos(max(-1.0, min(1.0, cos))))


def check_constraints(meta: dict, scene: dict, objects: list[dict]) -> list[tuple[str, str | None]]:
    """(constraint, reason it fails or None) for every constraint of the task."""
    out: list[tuple[str, str | None]] = []
    by_id = {o["id"]: o for o in objects}
    for group in meta["counts"]:
        got = sum(
            o["shape"] == group["shape"] and group["material"] in (None, o["material"]) for o in objects
        )
        key = group["shape"] if group["material"] is None else f"{group['material']} {group['shape']}"
        reason = None if got == group["count"] else f"{got} {key}(s); {group['count']} required"
        out.append((f"count[{key}]", reason))
    total = sum(g["count"] for g in meta["counts"])
    out.append(
        ("count[total]", None if len(objects) == total else f"{len(objects)} objects; {total} required")
    )
    for oid, want in meta["named"].items():
        o = by_id.get(oid)
        if o is None:
            reason = f"no object with id {oid!r}"
        elif (o["shape"], o["material"]) != (want["shape"], want["material"]):
            reason = f"{oid} is a {o['material']} {o['shape']}; a {want['material']} {want['shape']} required"
        else:
            reason = None
        out.append((f"named[{oid}]", reason))
    lo, hi = meta["bounds"]["min"], meta["bounds"]["max"]
    for o in objects:
        floor = None if o["lo"][2] >= -TOL else f"{o['id']} bottom z={o['lo'][2]:.3f} is below the floor"
        out.append((f"floor[{o['id']}]", floor))
        outside = [
            axis for k, axis in enumerate("xyz") if o["lo"][k] < lo[k] - TOL or o["hi"][k] > hi[k] + TOL
        ]
        out.append(
            (f"bounds[{o['id']}]", f"{o['id']} leaves the bounds in {''.join(outside)}" if outside else None)
        )
        if meta["min_size"] is not None:
            small = min(b - a for a, b in zip(o["lo"], o["hi"]))
            reason = (
                None
                if small >= meta["min_size"] - TOL
                else f"{o['id']} extent {small:.3f} < {meta['min_size']}"
            )
            out.append((f"min_size[{o['id']}]", reason))
    if meta["no_overlap"]:
        for i, a in enumerate(objects):
            for b in objects[i + 1 :]:
                depth = _overlap(a, b)
                reason = f"{a['id']} and {b['id']} overlap by {depth:.3f}" if depth > TOL else None
                out.append((f"no_overlap[{a['id']}|{b['id']}]", reason))
    for top, base in meta["on"]:
        if top not in by_id or base not in by_id:
            out.append((f"on[{top}|{base}]", f"{top if top not in by_id else base} is missing"))
        else:
            out.append((f"on[{top}|{base}]", _on(by_id[top], by_id[base])))
    out.append(("light", None if scene["lights"] else "the scene has no light"))
    out.append(("camera", _camera_reason(scene["camera"], objects)))
    return out


def _camera_reason(camera: dict, objects: list[dict]) -> str | None:
    pos, at, fov = camera["position"], camera["look_at"], float(camera["fov"])
    view = [a - p for a, p in zip(at, pos)]
    if math.hypot(*view) < 1e-6:
        return "camera.position equals camera.look_at"
    for o in objects:
        to = [c - p for c, p in zip(o["center"], pos)]
        if math.hypot(*to) < 1e-6:
            return f"the camera sits at the centre of {o['id']}"
        angle = _angle_deg(view, to)
        if angle > fov / 2 + CAMERA_TOL_DEG:
            return f"{o['id']} is {angle:.1f} deg off the view axis; the half field of view is {fov / 2:.1f}"
    return None


# ----------------------------------------------------------------------------------------------------------
# Tasks


def _describe(meta: dict) -> str:
    lo, hi = meta["bounds"]["min"], meta["bounds"]["max"]
    lines = [
        "Write a 3D scene as one JSON object (you may put it in a ```json block; give exactly one scene).",
        "",
        'Format: {"objects": [...], "lights": [...], "camera": {...}}.',
        '- Each object: "id" (unique string), "shape" ("box", "sphere" or "cylinder"; cylinders stand '
        'upright), "position" [x, y, z] (the centre of the object; z is up), "size" (box: [w, d, h]; '
        'sphere: radius; cylinder: [radius, height]), "material" {"name": ..., "color": "#rrggbb"}.',
        '- Each light: "type" (point, directional, spot or area), "position" [x, y, z], "intensity" > 0.',
        '- Camera: "position" [x, y, z], "look_at" [x, y, z], "fov" in degrees.',
        "",
        f"Constraints (geometry uses axis-aligned bounding boxes, tolerance {TOL}):",
    ]
    plural = {"box": "boxes", "sphere": "spheres", "cylinder": "cylinders"}
    wanted = [
        " ".join(
            [str(g["count"])]
            + ([g["material"]] if g["material"] is not None else [])
            + [g["shape"] if g["count"] == 1 else plural[g["shape"]]]
        )
        for g in meta["counts"]
    ]
    total = sum(g["count"] for g in meta["counts"])
    lines.append(f"- Exactly {total} objects: {', '.join(wanted)}; nothing else.")
    if any(g["material"] is not None for g in meta["counts"]):
        lines.append(f"- Material names come from: {', '.join(MATERIALS)}.")
    for oid, want in meta["named"].items():
        lines.append(f'- The object with id "{oid}" is a {want["material"]} {want["shape"]}.')
    for top, base in meta["on"]:
        lines.append(
            f'- "{top}" rests on "{base}": its bottom touches the top of "{base}" and its footprint '
            f'lies inside the footprint of "{base}".'
        )
    lines.append("- Every object is on or above the floor (z >= 0).")
    lines.append(
        f"- Every object lies inside x in [{lo[0]}, {hi[0]}], y in [{lo[1]}, {hi[1]}], "
        f"z in [{lo[2]}, {hi[2]}]."
    )
    if meta["no_overlap"]:
        lines.append("- No two objects overlap (touching is allowed).")
    if meta["min_size"] is not None:
        lines.append(f"- Every object is at least {meta['min_size']} across in each of x, y and z.")
    lines.append("- At least one light.")
    lines.append(
        "- The camera looks at the scene: every object's centre lies within half the fov of the view axis."
    )
    return "\n".join(lines)


def _make_task(seed: int, index: int, level: int) -> Task:
    rng = random.Random(f"scene3d:{seed}:{index}:{level}")
    spec = _LEVELS[level]
    n = rng.randint(*spec["n"])
    half = round(rng.uniform(*spec["half"]), 1)
    cx, cy = round(rng.uniform(-1.0, 1.0), 1), round(rng.uniform(-1.0, 1.0), 1)
    height = round(rng.uniform(*spec["height"]), 1)
    bounds = {
        "min": [round(cx - half, 1), round(cy - half, 1), 0.0],
        "max": [round(cx + half, 1), round(cy + half, 1), height],
    }
    use_material = level >= 1
    mats = list(MATERIALS)
    named: dict[str, dict] = {}
    chain: list[str] = []
    for k, name in enumerate(rng.sample(_NAMES, spec["chain"])):
        # bottom to top: supports need flat tops; the top of the stack may be anything
        shape = rng.choice(SHAPES if k == spec["chain"] - 1 else SUPPORT_SHAPES)
        named[name] = {"shape": shape, "material": rng.choice(mats)}
        chain.append(name)
    extra = [(rng.choice(SHAPES), rng.choice(mats) if use_material else None) for _ in range(n - len(chain))]
    groups: dict[tuple, int] = {}
    for want in named.values():
        key = (want["shape"], want["material"] if use_material else None)
        groups[key] = groups.get(key, 0) + 1
    for key in extra:
        groups[key] = groups.get(key, 0) + 1
    counts = [{"shape": s, "material": m, "count": c} for (s, m), c in sorted(groups.items(), key=str)]
    meta = {
        "level": level,
        "bounds": bounds,
        "counts": counts,
        "named": named,
        "on": [[chain[k + 1], chain[k]] for k in range(len(chain) - 1)],
        "no_overlap": level >= 1,
        "min_size": spec["min_size"],
    }
    return Task(
        id=f"scene3d-{seed}-{level}-{index}",
        domain="scene3d",
        prompt=_describe(meta),
        metadata=meta,
        difficulty=level,
    )


def _size(shape: str, extent: float) -> Any:
    return {"box": [extent] * 3, "sphere": extent / 2, "cylinder": [extent / 2, extent]}[shape]


def build_reference(meta: dict) -> dict:
    """A scene satisfying `meta`: each stack (or lone object) centred in its own cell of a floor grid."""
    chain = [base for _, base in meta["on"]] + ([meta["on"][-1][0]] if meta["on"] else [])
    lone_named = [oid for oid in meta["named"] if oid not in chain]
    units: list[list[tuple[str, str, str]]] = []  # each: bottom-to-top (id, shape, material)
    if chain:
        units.append([(oid, meta["named"][oid]["shape"], meta["named"][oid]["material"]) for oid in chain])
    units += [[(oid, meta["named"][oid]["shape"], meta["named"][oid]["material"])] for oid in lone_named]
    remaining = {(g["shape"], g["material"]): g["count"] for g in meta["counts"]}
    for unit in units:
        for _, shape, mat in unit:
            key = (shape, mat) if (shape, mat) in remaining else (shape, None)
            remaining[key] -= 1
    k = 0
    for (shape, mat), count in sorted(remaining.items(), key=str):
        for _ in range(count):
            k += 1
            units.append([(f"{shape}{k}", shape, mat or list(MATERIALS)[k % len(MATERIALS)])])
    lo, hi = meta["bounds"]["min"], meta["bounds"]["max"]
    cols = math.ceil(math.sqrt(len(units)))
    rows = math.ceil(len(units) / cols)
    cell = min((hi[0] - lo[0]) / cols, (hi[1] - lo[1]) / rows)
    objects = []
    for u, unit in enumerate(units):
        x = lo[0] + cell * (u % cols + 0.5)
        y = lo[1] + cell * (u // cols + 0.5)
        z = 0.0
        for level, (oid, shape, mat) in enumerate(unit):
            extent = round(min(0.5 * cell * 0.8**level, 0.9 * (hi[2] - lo[2]) / len(unit)), 4)
            objects.append(
                {
                    "id": oid,
                    "shape": shape,
                    "position": [round(x, 4), round(y, 4), round(z + extent / 2, 4)],
                    "size": _size(shape, extent),
                    "material": {"name": mat, "color": MATERIALS.get(mat, "#808080")},
                }
            )
            z = round(z + extent, 4)
    center = [(a + b) / 2 for a, b in zip(lo, hi)]
    radius = math.dist(lo, hi) / 2
    d = 2.5 * radius / math.sqrt(1 + 1 + 0.64)
    camera = {"position": [round(center[0] + d, 3), round(center[1] - d, 3), round(center[2] + 0.8 * d, 3)]}
    camera.update(look_at=[round(c, 3) for c in center], fov=60)
    light = {
        "type": "point",
        "position": [round(center[0], 3), round(center[1], 3), round(hi[2] + 2.0, 3)],
        "intensity": 1.0,
    }
    return {"objects": objects, "lights": [light], "camera": camera}


class Scene3DEnvironment(SingleTurnEnvironment):
    name = "scene3d"
    levels = (0, 1, 2, 3)

    def draw_levels(self, seed: int, n: int) -> list[int | None]:
        return [self.levels[i % len(self.levels)] for i in range(n)]  # the levels in turn

    def task_at(self, seed: int, index: int, level: int | None) -> Task:
        return _make_task(seed, index, level)

    def reference_solution(self, task: Task) -> str:
        scene = build_reference(task.metadata)
        objects = ",\n    ".join(json.dumps(o) for o in scene["objects"])
        rest = ",\n  ".join(f"{json.dumps(k)}: {json.dumps(scene[k])}" for k in ("lights", "camera"))
        return f'```json\n{{\n  "objects": [\n    {objects}\n  ],\n  {rest}\n}}\n```'

    def score(self, task: Task, completion: str) -> Score:
        try:
            scene = extract_scene(completion)
            objects = validate(scene)
        except SchemaError as e:
            return Score(0.0, "format_error", {"reason": str(e)})
        results = check_constraints(task.metadata, scene, objects)
        failed = [{"constraint": name, "reason": reason} for name, reason in results if reason is not None]
        satisfied = len(results) - len(failed)
        details = {"satisfied": satisfied, "total": len(results), "fraction": satisfied / len(results)}
        details["failed"] = failed
        return Score(1.0 if not failed else 0.0, "ok" if not failed else "wrong", details)


# ----------------------------------------------------------------------------------------------------------
# Preview


def render_png(scene: dict | str, path: str, *, dpi: int = 80) -> None:
    """Draws `scene` (a dict, or a completion holding one) to `path` as a PNG, seen from its camera."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from mpl_toolkits.mplot3d.art3d import Poly3DCollection

    if isinstance(scene, str):
        scene = extract_scene(scene)
    objects = validate(scene)
    fig = plt.figure(figsize=(6, 6))
    ax = fig.add_subplot(projection="3d")
    u, v = np.meshgrid(np.linspace(0, 2 * np.pi, 24), np.linspace(0, np.pi, 12))
    for raw, obj in zip(scene["objects"], objects):
        color = raw["material"]["color"]
        (x0, y0, z0), (x1, y1, z1) = obj["lo"], obj["hi"]
        cx, cy, cz = obj["center"]
        r = (x1 - x0) / 2
        if obj["shape"] == "box":
            c = np.array([[x, y, z] for z in (z0, z1) for y in (y0, y1) for x in (x0, x1)])
            faces = [[0, 1, 3, 2], [4, 5, 7, 6], [0, 1, 5, 4], [2, 3, 7, 6], [0, 2, 6, 4], [1, 3, 7, 5]]
            ax.add_collection3d(
                Poly3DCollection([c[f] for f in faces], facecolors=color, edgecolors="k", alpha=0.8)
            )
        elif obj["shape"] == "sphere":
            ax.plot_surface(
                cx + r * np.cos(u) * np.sin(v),
                cy + r * np.sin(u) * np.sin(v),
                cz + r * np.cos(v),
                color=color,
            )
        else:
            theta, zz = np.meshgrid(np.linspace(0, 2 * np.pi, 24), np.array([z0, z1]))
            ax.plot_surface(cx + r * np.cos(theta), cy + r * np.sin(theta), zz, color=color)
            ring = np.linspace(0, 2 * np.pi, 24)
            cap = [list(zip(cx + r * np.cos(ring), cy + r * np.sin(ring), [z1] * 24))]
            ax.add_collection3d(Poly3DCollection(cap, facecolors=color, edgecolors="k"))
        ax.text(cx, cy, z1, obj["id"], fontsize=7)
    for light in scene["lights"]:
        ax.scatter(*light["position"], color="orange", marker="*", s=120)
    cam = scene["camera"]
    pos, at = np.array(cam["position"], float), np.array(cam["look_at"], float)
    lo = np.min([o["lo"] for o in objects], axis=0)
    hi = np.max([o["hi"] for o in objects], axis=0)
    span = max(float(np.max(hi - lo)), 1e-3)
    mid = (lo + hi) / 2
    ax.set_xlim(mid[0] - span / 2, mid[0] + span / 2)
    ax.set_ylim(mid[1] - span / 2, mid[1] + span / 2)
    ax.set_zlim(max(0.0, mid[2] - span / 2), max(0.0, mid[2] - span / 2) + span)
    view = pos - at
    ax.view_init(
        elev=math.degrees(math.atan2(view[2], math.hypot(view[0], view[1]))),
        azim=math.degrees(math.atan2(view[1], view[0])),
    )
    ax.set_xlabel("x")
    ax.set_ylabel("y")
    ax.set_zlabel("z")
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
