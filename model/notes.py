"""Notes of the code path a config value chose: said once per process, at INFO (the main job's log.txt)."""

from __future__ import annotations

import functools
import logging


@functools.cache
def note_path(message: str) -> None:
    """Says once per process which code path a config value chose where it chose silently before (`auto`
    resolved, a fallback taken): e.g. the attention kernel, the experts' dispatch."""
    logging.getLogger("model").info(message)
