"""`python -m envs.sandbox [--runs=N]`: the isolation here and the start latency, one JSON line."""

import json
import sys

from envs.sandbox.box import isolation, start_latency


def main(argv: list[str]) -> None:
    runs = int(argv[0].partition("=")[2]) if argv and argv[0].startswith("--runs=") else 50
    print(json.dumps({**isolation().to_json(), **start_latency(runs)}))


if __name__ == "__main__":
    main(sys.argv[1:])
