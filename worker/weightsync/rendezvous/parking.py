"""Scaling a running job's inference pods, on the controller's side of the rendezvous.

The inference pods may be scaled while the job runs, up to spec.inference.maxReplicas, for which
the layout holds ranks: the ranks beyond spec.inference.replicas are parked. A parked rank is not
waited for, neither while the ranks join nor in the versions; when its process starts (its pod
was scaled up to) it joins as a rank that comes back does, and receives the next round in full
before it serves. Scaling down parks the ranks of the pods removed: a round on its way goes on
without them, and they fail nothing. The controller learns the pods' count from the job
(`wanted`, which a thread of the controller keeps); an inference rank whose process starts is
taken in whatever the count it last read, as the StatefulSet started it.
"""

from __future__ import annotations

import time

from weightsync.job import INFERENCE
from weightsync.rendezvous.protocol import who
from weightsync.rendezvous.seats import PARKED, SERVING, WAITING


class Parking:
    """The roster's part that follows the inference pods' count: mixed into roster.Host, whose
    seats, ranks and store it keeps (`running`, `wanted` and `parked` are Host's)."""

    def scaled_to(self, ranks: int) -> None:
        """The job's inference pods run `ranks` ranks now, as last read from the job (scaling.py,
        on a thread of its own): the roster follows at its next look (follow_scale)."""
        self.wanted = ranks

    def follow_scale(self) -> None:
        """Park the ranks of the pods scaled away since the last look (`wanted`, the running
        ranks as last read from the job); take back the parked ranks of pods scaled up to whose
        process still runs (scaled down, then up again before the pod went). A rank whose pod is
        new joins when its process starts (check_ranks)."""
        wanted = self.wanted
        if wanted is None or wanted == self.running:
            return
        before, self.running = self.running, wanted
        self.say(f"the job runs {wanted} inference ranks now (spec.inference.replicas changed; it ran {before})")
        if not self.seats:  # the ranks are joining: the join phase waits for the running ones
            self.parked = set(range(wanted, self.layout.world_size(INFERENCE)))
            return
        self.parked = set()
        changed = [self._park(rank) for rank in range(wanted, before)] + \
            [self._unpark(rank) for rank in range(before, wanted)]
        if any(changed):  # the trainers' endpoints, once for all the ranks that changed
            self.epoch += 1
            self._publish_peers()

    def _park(self, rank: int) -> bool:
        """Park the rank of a pod scaled away; False if it was parked already."""
        seat = self.seats[rank]
        if seat.state == PARKED:
            return False
        cut = self.in_round.get(rank) == seat.attempt and seat.state == SERVING
        seat.state, seat.since, seat.holds = PARKED, time.monotonic(), None
        if cut:
            self._cut(rank)
        self.say(f"{who(INFERENCE, rank)} leaves the job: its pod was scaled away (spec.inference.replicas); "
                 "nothing waits for it, and it is taken back if its pod is scaled up to again")
        return True

    def _unpark(self, rank: int) -> bool:
        """Take back the parked rank of a pod scaled up to again whose process still runs; False
        if there is none (its pod is new, or gone: it joins when its process starts)."""
        seat = self.seats[rank]
        if seat.state != PARKED or not seat.endpoint:
            return False
        if self.silent_for(INFERENCE, rank, time.monotonic()) > self.policy.silent_limit:
            return False
        seat.state, seat.since = WAITING, time.monotonic()
        self.say(f"{who(INFERENCE, rank)} is back in the job (its pod was scaled up to again before it went); it "
                 "receives the next round in full and serves once it has verified it")
        return True
