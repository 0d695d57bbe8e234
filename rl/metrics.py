"""Run metrics: one JSON line per `log` call in `workdir/metrics.jsonl`, TensorBoard scalars, a progress line.

Record format: `{"step": int, "time": unix seconds, <key>: number | null, ...}`, one object per line, strict
JSON (a NaN or an infinity is written as `null` and counted in `MetricsLogger.nonfinite`). A run resumed from
a checkpoint appends to the same file, so a step may appear twice; `by_step` merges records per step, later
values winning.

Key naming convention (`rl.plot` and dashboards read these; "/" groups keys in TensorBoard):

    reward, loss                  step means over all domains (the progress line shows these, or
                                  rollout/reward_mean and train/loss, as rl.train names them)
    reward/<domain>               mean reward of the step's samples of <domain>
    weight/<domain>               the curriculum's sampling weight of <domain> (`rl.curriculum`)
    status/<status>               samples of the step with that `envs.Score` status
    eval/<domain>/pass@1          held-out pass@1 from `rl.evaluate` (also pass@<k>, reward, ...)
    time/<phase>                  seconds spent in a phase of the step (rollout, train, ...)

JAX-free: values may be numpy or JAX scalars (anything `float()` accepts); nothing here imports JAX.
"""

from __future__ import annotations

import importlib.util
import json
import math
import numbers
import os
import pathlib
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, TextIO

METRICS_FILE = "metrics.jsonl"
# The progress line shows the first of these present (rl.train logs rollout/... and train/... keys).
REWARD_KEYS = ("reward", "reward_mean", "rollout/reward_mean")
LOSS_KEYS = ("loss", "train/loss")


def _scalar(key: str, value: Any) -> int | float:
    """A Python int (for ints and bools) or float; raises on anything that is no scalar number."""
    if isinstance(value, (bool, numbers.Integral)):
        return int(value)
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"metric {key!r}={value!r} is not a scalar number") from e


def format_duration(seconds: float) -> str:
    """h:mm:ss, e.g. 3725.4 -> '1:02:05'."""
    s = max(0, int(round(seconds)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _first(metrics: Mapping[str, Any], keys: Iterable[str]) -> float | None:
    for k in keys:
        if metrics.get(k) is not None:
            return metrics[k]
    return None


def progress_line(step: int, total: int | None, metrics: Mapping[str, Any], steps_per_s: float | None) -> str:
    """'step 12/100 | reward 0.250 | loss 0.01234 | 1.50 steps/s | ETA 0:00:59' ('-' where unknown)."""
    reward, loss = _first(metrics, REWARD_KEYS), _first(metrics, LOSS_KEYS)
    parts = [f"step {step}/{total}" if total else f"step {step}"]
    parts.append("reward " + ("-" if reward is None else f"{reward:.3f}"))
    parts.append("loss " + ("-" if loss is None else f"{loss:.4g}"))
    parts.append("-" if not steps_per_s else f"{steps_per_s:.2f} steps/s")
    if total:
        eta = (total - step) / steps_per_s if steps_per_s else None
        parts.append("ETA " + ("-" if eta is None else format_duration(eta)))
    return " | ".join(parts)


def _summary_writer(logdir: pathlib.Path, tensorboard: bool | None) -> Any:
    """A TensorBoard SummaryWriter (tensorboardX, else torch's), None when off or neither is installed."""
    if tensorboard is False:
        return None
    if importlib.util.find_spec("tensorboardX") is not None:
        from tensorboardX import SummaryWriter

        return SummaryWriter(str(logdir))
    # torch's writer needs the `tensorboard` package; checking first avoids importing torch for nothing.
    if importlib.util.find_spec("tensorboard") is not None and importlib.util.find_spec("torch") is not None:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(logdir))
    if tensorboard:
        print("rl.metrics: no TensorBoard event files: pip install -e '.[tensorboard]'", file=sys.stderr)
    return None


class NullLogger:
    """The logger of processes other than 0 (`rl.distributed`): logs nothing, writes nothing."""

    tensorboard = False

    def log(self, step: int, metrics: Mapping[str, Any], *, progress: bool = True) -> dict[str, Any]:
        return dict(metrics)

    def close(self) -> None:
        pass


class MetricsLogger:
    """Appends metrics to `workdir/metrics.jsonl` (flushed per line), TensorBoard and a progress line.

    `tensorboard`: event files go to `workdir/tensorboard` when a writer (tensorboardX) is importable,
    unless False; True also says on stderr when none is installed. The progress line goes to `stream`
    (default: the current sys.stderr; None: nowhere): rewritten in place (`\\r`) on a terminal, else one
    line every `print_every` steps (and at the last step).
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        tensorboard: bool | None = None,
        total_steps: int | None = None,
        stream: TextIO | None | str = "stderr",
        print_every: int = 10,
    ):
        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.path = self.workdir / METRICS_FILE
        # "stderr": sys.stderr when the logger is made (a default bound at import would keep whatever stream
        # sys.stderr was then, e.g. one a test harness has closed since).
        stream = sys.stderr if stream == "stderr" else stream
        self.total_steps, self.stream, self.print_every = total_steps, stream, max(1, print_every)
        self.nonfinite: Counter[str] = Counter()  # key -> NaN/inf values written as null
        drop_torn_tail(self.path)  # a run killed mid-write: its restart appends after the last whole record
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self._writer = _summary_writer(self.workdir / "tensorboard", tensorboard)
        self._tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self._start: tuple[int, float] | None = None  # (step, monotonic time) of the first call
        self._last_width = 0

    @property
    def tensorboard(self) -> bool:
        return self._writer is not None

    def log(self, step: int, metrics: Mapping[str, Any], *, progress: bool = True) -> dict[str, Any]:
        """Writes one record for `step`; returns it (non-finite values as None). `progress=False` keeps it
        out of the progress line (e.g. warm-start records, whose steps are not the run's)."""
        step = int(step)
        record: dict[str, Any] = {"step": step, "time": time.time()}
        for key, value in metrics.items():
            if key in record:
                raise ValueError(f"metric key {key!r} is reserved")
            v = _scalar(key, value)
            if isinstance(v, float) and not math.isfinite(v):
                self.nonfinite[key] += 1
                v = None
            record[key] = v
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, v in record.items():
                if key not in ("step", "time") and v is not None:
                    self._writer.add_scalar(key, v, step)
        if progress:
            self._progress(step, record)
        return record

    def _progress(self, step: int, record: Mapping[str, Any]) -> None:
        now = time.monotonic()
        if self._start is None:
            self._start = (step, now)
        first_step, t0 = self._start
        rate = (step - first_step) / (now - t0) if step > first_step and now > t0 else None
        if self.stream is None:
            return
        line = progress_line(step, self.total_steps, record, rate)
        if self.nonfinite:
            line += f" | non-finite {sum(self.nonfinite.values())}"
        if self._tty:
            self.stream.write("\r" + line.ljust(self._last_width))
            self._last_width = len(line)
        elif step % self.print_every == 0 or step == first_step or step == self.total_steps:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.close()
        if self._writer is not None:
            self._writer.close()
        if self._tty and self._last_width:
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def drop_torn_tail(path: pathlib.Path) -> int:
    """Truncates `path` after its last newline (a record is one whole line, so what follows it is a write that
    a killed run left unfinished); returns the bytes dropped. A missing or whole file is left as it is, after
    reading its last byte only."""
    if not path.exists():
        return 0
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        f.seek(0)
        keep = f.read().rfind(b"\n") + 1  # 0 when no line was ever finished
        f.truncate(keep)
        return size - keep


def read_metrics(workdir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of `workdir/metrics.jsonl` in file order. A torn last line (a run killed mid-write) is
    skipped; a malformed line elsewhere is an error naming it."""
    path = pathlib.Path(workdir) / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {workdir} the --workdir of a training run?")
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1} is not a JSON object: {e}") from e
    return records


def by_step(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Records merged per step (a later value for a key wins: a resumed run re-logs steps), step order."""
    merged: dict[int, dict[str, Any]] = {}
    for r in records:
        merged.setdefault(int(r["step"]), {}).update(r)
    return [merged[s] for s in sorted(merged)]
