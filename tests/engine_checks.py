"""Helpers shared by the engine tests: random prompts and the check that an engine gave back every page."""

import numpy as np


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, n).tolist() for n in lengths]


def check_released(eng) -> None:
    """No work left, a consistent page table, and every page free or held by the prefix cache."""
    assert not eng.has_work()
    eng.table.check()
    assert eng.pool.num_free + len(list(eng.prefix.held_pages())) == eng.pool.num_pages - 1
