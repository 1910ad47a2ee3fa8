"""The end of a job, on the controller's side of the rendezvous: the controller says it (Keys.END)
and waits a bounded time for every rank that can still answer to see it, so that no rank is left
waiting for a round when the controller goes, and none that cannot answer holds the end up."""

from __future__ import annotations

import time

from weightsync.job import INFERENCE
from weightsync.rendezvous.messages import End
from weightsync.rendezvous.protocol import HEARTBEAT, Keys, who
from weightsync.rendezvous.seats import AWAY, DROPPED, JOINING, PARKED


class Ending:
    """The roster's part that ends the job: mixed into roster.Host, whose ranks, seats, store and
    heartbeats it reads."""

    def end(self, state: str, message: str, reason: str = "") -> None:
        self.set(Keys.END, End(state, message, reason))

    def wait_byes(self, timeout: float) -> list[str]:
        """Wait (a bounded time) for every rank that can still answer (not away, not silent) to
        see the end; returns the ranks that did not."""
        deadline = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            waiting = [Keys.bye(r, k) for r, k in self.ranks if not self.has(Keys.bye(r, k)) and self._answering(r, k, now)]
            if not waiting or now >= deadline:
                return [who(r, k) for r, k in self.ranks if not self.has(Keys.bye(r, k))
                        and not (r == INFERENCE and k in self.seats and self.seats[k].state == PARKED)]
            try:
                self.wait(waiting, "every rank to see the end", min(HEARTBEAT, deadline - now))
            except TimeoutError:
                pass

    def _answering(self, role: str, rank: int, now: float) -> bool:
        seat = self.seats.get(rank) if role == INFERENCE else None
        if seat is not None and seat.state in (AWAY, JOINING, DROPPED, PARKED):
            return False
        return self.silent_for(role, rank, now) <= self.limit_for(role)

