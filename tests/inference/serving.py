"""What the server tests share: waiting for a condition with a bound."""

import time


def poll(cond, timeout: float = 30.0, every: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(every)
    return cond()
