"""Loads a script of benchmarks/ by its path: benchmarks/ on sys.path would shadow the `envs` and `rl`
packages (benchmarks/envs.py, benchmarks/rl.py) in the test process and in the environment workers it
starts."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
