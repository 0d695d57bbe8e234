"""rl.metrics: JSONL round trip, non-finite values, the progress line, TensorBoard event files."""

import importlib.util
import io
import json
import re

import numpy as np
import pytest

from rl import metrics


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_jsonl_round_trip_converts_scalars(tmp_path):
    with metrics.MetricsLogger(tmp_path, tensorboard=False, stream=None) as log:
        log.log(0, {"reward": np.float32(0.5), "count": np.int64(3), "loss": 1.25, "flag": True})
        log.log(np.int32(1), {"reward/math": np.array(0.75), "weight/math": 1.0})
    records = metrics.read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1]
    assert records[0]["reward"] == 0.5 and records[0]["count"] == 3 and records[0]["flag"] == 1
    assert type(records[0]["reward"]) is float and type(records[0]["count"]) is int
    assert records[1]["reward/math"] == 0.75 and records[1]["weight/math"] == 1.0
    assert all(isinstance(r["time"], float) for r in records)


def test_lines_are_flushed_while_open(tmp_path):
    log = metrics.MetricsLogger(tmp_path, tensorboard=False, stream=None)
    log.log(5, {"loss": 2.0})
    assert metrics.read_metrics(tmp_path)[0]["loss"] == 2.0  # before close
    log.close()
    log.close()  # idempotent


def test_nonfinite_written_as_null_and_counted(tmp_path):
    with metrics.MetricsLogger(tmp_path, tensorboard=False, stream=None) as log:
        log.log(0, {"loss": float("nan"), "reward": 1.0})
        log.log(1, {"loss": np.float32(np.inf), "kl": -np.inf})
    text = (tmp_path / metrics.METRICS_FILE).read_text()
    assert "NaN" not in text and "Infinity" not in text
    for line in text.splitlines():  # strict JSON: no NaN literals
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard constant {c}"))
    records = metrics.read_metrics(tmp_path)
    assert records[0]["loss"] is None and records[0]["reward"] == 1.0
    assert records[1]["loss"] is None and records[1]["kl"] is None
    assert log.nonfinite == {"loss": 2, "kl": 1}


def test_non_scalar_rejected(tmp_path):
    with metrics.MetricsLogger(tmp_path, tensorboard=False, stream=None) as log:
        with pytest.raises(TypeError, match="'name'"):
            log.log(0, {"name": "abc"})
        with pytest.raises(ValueError, match="reserved"):
            log.log(0, {"step": 3})


def test_read_skips_torn_last_line_only(tmp_path):
    path = tmp_path / metrics.METRICS_FILE
    path.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "lo')
    assert metrics.read_metrics(tmp_path) == [{"step": 0, "loss": 1.0}]
    path.write_text('{"step": 0\n{"step": 1, "loss": 1.0}\n')
    with pytest.raises(ValueError, match=":1 "):
        metrics.read_metrics(tmp_path)
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        metrics.read_metrics(tmp_path / "nope")


def test_a_restart_appends_after_a_torn_last_line(tmp_path):
    """A run killed mid-write leaves half a record; its restart drops it before appending, so every line of
    the file is a whole record (the restart logs that step again)."""
    path = tmp_path / metrics.METRICS_FILE
    path.write_text('{"step": 2, "loss": 1.0}\n{"step": 3, "lo')
    with metrics.MetricsLogger(tmp_path, tensorboard=False, stream=None) as log:
        log.log(3, {"loss": 0.5})
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 3]
    assert json.loads(lines[1])["loss"] == 0.5


@pytest.mark.parametrize(
    ("text", "dropped"),
    [("", 0), ("a\n", 0), ("a\nbc", 2), ("abc", 3), ("a\n" + "x" * 70_000, 70_000)],
)
def test_drop_torn_tail(tmp_path, text, dropped):
    path = tmp_path / "f"
    path.write_text(text)
    assert metrics.drop_torn_tail(path) == dropped
    assert path.read_text() == text[: len(text) - dropped]
    assert metrics.drop_torn_tail(tmp_path / "missing") == 0


def test_by_step_merges_resumed_and_split_records():
    records = [
        {"step": 1, "loss": 3.0},
        {"step": 2, "loss": 2.0},
        {"step": 2, "eval/math/pass@1": 0.5},  # a second record of the same step
        {"step": 2, "loss": 2.5},  # a resumed run re-logs step 2
        {"step": 1, "loss": 3.5},
    ]
    assert metrics.by_step(records) == [
        {"step": 1, "loss": 3.5},
        {"step": 2, "loss": 2.5, "eval/math/pass@1": 0.5},
    ]


def test_format_duration():
    assert metrics.format_duration(0) == "0:00:00"
    assert metrics.format_duration(59.6) == "0:01:00"
    assert metrics.format_duration(3725.4) == "1:02:05"
    assert metrics.format_duration(-3) == "0:00:00"


def test_progress_line_format():
    # 2 steps/s with 88 steps to go: 44 s.
    line = metrics.progress_line(12, 100, {"reward": 0.25, "loss": 0.012344}, 2.0)
    assert line == "step 12/100 | reward 0.250 | loss 0.01234 | 2.00 steps/s | ETA 0:00:44"
    assert metrics.progress_line(3, None, {"reward_mean": 1.0}, None) == "step 3 | reward 1.000 | loss - | -"
    assert metrics.progress_line(0, 10, {}, None).endswith("ETA -")


def test_progress_every_n_steps_when_not_a_tty(tmp_path):
    out = io.StringIO()
    with metrics.MetricsLogger(
        tmp_path, tensorboard=False, total_steps=25, stream=out, print_every=10
    ) as log:
        for step in range(1, 26):
            log.log(step, {"reward": 0.5, "loss": 1.0})
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [line.split(" |")[0] for line in lines] == ["step 1/25", "step 10/25", "step 20/25", "step 25/25"]
    pattern = r"step 25/25 \| reward 0\.500 \| loss 1 \| [0-9.]+ steps/s \| ETA 0:00:00"
    assert re.fullmatch(pattern, lines[-1]), lines[-1]


def test_progress_rewritten_in_place_on_a_tty(tmp_path):
    out = _Tty()
    with metrics.MetricsLogger(tmp_path, tensorboard=False, total_steps=3, stream=out) as log:
        for step in range(3):
            log.log(step, {"loss": float("nan") if step == 2 else 1.0})
    text = out.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n") and text.count("\n") == 1
    assert text.rstrip("\n").rsplit("\r", 1)[1].startswith("step 2/3 | reward - | loss - |")
    assert "non-finite 1" in text


@pytest.mark.skipif(importlib.util.find_spec("tensorboardX") is None, reason="tensorboardX not installed")
def test_tensorboard_event_file(tmp_path):
    with metrics.MetricsLogger(tmp_path, tensorboard=True, stream=None) as log:
        assert log.tensorboard
        log.log(0, {"loss": 1.0, "reward/math": 0.5, "bad": float("nan")})
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_tensorboard_off_writes_no_events(tmp_path):
    with metrics.MetricsLogger(tmp_path, tensorboard=False, stream=None) as log:
        assert not log.tensorboard
        log.log(0, {"loss": 1.0})
    assert not (tmp_path / "tensorboard").exists()


def test_tensorboard_requested_but_missing_warns(tmp_path, capsys, monkeypatch):
    """As on an install without the tensorboard extra (the suite's venv has it: its writers are hidden)."""
    find_spec = importlib.util.find_spec
    hidden = ("tensorboardX", "tensorboard")
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in hidden else find_spec(name, *a)
    )
    with metrics.MetricsLogger(tmp_path, tensorboard=True, stream=None) as log:
        assert not log.tensorboard
        log.log(0, {"loss": 1.0})
    assert "pip install -e '.[tensorboard]'" in capsys.readouterr().err
    assert metrics.read_metrics(tmp_path)[0]["loss"] == 1.0
    assert not (tmp_path / "tensorboard").exists()
