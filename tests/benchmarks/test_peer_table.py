"""The README's speed-beside-the-peers table is the one `python -m benchmarks peer_table` builds from the
committed raw lines (benchmarks/results/grpo_step.jsonl, decode_peer.jsonl): no figure in it was typed by
hand."""

import os

from benchmarks import peer_table
from benchmarks.record import ROOT


def test_readme_table_is_generated_from_the_results():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    inside = readme.split(peer_table.BEGIN, 1)[1].split(peer_table.END, 1)[0]
    assert inside.strip() == peer_table.table().strip(), (
        "README's peer table is stale: python -m benchmarks peer_table --write README.md"
    )
