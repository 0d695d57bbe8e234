"""Imports run one way: configs -> pallas_kernels -> model -> inference -> rl, with envs beside them importing
nothing of ours but configs; and no two modules import each other, directly or through others.

Every `import` and `from ... import` of the source is read with `ast` (function-local ones included, and
relative ones resolved). A module's imports are its edges: `from model.io import hf` is an edge to
`model.io.hf`, `from model import sharding` to `model.sharding`, `import model` to `model` (its
`__init__.py`). The check, also as a command: `python tests/test_imports.py` prints every upward import and
every circle, and exits 1 when there is one.
"""

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK = {"configs": 0, "pallas_kernels": 1, "model": 2, "inference": 3, "rl": 4}
PACKAGES = (*RANK, "envs")


def modules(root: str = ROOT) -> dict[str, str]:
    """{dotted module name: path} of every source file of the packages (a package is its __init__)."""
    out = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(root, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    dotted = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                    out[dotted.removesuffix(".__init__")] = path
    return out


def _imported(module: str, path: str):
    """(base, names) of each import statement of `module`: `import a.b` is ("a.b", ()), `from a import b, c`
    is ("a", ("b", "c")); relative bases resolved."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            yield base, tuple(a.name for a in node.names)


def graph(root: str = ROOT) -> dict[str, set[str]]:
    """{module: modules it imports}, within the packages. `from a import b` is an edge to the module a.b
    when there is one, else to a (a name a's `__init__.py` defines or re-exports): a package's
    `__init__` counts where its own names are used, not as the way to its submodules."""
    mods = modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        for base, names in _imported(module, path):
            targets = {f"{base}.{n}" if f"{base}.{n}" in mods else resolve(base) for n in names}
            edges[module] |= (targets or {resolve(base)}) - {None, module}
    return edges


def upward(importer: str, imported: str) -> bool:
    """Whether `importer`'s package sits below `imported`'s (or envs imports one of ours but configs)."""
    a, b = importer.split(".")[0], imported.split(".")[0]
    if a == b or b not in PACKAGES:
        return False
    if a == "envs":
        return b != "configs"
    return b != "envs" and RANK[b] > RANK[a]


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def problems(root: str = ROOT) -> list[str]:
    edges = graph(root)
    out = [f"upward: {a} imports {b}" for a in sorted(edges) for b in sorted(edges[a]) if upward(a, b)]
    out += [f"circle: {' <-> '.join(c)}" for c in circles(edges)]
    return out


def test_the_checker_sees_an_upward_import_and_a_circle(tmp_path):
    assert upward("model.plan", "rl.train_step") and upward("envs.pool", "model.io.tokenizer")
    assert not upward("rl.train", "model.io.hf") and not upward("envs.base", "configs.schema")
    assert not upward("inference.engine", "envs.base") and not upward("model.layers", "jax")
    for name, text in {
        "model/__init__.py": "",
        "model/a.py": "def f():\n    from model import b\n",  # function-local imports count
        "model/b.py": "from . import c\n",  # relative ones too
        "model/c.py": "import model.a\n",
        "model/d.py": "from model.a import f\nfrom rl import train\n",
        "rl/__init__.py": "",
        "rl/train.py": "",
    }.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert problems(str(tmp_path)) == [
        "upward: model.d imports rl.train",
        "circle: model.a <-> model.b <-> model.c",
    ]


def test_imports_run_one_way_without_circles():
    found = problems()
    assert not found, "\n".join(found)


if __name__ == "__main__":
    found = problems()
    print("\n".join(found) or f"{len(modules())} modules: imports run one way, no circle")
    sys.exit(1 if found else 0)
