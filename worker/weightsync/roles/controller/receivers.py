"""What an operator of the job sees of its inference ranks: status.receivers, each rank's state
(current, behind, away, rejoining, dropped: runtime/metrics.py's, the same states the controller
counts in its metrics), the version it holds, its pod and since when it is in that state.

The roster (rendezvous/roster.py) changes a rank's state inside the controller's waits (a rank goes
away while a round waits for it, comes back while the controller waits for the trainers), so a
thread of the controller looks at the roster every POLL_SECONDS and writes the status when a
rank's state, version or pod changed, never more often than every WRITE_EVERY seconds: a job
that delivers many versions a second writes its status as often as that, not once per version per
rank. A large job lists at most LIST_LIMIT ranks; beyond that the status gives the counts by state
only, and says so."""

from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass

from weightsync.rendezvous.roster import AWAY, DROPPED, JOINING, PARKED, WAITING, Host, Seat
from weightsync.runtime.metrics import AWAY as AWAY_STATE
from weightsync.runtime.metrics import BEHIND, CURRENT, RECEIVER_STATES, REJOINING
from weightsync.runtime.metrics import DROPPED as DROPPED_STATE

LIST_LIMIT = 64  # ranks listed one by one; a larger job's status gives counts by state only
POLL_SECONDS = 1.0
WRITE_EVERY = 2.0  # seconds between two writes of status.receivers, at least


def state_of(seat: Seat, latest: int | None) -> str:
    """A rank's state, as metrics.RECEIVER_STATES names it; `latest`: the latest version any
    inference rank holds."""
    if seat.state == AWAY:
        return AWAY_STATE
    if seat.state == DROPPED:
        return DROPPED_STATE
    if seat.state in (JOINING, WAITING):
        return REJOINING
    return CURRENT if seat.holds == latest else BEHIND


def states(seats: dict[int, Seat], latest: int | None) -> dict[int, str]:
    """Every inference rank's state; not the parked ones' (their pods are beyond
    spec.inference.replicas: not part of the job until they are scaled up to)."""
    return {rank: state_of(seat, latest) for rank, seat in sorted(seats.items()) if seat.state != PARKED}


def counts(by_rank: dict[int, str]) -> dict[str, int]:
    """How many ranks are in each of metrics.RECEIVER_STATES."""
    out = dict.fromkeys(RECEIVER_STATES, 0)
    for state in by_rank.values():
        out[state] += 1
    return out


@dataclass(frozen=True)
class Rank:
    """One inference rank as status.receivers.ranks lists it."""

    rank: int
    state: str
    pod: str
    version: int | None
    since: str  # RFC 3339: when this rank entered `state`

    def to_json(self) -> dict:
        out = {"rank": self.rank, "state": self.state, "pod": self.pod, "since": self.since}
        if self.version is not None:
            out["version"] = self.version
        return out


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Receivers:
    """Keeps status.receivers up to date from the roster, through `write` (Reporter.receivers)."""

    def __init__(self, host: Host, write, limit: int = LIST_LIMIT, every: float = WRITE_EVERY):
        self.host, self.write, self.limit, self.every = host, write, limit, every
        self.ranks: dict[int, Rank] = {}
        self.written: dict | None = None
        self.last_write: float | None = None  # never: the first change is written at once
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def record(self, seats: dict[int, Seat] | None = None) -> dict:
        """status.receivers now, from `seats` (None: the roster's now), each rank's `since` kept
        from when its state last changed."""
        seats = {r: s for r, s in (self.host.seats_now() if seats is None else seats).items() if s.state != PARKED}
        held = [s.holds for s in seats.values() if s.holds is not None]
        latest = max(held) if held else None
        by_rank = states(seats, latest)
        at = _now()
        for rank, state in by_rank.items():
            seat = seats[rank]
            before = self.ranks.get(rank)
            pod = seat.info.pod if seat.info is not None else ""
            since = before.since if before is not None and before.state == state else at
            self.ranks[rank] = Rank(rank, state, pod, seat.holds, since)
        total = counts(by_rank)
        out = {"total": len(by_rank), "ready": f"{total[CURRENT]}/{len(by_rank)}", **total}
        if latest is not None:
            out["version"] = latest
        if len(by_rank) <= self.limit:
            out["ranks"] = [self.ranks[r].to_json() for r in sorted(by_rank)]
        else:
            out["note"] = (f"{len(by_rank)} inference ranks, more than {self.limit}: the counts by state only "
                           "(the controller's log and metrics say which ranks)")
        return out

    def update(self, force: bool = False) -> bool:
        """Write status.receivers if it changed (a `since` alone is no change) and the last write
        was WRITE_EVERY ago, or `force`; True if it wrote."""
        with self.lock:
            seats = self.host.seats_now()
            if not seats:  # before the plan
                return False
            record = self.record(seats)
            if _without_since(record) == _without_since(self.written):
                return False
            # (the monotonic clock counts from the machine's boot: 0.0 would hold back a first write
            # on a machine up for less than `every`)
            if not force and self.last_write is not None and time.monotonic() - self.last_write < self.every:
                return False
            self.write(record)
            self.written, self.last_write = record, time.monotonic()
            return True

    def start(self) -> None:
        self.thread = threading.Thread(target=self._watch, name="receivers", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop watching; the status says the ranks' last states."""
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=10.0)
        self.update(force=True)

    def _watch(self) -> None:
        while not self.stopping.wait(POLL_SECONDS):
            self.update()


def _without_since(record: dict | None) -> dict | None:
    if record is None:
        return None
    return {**record, "ranks": [{k: v for k, v in r.items() if k != "since"} for r in record.get("ranks", [])]}
