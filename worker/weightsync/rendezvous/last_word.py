"""A receiver that a trainer lost in the middle of a round is heard out before it is counted away.

A trainer reports a receiver lost when its sends to it fail: the receiver's pod died, it froze or
was cut off, or it hung up itself because it refused what came (a bucket whose checksum did not
match: bytes changed on the way). The trainer sees the hang-up as a lost connection and says so at
once, on a store connection it holds; the receiver says why on one it opens for the report, a
little later. Counted away on the trainer's word, the receiver that found the corruption would be
a rank cut off that rejoins: the round and the next ones would go on without it, and the job would
end, if its report came at all, with the versions recorded as delivered to no one and the rank's
pod ended before it said its last word.

So the controller waits, at most LOST_GRACE seconds, for a failure report of a lost receiver: one
that comes fails the job with the receiver's own reason (ChecksumMismatch counts a failed
verification and names the rank that found it). A receiver that died or froze says nothing, and
is counted away once the grace ran out, as before.
"""

from __future__ import annotations

import time
from typing import Iterable

from weightsync.job import INFERENCE
from weightsync.rendezvous.messages import RankFailure
from weightsync.rendezvous.protocol import HEARTBEAT, Keys

LOST_GRACE = 2 * HEARTBEAT  # seconds a lost receiver has to report why before it is counted away
LOOK_EVERY = 0.25  # seconds between the roster's upkeep while the grace runs


def hear_out(host, ranks: Iterable[int], within: float | None = None) -> None:
    """Wait until one of the receivers `ranks` reported a failure, then raise it (blamed as the
    roster blames any failure), or until `within` seconds (LOST_GRACE) passed without one. `host`:
    the roster's Host (roster.py, which calls this)."""
    keys = {r: Keys.failed(INFERENCE, r) for r in ranks}
    if not keys:
        return
    deadline = time.monotonic() + (LOST_GRACE if within is None else within)
    while True:
        for r, key in keys.items():
            if host.has(key):  # (read here: the failures' counter that check_ranks looks at is bumped after)
                raise host.blame(INFERENCE, r, RankFailure.from_json(host.get(key)))
        left = deadline - time.monotonic()
        if left <= 0:
            return
        host.check_ranks(trainers=not host.resuming)
        host.store.wait_any(list(keys.values()), min(left, LOOK_EVERY))
