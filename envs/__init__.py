"""Environments: task domains, sandbox, worker-process pool and the quality gate. Never imports JAX."""

from envs import registry
from envs.base import STATUSES, Environment, Episode, Score, SingleTurnEnvironment, Task
from envs.pool import EnvPool

__all__ = [
    "STATUSES",
    "EnvPool",
    "Environment",
    "Episode",
    "Score",
    "SingleTurnEnvironment",
    "Task",
    "registry",
]
