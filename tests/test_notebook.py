"""notebooks/quickstart.ipynb runs top to bottom in a fresh kernel and ends with its eval table and plot.

The parameters cell is overridden papermill-style (a cell tagged `injected-parameters` right after the one
tagged `parameters`) with QUICK=True: the `test` config, so the run takes well under a minute on a 2-core
CPU with a warm compile cache (the repo's `.jax_cache`, shared with the rest of the suite).
"""

import base64
import json
import os
import pathlib
import sys

import pytest
import xla_env

_REASON = "notebook test dependencies missing (pip install -e '.[test]')"
nbformat = pytest.importorskip("nbformat", reason=_REASON)
nbclient = pytest.importorskip("nbclient", reason=_REASON)
pytest.importorskip("ipykernel", reason=_REASON)

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
CELL_TIMEOUT_S = 300  # a cold compile cache makes the two train() cells the slow ones
KERNEL = "moe-post-train-test"


def _tagged(nb, tag):
    cells = [c for c in nb.cells if tag in c.metadata.get("tags", [])]
    assert len(cells) == 1, f"expected one cell tagged {tag!r}, found {len(cells)}"
    return cells[0]


def _inject_parameters(nb, **params):
    cell = _tagged(nb, "parameters")
    source = "\n".join(f"{k} = {v!r}" for k, v in params.items())
    injected = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(nb.cells.index(cell) + 1, injected)


def _kernelspec(jupyter_dir: pathlib.Path) -> None:
    """A kernel on this interpreter (the venv, where the repo is installed), whatever other specs exist."""
    spec = jupyter_dir / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    kernel = {"argv": argv, "display_name": KERNEL, "language": "python"}
    (spec / "kernel.json").write_text(json.dumps(kernel))


def _text(cell):
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def test_quickstart_runs_end_to_end(tmp_path, monkeypatch):
    _kernelspec(tmp_path / "jupyter")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    workdir = tmp_path / "run"
    _inject_parameters(nb, QUICK=True, WORKDIR=str(workdir))
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=xla_env.child_flags(1),  # a Colab CPU runtime has one device
        JAX_COMPILATION_CACHE_DIR=str(ROOT / ".jax_cache"),
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    )
    client = nbclient.NotebookClient(
        nb,
        kernel_name=KERNEL,
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(ROOT)}},  # the kernel's working directory
    )
    client.execute(env=env)  # raises CellExecutionError, with the cell's traceback, when a cell fails

    table = _text(_tagged(nb, "evaluation"))
    rows = [line.split() for line in table.splitlines()]
    assert ["domain", "tasks", "pass@1", "pass@2"] in [r[:4] for r in rows], table
    assert ["arith", "2"] in [r[:2] for r in rows], table  # 2 held-out arith tasks (short prompts fit)
    assert (workdir / "eval.json").exists()

    images = [o for o in _tagged(nb, "plot").outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1
    png = base64.b64decode(images[0]["data"]["image/png"])
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and png == (workdir / "curves.png").read_bytes()
