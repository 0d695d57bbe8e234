"""`python -m envs.qa --domain=NAME [--domain=...] [--n=20] [--json=out.json]`: the quality gate
(`envs.qa.gate`) on each domain, a report per domain and one verdict line; exit status 1 when one fails."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from envs import registry
from envs.pool import EnvPool
from envs.qa.gate import format_report, run_checks


def _make_pool(workers: int, domains: list[str]) -> Any:
    return EnvPool(workers, domains=domains)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m envs.qa", description="The environment quality gate.")
    parser.add_argument("--domain", action="append", help="a registered domain (repeatable; default: all)")
    parser.add_argument("--n", type=int, default=20, help="tasks per level")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise", type=float, default=0.02, help="noisy-reference corruption probability")
    parser.add_argument("--json", default="", help="write the reports here")
    parser.add_argument("--workers", type=int, default=2, help="EnvPool workers; 0 scores in process")
    parser.add_argument(
        "--register", action="append", default=[], metavar="NAME=module:Class", help="register a domain first"
    )
    args = parser.parse_args(argv)
    for spec in args.register:
        name, _, target = spec.partition("=")
        registry.register(name, target)
    args.domain = args.domain or [name for name in registry.names() if name != "debug"]
    builtin = set(registry.names()) - {s.partition("=")[0] for s in args.register}
    pool_domains = [d for d in args.domain if d in builtin]
    pool = _make_pool(args.workers, pool_domains) if args.workers > 0 and pool_domains else None
    reports = []
    try:
        for domain in args.domain:
            t0 = time.perf_counter()
            report = run_checks(
                domain,
                n=args.n,
                seed=args.seed,
                pool=pool if domain in pool_domains else None,
                noise=args.noise,
            )
            reports.append(report)
            print(format_report(report), f"\n  ({time.perf_counter() - t0:.1f} s)", flush=True)
    finally:
        if pool is not None:
            pool.close()
    ok = all(r.passed for r in reports)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"passed": ok, "domains": {r.domain: r.to_json() for r in reports}},
                f,
                indent=1,
                sort_keys=True,
            )
    print(
        "gate:",
        "PASS"
        if ok
        else "FAIL: " + ", ".join(f"{r.domain} ({', '.join(r.failed())})" for r in reports if not r.passed),
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
