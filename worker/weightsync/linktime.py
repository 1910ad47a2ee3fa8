"""The links' model: how long streams take, and the order of streams that keeps every link busy.

The model: every rank has one NIC of `bandwidth` bytes/s, full duplex. A sender sends one stream
at a time (all its pieces for one receiver, back to back); a receiver's NIC is shared equally by
the streams arriving at it at that moment, so a stream runs at bandwidth / (streams into its
receiver), and a sender whose receiver is crowded does not use the rest of its own NIC. Time ends
when the last stream ends. This is pessimistic where real senders keep several streams in flight.

The order (greedy_order, which the planner uses) plays the transfer forward on this model:
whenever senders are free, the one with the most bytes left chooses first, and it starts on the
receiver, among those it still owes bytes, that has the fewest streams arriving right now, and
among those the one it owes most - so no receiver idles while others queue, and long streams
start early instead of forming the tail. simulate() replays a
plan's order under the same model; the speed of light is the bound no order beats: the busiest
NIC's bytes (sent or received) over the bandwidth.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .sliceplan import SlicePlan


@dataclass(frozen=True)
class Timing:
    seconds: float            # the simulated time of the plan's order
    speed_of_light: float     # busiest NIC (sent or received bytes) / bandwidth
    busiest_nic_bytes: int
    streams: int              # runs of consecutive pieces from one sender to one receiver

    @property
    def over_light(self) -> float:
        return self.seconds / self.speed_of_light if self.speed_of_light else 1.0


class _Streams:
    """The fluid model, event by event: which stream each sender is on, how many bytes it has
    left, and when it will end at the current rates. Only the streams into a receiver whose crowd
    changed are repriced, so an event costs a few heap operations, not a pass over every rank."""

    def __init__(self, senders: int, receivers: int, bandwidth: float):
        self.bandwidth = bandwidth
        self.crowd = np.zeros(receivers, dtype=np.int64)
        self.into = [set() for _ in range(receivers)]
        self.receiver = [-1] * senders
        self.left = [0.0] * senders
        self.rate = [0.0] * senders
        self.since = [0.0] * senders
        self.version = [0] * senders
        self.heap: list = []
        self.now = 0.0

    def start(self, sender: int, receiver: int, nbytes: float) -> None:
        self.receiver[sender] = receiver
        self.left[sender] = nbytes
        self.rate[sender] = 0.0
        self.since[sender] = self.now
        self.into[receiver].add(sender)
        self.crowd[receiver] += 1
        self._reprice(receiver)

    def next_free(self) -> list[int]:
        """Advance to the next time streams end; the senders they free ([] when none is running)."""
        freed = []
        while self.heap:
            t, v, s = heapq.heappop(self.heap)
            if v != self.version[s]:
                continue
            if freed and t > self.now * (1 + 1e-12) + 1e-15:
                heapq.heappush(self.heap, (t, v, s))
                break
            self.now = max(self.now, t)
            freed.append(s)
        touched = set()
        for s in freed:
            r = self.receiver[s]
            self.into[r].discard(s)
            self.crowd[r] -= 1
            self.receiver[s] = -1
            self.version[s] += 1
            touched.add(r)
        for r in touched:
            self._reprice(r)
        return freed

    def _reprice(self, receiver: int) -> None:
        crowd = int(self.crowd[receiver])
        for s in self.into[receiver]:
            self.left[s] = max(0.0, self.left[s] - self.rate[s] * (self.now - self.since[s]))
            self.since[s] = self.now
            self.rate[s] = self.bandwidth / crowd
            self.version[s] += 1
            heapq.heappush(self.heap, (self.now + self.left[s] / self.rate[s], self.version[s], s))


def greedy_order(pair_bytes: np.ndarray) -> np.ndarray:
    """pair_bytes[s, r]: bytes sender s owes receiver r. Returns position[s, r], the place of
    receiver r in sender s's order (the planner sorts pieces by it)."""
    senders, receivers = pair_bytes.shape
    position = np.zeros((senders, receivers), dtype=np.int64)
    todo = pair_bytes > 0
    owed = pair_bytes.sum(axis=1).astype(np.float64)
    scale = 1.0 + float(pair_bytes.max(initial=0.0))
    count = [0] * senders
    streams = _Streams(senders, receivers, 1.0)
    free = list(range(senders))
    while free:
        for s in sorted(free, key=lambda s: -owed[s]):  # the senders with most left choose first
            mine = np.flatnonzero(todo[s])
            if not len(mine):
                continue
            r = int(mine[np.argmin(streams.crowd[mine] * scale - pair_bytes[s, mine])])
            todo[s, r] = False
            owed[s] -= pair_bytes[s, r]
            position[s, r] = count[s]
            count[s] += 1
            streams.start(s, r, float(pair_bytes[s, r]))
        free = streams.next_free()
    return position


def simulate(plan: "SlicePlan", bandwidth: float) -> Timing:
    """Simulated seconds of `plan` (in its order) over NICs of `bandwidth` bytes per second each way."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    pairs = plan.pair_bytes()
    busiest = int(max(pairs.sum(axis=1).max(initial=0), pairs.sum(axis=0).max(initial=0)))
    # each sender's streams: its receivers with bytes owed, in the plan's order
    sender, receiver = np.nonzero(pairs)
    order = np.lexsort((plan.position[sender, receiver], sender))
    sender, receiver = sender[order], receiver[order]
    size = pairs[sender, receiver]
    nxt = np.searchsorted(sender, np.arange(plan.senders)).tolist()  # each sender's next stream
    last = np.searchsorted(sender, np.arange(plan.senders), side="right").tolist()
    streams = _Streams(plan.senders, plan.receivers, bandwidth)
    free = list(range(plan.senders))
    while free:
        for s in free:
            if nxt[s] < last[s]:
                streams.start(s, int(receiver[nxt[s]]), float(size[nxt[s]]))
                nxt[s] += 1
        free = streams.next_free()
    return Timing(streams.now, busiest / bandwidth, busiest, len(size))
