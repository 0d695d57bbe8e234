"""Learning that counts (issue 17): the before/after table, GRPO raising the training reward through the main
job, and (slow) the demo recipe's held-out gain on math level -1."""

from rl import evaluate


def _row(tasks, p1, pk, k=4):
    return {"tasks": tasks, "k": k, "pass@1": p1, "pass@k": pk}


def test_format_before_after():
    before = {"math": _row(150, 0.25, 0.5), "arith": _row(100, 0.5, 0.75)}
    after = {"math": _row(150, 0.875, 0.9375), "arith": _row(100, 0.5, 0.75)}
    greedy = {"math": _row(150, 0.625, 0.625, k=1)}
    table = evaluate.format_before_after(before, after, greedy, {"math": _row(150, 0.9, 0.9, k=1)})
    # Gains by hand: math 87.5 - 25 = +62.5 points, arith 0; arith has no greedy numbers ("-").
    assert table.splitlines() == [
        "domain  prompts  greedy before  greedy after  pass@1 before  pass@1 after   gain  pass@4 before"
        "  pass@4 after",
        "arith       100              -             -          0.500         0.500   +0.0          0.750"
        "         0.750",
        "math        150          0.625         0.900          0.250         0.875  +62.5          0.500"
        "         0.938",
    ]
