"""scene3d: deterministic tasks, a reference that always passes, and one failing scene per constraint kind."""

import copy
import json

import pytest

from envs.domains import scene3d
from envs.registry import make

ENV = make("scene3d")


def _task(level: int, index: int = 0):
    return ENV.sample_tasks(7, index + 1, difficulty=level)[index]


def _score(task, scene: dict):
    return ENV.score(task, "```json\n" + json.dumps(scene) + "\n```")


def _failed_kinds(score) -> set[str]:
    return {f["constraint"].split("[")[0] for f in score.details["failed"]}


def test_tasks_are_deterministic_and_cover_levels():
    a, b = ENV.sample_tasks(3, 12), ENV.sample_tasks(3, 12)
    assert [t.to_json() for t in a] == [t.to_json() for t in b]
    assert {t.difficulty for t in a} == set(ENV.levels)
    assert [t.prompt for t in ENV.sample_tasks(4, 12)] != [t.prompt for t in a]
    assert all(t.difficulty == 2 for t in ENV.sample_tasks(3, 5, difficulty=2))
    assert ENV.reference_solution(a[5]) == ENV.reference_solution(b[5])


@pytest.mark.parametrize("level", scene3d.Scene3DEnvironment.levels)
def test_reference_scores_one(level):
    for task in ENV.sample_tasks(11, 30, difficulty=level):
        score = ENV.score(task, ENV.reference_solution(task))
        assert (score.reward, score.status) == (1.0, "ok"), (task.id, score.details)
        assert score.details["fraction"] == 1.0
        # Unfenced JSON is accepted too.
        assert ENV.score(task, json.dumps(scene3d.build_reference(task.metadata))).reward == 1.0


def _ref(task) -> dict:
    return copy.deepcopy(scene3d.build_reference(task.metadata))


def _obj(scene: dict, oid: str) -> dict:
    return next(o for o in scene["objects"] if o["id"] == oid)


def _unnamed(task, scene: dict) -> dict:
    return next(o for o in scene["objects"] if o["id"] not in task.metadata["named"])


def test_each_constraint_kind_fails_with_its_reason():
    task = _task(3)  # level 3 has every kind of constraint
    meta = task.metadata
    top, base = meta["on"][0]
    cases = {}

    s = _ref(task)
    s["objects"].remove(_unnamed(task, s))
    cases["count"] = s  # also count[total]

    s = _ref(task)
    _obj(s, base)["id"] = "renamed"
    cases["named"] = s

    s = _ref(task)
    _obj(s, base)["material"]["name"] = "not-" + _obj(s, base)["material"]["name"]
    cases["named-material"] = s

    s = _ref(task)
    _unnamed(task, s)["position"][2] = -1.0
    cases["floor"] = s

    s = _ref(task)
    _unnamed(task, s)["position"][0] = meta["bounds"]["max"][0] + 0.05
    cases["bounds"] = s

    s = _ref(task)
    o = _unnamed(task, s)
    o.update(shape="box", size=[0.1, 1.0, 1.0])
    cases["min_size"] = s

    s = _ref(task)
    a, b = [o for o in s["objects"] if o["id"] not in meta["named"]][:2]
    a["position"] = list(b["position"])
    cases["no_overlap"] = s

    s = _ref(task)
    _obj(s, top)["position"][2] += 0.05  # floats above its support
    cases["on"] = s

    s = _ref(task)
    _obj(s, top)["position"][0] += 0.2  # overhangs its support by more than its margin
    cases["on-footprint"] = s

    s = _ref(task)
    s["lights"] = []
    cases["light"] = s

    s = _ref(task)
    s["camera"]["look_at"] = [c + 100.0 for c in s["camera"]["position"]]
    cases["camera"] = s

    expect = {
        "count": {"count"},
        "named": {"named", "on"},
        "named-material": {"named", "count"},
        "floor": {"floor", "bounds"},
        "bounds": {"bounds"},
        "min_size": {"min_size"},
        "no_overlap": {"no_overlap"},
        "on": {"on"},
        "on-footprint": {"on"},
        "light": {"light"},
        "camera": {"camera"},
    }
    for name, scene in cases.items():
        score = _score(task, scene)
        assert score.reward == 0.0 and score.status == "wrong", (name, score)
        kinds = _failed_kinds(score)
        assert expect[name] <= kinds, (name, score.details["failed"])
        assert 0.0 < score.details["fraction"] < 1.0
        assert all(f["reason"] for f in score.details["failed"])
    reasons = " ".join(f["reason"] for f in _score(task, cases["on"]).details["failed"])
    assert f"{top} bottom" in reasons and f"{base} top" in reasons


def test_level1_overlap_and_level0_has_no_overlap_rule():
    t1, t0 = _task(1), _task(0)
    for task, expect in ((t1, 0.0), (t0, 1.0)):
        s = _ref(task)
        a, b = s["objects"][:2]
        a["position"] = list(b["position"])
        a["size"], b["size"] = scene3d._size(a["shape"], 0.5), scene3d._size(b["shape"], 0.5)
        assert _score(task, s).reward == expect


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda s: s.pop("objects"), "no JSON scene"),
        (lambda s: s.update(objects=[]), "'objects' must be a non-empty list"),
        (lambda s: s["objects"][0].update(shape="cone"), "objects[0].shape"),
        (
            lambda s: s["objects"][0].update(
                size=[1.0, -1.0, 1.0] if s["objects"][0]["shape"] == "box" else -1
            ),
            "size",
        ),
        (lambda s: s["objects"][1].update(id=s["objects"][0]["id"]), "duplicate id"),
        (lambda s: s["objects"][0].update(position=[0, 0]), "objects[0].position"),
        (lambda s: s["objects"][0]["material"].update(color="red"), "color"),
        (lambda s: s["objects"][0].pop("material"), "material"),
        (lambda s: s.pop("camera"), "'camera'"),
        (lambda s: s["camera"].update(fov=200), "camera.fov"),
        (lambda s: s.update(lights={}), "'lights' must be a list"),
        (lambda s: s["lights"].append({"type": "laser", "position": [0, 0, 1]}), "lights[1]"),
    ],
)
def test_schema_errors_are_format_errors(mutate, reason):
    task = _task(2)
    s = _ref(task)
    mutate(s)
    score = _score(task, s)
    assert (score.reward, score.status) == (0.0, "format_error")
    assert reason in score.details["reason"], score.details


def test_non_finite_numbers_and_garbage_are_format_errors():
    task = _task(1)
    text = json.dumps(_ref(task)).replace("[", "[NaN, ", 1)
    assert ENV.score(task, text).status == "format_error"
    for junk in ("", "   ", "PASS", "OK", task.prompt, "{" * 5000, "x" * (scene3d.MAX_CHARS + 1)):
        score = ENV.score(task, junk)
        assert (score.reward, score.status) == (0.0, "format_error"), junk[:40]


def test_two_scenes_are_a_format_error():
    task = _task(2)
    ref = json.dumps(_ref(task))
    for text in (
        f"```json\n{ref}\n```\n```json\n{ref}\n```",
        f"{ref}\n{ref}",
        f"[{ref}, {ref}]",
    ):
        score = ENV.score(task, text)
        assert score.status == "format_error" and "2 JSON scenes" in score.details["reason"]
    # Prose and a non-scene JSON object around one fenced scene are fine.
    assert ENV.score(task, 'Plan: {"note": 1}\n```json\n' + ref + "\n```\nDone.").reward == 1.0


def test_render_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install '.[notebook]')")
    task = _task(3)
    path = tmp_path / "scene.png"
    scene3d.render_png(ENV.reference_solution(task), str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
