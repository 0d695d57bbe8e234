"""benchmarks/profile_ops.py: XLA op thread time by kind from a jax.profiler trace, host events left out.
The events below are made by hand, so every sum is checked against arithmetic done here."""

from benchmarks import profile_ops


def _x(name, tid, ts, dur):
    return {"ph": "X", "name": name, "tid": tid, "ts": ts, "dur": dur}


def test_kinds_ops_and_threads_are_summed_by_hand():
    events = [
        _x("ynn_fusion.3", 1, 0, 3000),  # two matmul calls of one op on thread 1: 3 + 1 ms
        _x("ynn_fusion.3", 1, 3000, 1000),
        _x("ynn_fusion.7", 2, 0, 2000),  # another matmul on thread 2, at the same time
        _x("copy_fusion", 2, 2000, 4000),  # no suffix: its own kind
        _x("$engine.py:251 step", 1, 0, 9000),  # Python and runtime events are not ops
        _x("ThunkExecutor::Execute", 1, 0, 9000),
        {"ph": "M", "name": "thread_name", "tid": 1},  # metadata, no duration
    ]
    s = profile_ops.summarise(events, top=2)
    assert s["op_thread_ms"] == 10.0  # 3 + 1 + 2 + 4
    assert s["span_ms"] == 6.0  # ops from t=0 to t=6 ms
    assert s["kinds"]["ynn_fusion"] == {"ms": 6.0, "share": 0.6}
    assert s["kinds"]["copy_fusion"] == {"ms": 4.0, "share": 0.4}
    assert s["top_ops_ms"] == {"ynn_fusion.3": 4.0, "copy_fusion": 4.0}
    assert s["thread_busy_ms"] == [6.0, 4.0]  # thread 2: 2 + 4; thread 1: 3 + 1
