"""Environments: task domains, sandbox, worker-process pool and the quality gate. Never imports JAX.

The environment protocol is importable from here (`from envs import Environment, Score, Task`), as the
README's "Your own environment" writes it; it comes from `envs.base`, which imports nothing of ours. The
rest is imported by module: `envs.registry`, `envs.pool` (`EnvPool`), `envs.sandbox.box`, `envs.qa.gate`,
`envs.domains.*`.
"""

from envs.base import STATUSES, Environment, Episode, Score, SingleTurnEnvironment, Task

__all__ = ["STATUSES", "Environment", "Episode", "Score", "SingleTurnEnvironment", "Task"]
