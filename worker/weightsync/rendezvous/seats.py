"""An inference rank as the controller's roster keeps it (roster.py): its state, its attempt, the
version it holds. Its own module so that the roster and its scaling part (parking.py) share it."""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.rendezvous.messages import RankInfo

SERVING = "serving"  # receives every round
AWAY = "away"  # vanished: dead, frozen, or cut off; expected back
JOINING = "joining"  # its process started again; its proof is awaited
WAITING = "waiting"  # admitted again; receives the next round
DROPPED = "dropped"  # away past away_limit while enough others remain (min_available): no longer waited for
PARKED = "parked"  # its pod is beyond spec.inference.replicas: not part of the job until its process starts


@dataclass
class Seat:
    """An inference rank, as the controller sees it."""

    attempt: int = 1  # of its process: one more each time it starts again
    endpoint: str = ""
    state: str = SERVING
    since: float = 0.0  # when it entered that state
    # The version it holds: the last it applied, verified; None when it holds none (new, or its
    # process started again). Delta versions go only to ranks that hold the one the trainers kept.
    holds: int | None = None
    rejoins: int = 0
    info: RankInfo | None = None  # what its latest attempt told about itself (pod, transport, vLLM server)
    # dropped while its latest start was joining (slower than away_limit to build its model): taken
    # back once that start proves the token, as it would have been in time
    late: bool = False
