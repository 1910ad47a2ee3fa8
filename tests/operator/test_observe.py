"""What an operator of RL jobs sees of a running job: `kubectl get wtj`'s columns, the Events of
its inference ranks (from status.receivers), and the operator's log lines."""

from __future__ import annotations

import io
import logging
import re

import kopf
import pytest

from weightsync.job import VERSION
from weightsync.job.logline import restyle
from weightsync.job.schema import crd
from weightsync_operator import status

LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z \[[^\]]+\] ")


def columns() -> dict[str, str]:
    (served,) = [v for v in crd()["spec"]["versions"] if v["name"] == VERSION]
    return {c["name"]: c["jsonPath"] for c in served["additionalPrinterColumns"]}


def test_get_shows_transport_receivers_version_and_why_it_failed():
    shown = columns()
    assert shown["Transport"] == ".status.transfer.transport"
    assert shown["Receivers"] == ".status.receivers.ready"
    assert shown["Version"] == ".status.transfer.version"
    assert shown["Reason"] == '.status.conditions[?(@.type=="Failed")].reason'
    for kept in ("Phase", "Network", "Trainers", "Inference", "GB/s", "Last Transfer", "Age"):
        assert kept in shown


def ranks(*states: str, version: int = 3) -> dict:
    listed = [{"rank": r, "state": s, "pod": f"j-inference-{r}", "since": "2026-11-26T15:04:05Z", "version": version}
              for r, s in enumerate(states)]
    counts = {s: list(states).count(s) for s in ("current", "behind", "away", "rejoining", "dropped")}
    return {"total": len(states), "ready": f"{counts['current']}/{len(states)}", "version": version, **counts,
            "ranks": listed}


def test_events_of_the_ranks_at_the_moments_that_matter():
    joined = status.receiver_events(None, ranks("current", "current", version=0))
    assert joined == [("Normal", status.JOINED, "all 2 inference ranks joined the job")]
    # a new version, ranks behind then current: no Event
    assert status.receiver_events(ranks("current", "current"), ranks("current", "behind", version=4)) == []
    assert status.receiver_events(ranks("current", "behind", version=4), ranks("current", "current", version=4)) == []
    away = status.receiver_events(ranks("current", "current"), ranks("current", "away"))
    assert [(k, r) for k, r, _ in away] == [("Warning", status.RANK_AWAY)] and "rank 1 (pod j-inference-1)" in away[0][2]
    assert status.receiver_events(ranks("current", "away"), ranks("current", "rejoining")) == []
    back = status.receiver_events(ranks("current", "rejoining"), ranks("current", "current"))
    assert [(k, r) for k, r, _ in back] == [("Normal", status.RANK_REJOINED)]
    # away and back between two reports: still the rejoin
    assert status.receiver_events(ranks("current", "away"), ranks("current", "behind"))[0][1] == status.RANK_REJOINED
    # away past its grace: dropped, once; back from there: rejoined
    dropped = status.receiver_events(ranks("current", "away"), ranks("current", "dropped"))
    assert [(k, r) for k, r, _ in dropped] == [("Warning", status.RANK_DROPPED)]
    assert "spec.inference.minAvailable" in dropped[0][2]
    assert status.receiver_events(ranks("current", "dropped"), ranks("current", "dropped")) == []
    assert status.receiver_events(ranks("current", "dropped"), ranks("current", "current"))[0][1] == status.RANK_REJOINED


def test_a_job_too_large_to_list_gets_events_from_the_counts():
    def counted(away: int, rejoining: int = 0, dropped: int = 0) -> dict:
        current = 100 - away - rejoining - dropped
        return {"total": 100, "current": current, "behind": 0, "away": away, "rejoining": rejoining,
                "dropped": dropped, "ready": f"{current}/100", "note": "counts by state only"}

    assert [r for _, r, _ in status.receiver_events(counted(0), counted(2))] == [status.RANK_AWAY]
    assert status.receiver_events(counted(2), counted(0, 2)) == []
    assert [r for _, r, _ in status.receiver_events(counted(0, 2), counted(0))] == [status.RANK_REJOINED]
    assert [r for _, r, _ in status.receiver_events(counted(2), counted(1, dropped=1))] == [status.RANK_DROPPED]


@pytest.fixture
def kopf_log():
    """kopf's log set up as `kopf run` sets it up, its handler writing into a buffer."""
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    kopf.configure(verbose=True)
    out = io.StringIO()
    for handler in root.handlers:
        if handler not in before:
            handler.setStream(out)
    yield out
    root.handlers[:] = before
    root.setLevel(level)


def test_the_operators_lines_carry_the_utc_time_and_their_source(kopf_log):
    assert restyle("kopf") == 1
    logging.getLogger("kopf.objects").info("Handler 'reconcile' succeeded.",
                                           extra={"k8s_ref": {"namespace": "rl", "name": "job"}})
    logging.getLogger("weightsync_operator").warning("two\nlines")
    lines = kopf_log.getvalue().splitlines()
    assert len(lines) == 3 and all(LINE.match(line) for line in lines), lines
    assert lines[0].endswith("[kopf.objects] INFO [rl/job] Handler 'reconcile' succeeded.")
    assert lines[2].endswith("[weightsync_operator] lines")
