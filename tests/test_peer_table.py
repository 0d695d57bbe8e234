"""The README's speed-beside-the-peers table is the one `benchmarks/peer_table.py` builds from the committed
raw lines (benchmarks/results/grpo_step.jsonl, decode_peer.jsonl): no figure in it was typed by hand."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _peer_table():
    # Loaded by path: benchmarks/ on sys.path would shadow the `envs` and `rl` packages (benchmarks/envs.py,
    # benchmarks/rl.py) in this process and in the environment workers it starts.
    spec = importlib.util.spec_from_file_location(
        "peer_table", os.path.join(ROOT, "benchmarks", "peer_table.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_table_is_generated_from_the_results():
    peer_table = _peer_table()
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    inside = readme.split(peer_table.BEGIN, 1)[1].split(peer_table.END, 1)[0]
    assert inside.strip() == peer_table.table().strip(), (
        "README's peer table is stale: python benchmarks/peer_table.py --write README.md"
    )
