"""benchmarks/metrics_diff.py: two runs compared value by value, wall-clock values left out by name."""

import json

from benchmarks import metrics_diff


def _run(path, rows, evals=None):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if evals is not None:
        (path / "eval_after.json").write_text(json.dumps(evals))
    return str(path)


def test_equal_runs_differ_only_in_clocked_values(tmp_path):
    a = _run(tmp_path / "a", [{"step": 1, "time": 1.0, "train/loss": 0.5, "curriculum/math/cost": 3.0}])
    b = _run(tmp_path / "b", [{"step": 1, "time": 2.0, "train/loss": 0.5, "curriculum/math/cost": 4.0}])
    assert metrics_diff.compare(a, b) == {"compared": 2, "differences": []}  # step and train/loss


def test_a_changed_value_and_a_missing_key_are_named(tmp_path):
    evals = {"math": {"pass@1": 0.5, "seconds_per_task": 1.0}}
    a = _run(tmp_path / "a", [{"step": 1, "train/loss": 0.5, "reward": 1.0}], evals)
    b = _run(
        tmp_path / "b", [{"step": 1, "train/loss": 0.25}], {"math": {"pass@1": 0.75, "seconds_per_task": 2.0}}
    )
    out = metrics_diff.compare(a, b)
    assert out["differences"] == [
        "step 1: reward in one run only",
        "step 1: train/loss 0.5 != 0.25",
        "eval_after.json: math/pass@1 0.5 != 0.75",
    ]
