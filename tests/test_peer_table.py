"""The README's speed-beside-the-peers table is the one `benchmarks/peer_table.py` builds from the committed
raw lines (benchmarks/results/grpo_step.jsonl, decode_peer.jsonl): no figure in it was typed by hand."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import peer_table  # noqa: E402


def test_readme_table_is_generated_from_the_results():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    inside = readme.split(peer_table.BEGIN, 1)[1].split(peer_table.END, 1)[0]
    assert inside.strip() == peer_table.table().strip(), (
        "README's peer table is stale: python benchmarks/peer_table.py --write README.md"
    )
