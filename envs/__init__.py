"""Environments: task domains, sandbox, worker-process pool and the quality gate. Never imports JAX."""

from envs import registry
from envs.base import STATUSES, Environment, Episode, Score, SingleTurnEnvironment, Task

__all__ = ["STATUSES", "Environment", "Episode", "Score", "SingleTurnEnvironment", "Task", "registry"]
