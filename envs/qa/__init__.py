"""The environment quality gate: `python -m envs.qa --domain=NAME`.

    gate     `run_checks(domain) -> Report`: levels, solvability, consistency, probes, strata
    probes   completions that try to get reward without solving the task (generic and code probes)
    escape   escape probes of code domains and the bait that judges them by their side effects

Importers name the submodule (`from envs.qa import gate`).
"""
