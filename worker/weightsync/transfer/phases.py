"""Where a version's time goes on one rank: seconds per named phase (cast, hash, compare, encode,
apply, ...), added up over every thread that does that work, so that the figures of phases that
overlap may add up to more than the version's wall-clock time. SentVersion and ReceivedVersion
carry them; `weightsync bench` reports them per rank."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager


class Phases:
    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.lock = threading.Lock()

    def add(self, name: str, seconds: float) -> None:
        with self.lock:
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @contextmanager
    def timed(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def take(self) -> dict[str, float]:
        """The seconds so far, and a fresh start."""
        with self.lock:
            out, self.seconds = self.seconds, {}
        return out
