"""Waiting in a test: every wait has a deadline and, when it passes, says what it waited for."""

from __future__ import annotations

import time


def until(what: str, check, timeout: float, every: float = 0.05):
    """check()'s first true answer, asked every `every` seconds; fails naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f}s"
        time.sleep(every)
