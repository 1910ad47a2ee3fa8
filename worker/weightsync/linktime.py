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
    """The fluid model's state: which stream each sender is on and how many bytes it has left."""

    def __init__(self, senders: int, receivers: int, bandwidth: float):
        self.bandwidth = bandwidth
        self.receiver = np.full(senders, -1, dtype=np.int64)
        self.left = np.zeros(senders)
        self.crowd = np.zeros(receivers, dtype=np.int64)
        self.now = 0.0

    def start(self, sender: int, receiver: int, nbytes: float) -> None:
        self.receiver[sender] = receiver
        self.left[sender] = nbytes
        self.crowd[receiver] += 1

    def step(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Run until the next stream ends: (senders now free, senders still busy, bytes each busy
        one moved). Empty arrays when nothing is running."""
        s = np.flatnonzero(self.receiver >= 0)
        if not len(s):
            return s, s, np.zeros(0)
        rate = self.bandwidth / self.crowd[self.receiver[s]]
        dt = float(np.min(self.left[s] / rate))
        self.now += dt
        moved = rate * dt
        self.left[s] -= moved
        done = self.left[s] <= 1e-9 * moved + 1e-6
        free = s[done]
        np.subtract.at(self.crowd, self.receiver[free], 1)
        self.receiver[free] = -1
        self.left[free] = 0.0
        return free, s, moved


def greedy_order(pair_bytes: np.ndarray) -> np.ndarray:
    """pair_bytes[s, r]: bytes sender s owes receiver r. Returns position[s, r], the place of
    receiver r in sender s's order (the planner sorts pieces by it)."""
    senders, receivers = pair_bytes.shape
    position = np.zeros((senders, receivers), dtype=np.int64)
    todo = pair_bytes > 0
    to_send = pair_bytes.sum(axis=1).astype(np.float64)
    scale = 1.0 + float(pair_bytes.max(initial=0.0))
    count = np.zeros(senders, dtype=np.int64)
    streams = _Streams(senders, receivers, 1.0)
    free = np.arange(senders)
    while True:
        for s in free[np.argsort(-to_send[free], kind="stable")]:  # the senders with most left choose first
            mine = np.flatnonzero(todo[s])
            if not len(mine):
                continue
            r = mine[np.argmin(streams.crowd[mine] * scale - pair_bytes[s, mine])]
            todo[s, r] = False
            position[s, r] = count[s]
            count[s] += 1
            streams.start(s, r, float(pair_bytes[s, r]))
        free, busy, moved = streams.step()
        if not len(busy):
            return position
        to_send[busy] -= moved


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
    nxt = np.searchsorted(sender, np.arange(plan.senders))  # each sender's next stream (index into size)
    last = np.searchsorted(sender, np.arange(plan.senders), side="right")
    streams = _Streams(plan.senders, plan.receivers, bandwidth)
    free = np.arange(plan.senders)
    while True:
        for s in free[nxt[free] < last[free]]:
            streams.start(s, int(receiver[nxt[s]]), float(size[nxt[s]]))
            nxt[s] += 1
        free, busy, _ = streams.step()
        if not len(busy):
            return Timing(streams.now, busiest / bandwidth if bandwidth else 0.0, busiest, len(size))
