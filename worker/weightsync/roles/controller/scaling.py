"""Following a running job's inference pods as they are scaled (spec.inference.replicas, up to
spec.inference.maxReplicas; `kubectl scale wtj NAME --replicas N`).

The StatefulSet starts and removes the pods at once; the controller must learn the new count to
park the ranks of the pods removed (roster.py), so that nothing waits for them. Its waits run in
the main thread between store calls, so a thread of its own reads the job every POLL_SECONDS and
leaves the running ranks in the roster's `wanted`, which the roster applies at its next look at
the ranks. A read that fails is said once and tried again: the ranks' heartbeats still tell a pod
that went, and a pod that comes joins when its process starts, whatever the count."""

from __future__ import annotations

import threading
from typing import Callable

POLL_SECONDS = 2.0


class ScaleWatch:
    """Reads the pods' count with `read` (None: it cannot be read here) and tells the Host their
    ranks (`ranks_of_pods`: Host.scaled_to)."""

    def __init__(self, host, read: Callable[[], int | None], ranks_of_pods: Callable[[int], int],
                 say: Callable[[str], None], every: float = POLL_SECONDS):
        self.host, self.read, self.ranks_of_pods, self.say, self.every = host, read, ranks_of_pods, say, every
        self.stopping = threading.Event()
        self.failing = False
        self.thread: threading.Thread | None = None

    def look(self) -> None:
        """One read of the job."""
        try:
            pods = self.read()
        except (RuntimeError, OSError) as e:
            if not self.failing:
                self.say(f"cannot read spec.inference.replicas (tried again every {self.every:.0f}s): {e}")
            self.failing = True
            return
        self.failing = False
        if pods is not None:
            self.host.scaled_to(self.ranks_of_pods(pods))

    def start(self) -> None:
        self.thread = threading.Thread(target=self._watch, name="scale", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=self.every + 5.0)

    def _watch(self) -> None:
        while not self.stopping.wait(self.every):
            self.look()
