"""Imports run one way: configs -> pallas_kernels -> model -> inference -> rl, with envs beside them importing
nothing of ours but configs. Every `import` and `from ... import` of the source (function-local ones
included) is read with `ast`; an import of a package ranked above the importing one is an upward import.

`UPWARD` lists the upward imports that exist today, by (file, imported package): a new one fails this test,
and a listed one that is gone fails it too, so the list only shrinks (the planner modules in model/ belong
above rl's train step; see the layout issue). Run it as `pytest tests/test_imports.py -q`.
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK = {"configs": 0, "pallas_kernels": 1, "model": 2, "inference": 3, "rl": 4}
PACKAGES = (*RANK, "envs")
UPWARD = {
    ("configs/base.py", "model"),
    ("configs/grpo.py", "rl"),
    ("inference/serve.py", "rl"),
    ("inference/serve_load.py", "rl"),
    ("model/plan_memory.py", "inference"),
    ("model/plan_memory.py", "rl"),
    ("model/plan_rollout.py", "inference"),
    ("model/plan_xla.py", "rl"),
}


def _imports(path: str):
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def _upward(package: str, module: str) -> bool:
    top = module.split(".")[0]
    if top not in PACKAGES or top == package:
        return False
    if package == "envs":
        return top != "configs"
    return top != "envs" and RANK[top] > RANK[package]


def upward_imports() -> set[tuple[str, str]]:
    found = set()
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                for module in _imports(path):
                    if _upward(package, module):
                        found.add((os.path.relpath(path, ROOT), module.split(".")[0]))
    return found


def test_the_checker_sees_an_upward_import():
    assert _upward("model", "rl.train_step") and _upward("envs", "model.io.tokenizer")
    assert not _upward("rl", "model.io.hf") and not _upward("envs", "configs.schema")
    assert not _upward("inference", "envs") and not _upward("model", "jax")


def test_imports_run_one_way_but_for_the_listed_ones():
    found = upward_imports()
    assert not found - UPWARD, f"new upward imports: {sorted(found - UPWARD)}"
    assert not UPWARD - found, f"gone, take them off UPWARD: {sorted(UPWARD - found)}"
