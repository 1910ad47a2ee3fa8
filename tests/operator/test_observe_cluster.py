"""What an operator of RL jobs sees of a running job in a cluster: as the job's controller pod
reports its inference ranks (status.receivers), the operator posts an Event when every rank
joined, when one goes away and when it is back, none for a new version; `kubectl get wtj` shows
the transport, the ranks on the latest version and why a job failed."""

from __future__ import annotations

import json
import re

import pytest

from weightsync.job import PLURAL

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def receivers(version: int, *states: str) -> dict:
    counts = {s: list(states).count(s) for s in ("current", "behind", "away", "rejoining")}
    return {"total": len(states), "ready": f"{counts['current']}/{len(states)}", "version": version, **counts,
            "ranks": [{"rank": r, "state": s, "pod": f"seen-inference-{r + 3}", "version": version,
                       "since": "2026-11-26T15:04:05Z"} for r, s in enumerate(states)]}


def row(ns) -> dict[str, str]:
    """`kubectl get wtj seen`'s row by column (names may hold one space: LAST TRANSFER)."""
    header, line = ns.kubectl("get", PLURAL, "seen").stdout.splitlines()
    starts = [(m.start(), m.group()) for m in re.finditer(r"\S+(?: \S+)*", header)]
    ends = [start for start, _ in starts[1:]] + [None]
    return {name: line[start:end].strip() for (start, name), end in zip(starts, ends)}


def test_the_ranks_states_make_events_and_columns(ns):
    ns.apply_job("seen", {"trainer": {"replicas": 1}, "inference": {"replicas": 1, "procsPerPod": 2}})
    ns.wait_children("seen")
    token = ns.kubectl("create", "token", "seen-controller").stdout.strip()

    def report(**status):
        ns.kubectl("--token", token, "patch", PLURAL, "seen", "--subresource=status", "--type=merge",
                   "-p", json.dumps({"status": status}))

    def reasons() -> list[str]:
        return [e["reason"] for e in ns.events("seen") if e["reason"].startswith(("All", "Rank"))]

    report(receivers=receivers(0, "current", "current"))
    assert "all 2 inference ranks joined" in ns.wait_event("seen", "AllRanksJoined")["message"]
    for version in (1, 2):  # new versions: no Event
        report(receivers=receivers(version, "current", "current"),
               transfer={"version": version, "bytes": 10, "gbps": 0.5, "transport": "tcp"})
    report(receivers=receivers(2, "current", "away"))
    away = ns.wait_event("seen", "RankAway")
    assert away["type"] == "Warning" and "inference rank 1 (pod seen-inference-4)" in away["message"]
    report(receivers=receivers(3, "current", "current"))
    ns.wait_event("seen", "RankRejoined")
    assert sorted(reasons()) == ["AllRanksJoined", "RankAway", "RankRejoined"]  # one each, none per version
    assert ns.status("seen")["receivers"] == receivers(3, "current", "current")

    shown = row(ns)
    assert (shown["TRANSPORT"], shown["RECEIVERS"], shown["VERSION"], shown["REASON"]) == ("tcp", "2/2", "2", "")

    report(completion={"state": "Failed", "reason": "VerificationFailed", "message": "rank 1 applied the wrong digest",
                       "versions": 3, "time": "2026-11-26T15:04:05Z"})
    failed = ns.wait_event("seen", "Failed")
    assert failed["message"].startswith("VerificationFailed: ")
    assert row(ns)["REASON"] == "VerificationFailed"
