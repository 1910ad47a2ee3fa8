"""The links' model: how long streams take, and the order of streams that keeps every link busy.

The model: every rank has one NIC of `bandwidth` bytes/s, full duplex. A stream is all a sender
owes one receiver, its pieces back to back. A sender keeps up to WINDOW streams in flight, the
next ones in its order; every NIC is split equally among its streams, and a stream runs at the
share of the more crowded end: bandwidth / max(streams of its sender, streams into its
receiver) - what the other end could have given it is not handed to anyone else, which is more
pessimistic than a network's max-min fair share. Time ends when the last stream ends.

The order (greedy_order, which the planner uses) plays the transfer forward on this model:
whenever senders have a free slot, the one with the most bytes left chooses first, and it starts
on the receiver, among those it still owes bytes, that has the fewest streams arriving right
now, and among those the one it owes most - so no receiver idles while others queue, and long
streams start early instead of forming the tail. simulate() replays a plan's order under the
same model. With one stream per sender, a fixed order's time swings by tens of percent on
differences of a millionth in when streams end (which streams meet at a receiver changes);
with a few in flight it barely moves, so simulate() can jitter the streams' sizes and the
command reports that time too. The speed of light is the bound no order beats: the busiest
NIC's bytes (sent or received) over the bandwidth.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

WINDOW = 4  # streams a sender keeps in flight


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
    """The fluid model, event by event: every stream's bytes left and when it will end at the
    current rates. Only the streams of a sender or receiver whose count changed are repriced, so
    an event costs a few heap operations, not a pass over every rank."""

    def __init__(self, senders: int, receivers: int, bandwidth: float):
        self.bandwidth = bandwidth
        self.crowd = np.zeros(receivers, dtype=np.int64)
        self.into = [set() for _ in range(receivers)]
        self.out = [set() for _ in range(senders)]
        self.ends: list = []                         # per stream: (sender, receiver)
        self.left: list = []
        self.rate: list = []
        self.since: list = []
        self.version: list = []
        self.heap: list = []
        self.now = 0.0

    def start(self, sender: int, receiver: int, nbytes: float) -> None:
        k = len(self.ends)
        self.ends.append((sender, receiver))
        self.left.append(nbytes)
        self.rate.append(0.0)
        self.since.append(self.now)
        self.version.append(0)
        self.out[sender].add(k)
        self.into[receiver].add(k)
        self.crowd[receiver] += 1
        self._reprice(self.out[sender] | self.into[receiver])

    def next_free(self) -> list[int]:
        """Advance to the next time streams end; the sender of each ([] when none is running)."""
        done = []
        while self.heap:
            t, v, k = heapq.heappop(self.heap)
            if v != self.version[k]:
                continue
            if done and t > self.now * (1 + 1e-12) + 1e-15:
                heapq.heappush(self.heap, (t, v, k))
                break
            self.now = max(self.now, t)
            done.append(k)
        touched = set()
        for k in done:
            s, r = self.ends[k]
            self.out[s].discard(k)
            self.into[r].discard(k)
            self.crowd[r] -= 1
            self.version[k] += 1
            touched |= self.out[s] | self.into[r]
        self._reprice(touched.difference(done))
        return [self.ends[k][0] for k in done]

    def _reprice(self, streams) -> None:
        for k in streams:
            s, r = self.ends[k]
            rate = self.bandwidth / max(len(self.out[s]), len(self.into[r]))
            if rate == self.rate[k]:
                continue  # its end time stands
            self.left[k] = max(0.0, self.left[k] - self.rate[k] * (self.now - self.since[k]))
            self.since[k] = self.now
            self.rate[k] = rate
            self.version[k] += 1
            heapq.heappush(self.heap, (self.now + self.left[k] / rate, self.version[k], k))


def greedy_order(pair_bytes: np.ndarray, window: int = WINDOW) -> np.ndarray:
    """pair_bytes[s, r]: bytes sender s owes receiver r. Returns position[s, r], the place of
    receiver r in sender s's order (the planner sorts pieces by it)."""
    senders, receivers = pair_bytes.shape
    position = np.zeros((senders, receivers), dtype=np.int64)
    todo = pair_bytes > 0
    owed = pair_bytes.sum(axis=1).astype(np.float64)
    scale = 1.0 + float(pair_bytes.max(initial=0.0))
    count = [0] * senders
    streams = _Streams(senders, receivers, 1.0)

    def pick(s: int) -> None:
        mine = np.flatnonzero(todo[s])
        if len(mine):
            r = int(mine[np.argmin(streams.crowd[mine] * scale - pair_bytes[s, mine])])
            todo[s, r] = False
            owed[s] -= pair_bytes[s, r]
            position[s, r] = count[s]
            count[s] += 1
            streams.start(s, r, float(pair_bytes[s, r]))

    for _ in range(window):  # every sender its first stream, then every sender its second, ...
        for s in sorted(range(senders), key=lambda s: -owed[s]):
            pick(s)
    while True:
        free = streams.next_free()
        if not free:
            return position
        for s in sorted(free, key=lambda s: -owed[s]):  # the senders with most left choose first
            pick(s)


def simulate(pair_bytes: np.ndarray, position: np.ndarray, bandwidth: float, jitter: float = 0.0, seed: int = 0,
             window: int = WINDOW) -> Timing:
    """Simulated seconds of an order over NICs of `bandwidth` bytes per second each way:
    pair_bytes[s, r] the bytes sender s owes receiver r, position[s, r] the place of receiver r in
    sender s's order (greedy_order's, or a plan's: pieces.PieceAssignment.pair_bytes() and
    .position). `jitter` > 0 scales every stream by a random factor within 1 +- jitter (seeded): a
    real network never ends streams exactly when the model does."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    pairs = pair_bytes
    senders, receivers = pairs.shape
    busiest = int(max(pairs.sum(axis=1).max(initial=0), pairs.sum(axis=0).max(initial=0)))
    # each sender's streams: its receivers with bytes owed, in the order's order
    sender, receiver = np.nonzero(pairs)
    order = np.lexsort((position[sender, receiver], sender))
    sender, receiver = sender[order], receiver[order]
    size = pairs[sender, receiver]
    if jitter:
        size = size * (1 + jitter * np.random.default_rng(seed).uniform(-1, 1, len(size)))
    nxt = np.searchsorted(sender, np.arange(senders)).tolist()  # each sender's next stream
    last = np.searchsorted(sender, np.arange(senders), side="right").tolist()
    streams = _Streams(senders, receivers, bandwidth)
    free = [s for _ in range(window) for s in range(senders)]
    while free:
        for s in free:
            if nxt[s] < last[s]:
                streams.start(s, int(receiver[nxt[s]]), float(size[nxt[s]]))
                nxt[s] += 1
        free = streams.next_free()
    return Timing(streams.now, busiest / bandwidth, busiest, len(size))
