"""The README's speed-beside-the-peers table is the one `benchmarks/peer_table.py` builds from the committed
raw lines (benchmarks/results/grpo_step.jsonl, decode_peer.jsonl): no figure in it was typed by hand."""

import os

from benchmark_modules import ROOT, load


def test_readme_table_is_generated_from_the_results():
    peer_table = load("peer_table")
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    inside = readme.split(peer_table.BEGIN, 1)[1].split(peer_table.END, 1)[0]
    assert inside.strip() == peer_table.table().strip(), (
        "README's peer table is stale: python benchmarks/peer_table.py --write README.md"
    )
