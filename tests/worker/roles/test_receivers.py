"""status.receivers from the controller's roster: each rank's state, version, pod and since when;
written when something changed, at most every WRITE_EVERY seconds; counts alone for a large job."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from weightsync.job import VERSION
from weightsync.job.schema import openapi_schema, schema_problems, unknown_fields
from weightsync.rendezvous.messages import RankInfo
from weightsync.rendezvous.roster import AWAY, DROPPED, JOINING, SERVING, WAITING, Seat
from weightsync.roles.controller.receivers import LIST_LIMIT, Receivers, counts, states

RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


@dataclass
class Roster:
    """The part of the controller's Host that Receivers reads."""

    seats: dict[int, Seat] = field(default_factory=dict)

    def seats_now(self) -> dict[int, Seat]:
        return dict(self.seats)


def seats(n: int) -> dict[int, Seat]:
    return {r: Seat(state=SERVING, info=RankInfo("tcp", pod=f"job-inference-{r}")) for r in range(n)}


def test_states_name_every_roster_state():
    roster = seats(6)
    roster[0].holds = 3
    roster[1].holds = 2
    roster[2].state = AWAY
    roster[3].state = JOINING
    roster[4].state = WAITING
    roster[5].state = DROPPED
    by_rank = states(roster, 3)
    assert by_rank == {0: "current", 1: "behind", 2: "away", 3: "rejoining", 4: "rejoining", 5: "dropped"}
    assert counts(by_rank) == {"current": 1, "behind": 1, "away": 1, "rejoining": 2, "dropped": 1}


def test_written_only_when_a_state_changes():
    roster = Roster(seats(2))
    written = []
    watch = Receivers(roster, written.append, every=0.0)
    assert watch.update()
    first = written[-1]
    assert first["total"] == 2 and first["ready"] == "2/2" and "version" not in first
    assert [r["pod"] for r in first["ranks"]] == ["job-inference-0", "job-inference-1"]
    assert all(RFC3339.match(r["since"]) for r in first["ranks"])
    assert not watch.update()  # nothing changed: nothing written
    for seat in roster.seats.values():
        seat.holds = 0
    assert watch.update()
    assert written[-1]["version"] == 0 and [r["version"] for r in written[-1]["ranks"]] == [0, 0]
    roster.seats[1].state = AWAY
    assert watch.update()
    assert written[-1]["ready"] == "1/2" and written[-1]["away"] == 1
    assert written[-1]["ranks"][1]["state"] == "away" and written[-1]["ranks"][0]["state"] == "current"
    assert len(written) == 3


def test_rate_limited_and_the_last_state_written_at_the_end():
    roster = Roster(seats(1))
    written = []
    watch = Receivers(roster, written.append, every=3600.0)
    assert watch.update()
    roster.seats[0].holds = 1
    assert not watch.update()  # changed, but written less than `every` ago
    watch.stop()  # the end writes the last state whatever the limit
    assert len(written) == 2 and written[-1]["ranks"][0]["version"] == 1


def test_a_large_job_gives_counts_only():
    roster = Roster(seats(5))
    written = []
    Receivers(roster, written.append, limit=4).update()
    record = written[-1]
    assert "ranks" not in record and record["total"] == 5 and record["current"] == 5
    assert "counts by state only" in record["note"]


def test_the_crd_takes_what_the_controller_writes():
    """Every field is declared (the API server would prune an undeclared one) and valid."""
    roster = Roster(seats(3))
    roster.seats[0].holds, roster.seats[1].holds, roster.seats[2].state = 4, 3, AWAY
    written = []
    Receivers(roster, written.append).update()
    Receivers(Roster(seats(70)), written.append).update()  # more than the CRD lists: counts only
    status = openapi_schema(VERSION)["properties"]["status"]
    for record in written:
        assert unknown_fields(status, {"receivers": record}, "status") == []
        assert schema_problems(status, {"receivers": record}) == []
    assert status["properties"]["receivers"]["properties"]["ranks"]["maxItems"] == LIST_LIMIT
