"""Scaling a job's inference pods while it runs, in one process through the controller's store
(roster.py): the layout holds ranks for spec.inference.maxReplicas pods, the ranks beyond
spec.inference.replicas are parked (not waited for while the ranks join, nor in the rounds), a
rank whose pod is scaled up to joins when its process starts and is taken in at the next round,
and the ranks of pods scaled away leave without failing the round on its way. The same in real
pods: tests/e2e/test_e2e.py."""
import threading
import time
from functools import partial

import pytest
from support import roster
from support.roster import join, make_host
from support.waits import until

from weightsync.job import Layout
from weightsync.rendezvous.messages import Applied, Peer, Round
from weightsync.rendezvous.protocol import Keys
from weightsync.rendezvous.roster import JOINING, PARKED, SERVING, WAITING, RankFailed
from weightsync.roles.controller.receivers import Receivers
from weightsync.roles.controller.scaling import ScaleWatch

JOB = "default/scaling"
THREE = Layout(trainers=1, trainer_procs=1, inferences=3, inference_procs=1)  # maxReplicas 3


@pytest.fixture()
def said():
    return []


@pytest.fixture()
def host(said):
    host = make_host(THREE, JOB, said, silent_limit=1.5, away_limit=60.0, running=2)
    yield host
    host.store.close()


member = partial(roster.member, job=JOB)


def started(host):
    """The trainer and the running inference ranks joined; the plan published."""
    members = {(role, rank): member(host, role, rank) for role, rank in (("trainer", 0), ("inference", 0), ("inference", 1))}
    for (role, rank), m in members.items():
        join(m, f"127.0.0.1:{1000 + 10 * len(role) + rank}")
    admitted = host.admit(timeout=10)
    assert set(admitted) == {("trainer", 0), ("inference", 0), ("inference", 1)}  # rank 2 is not waited for
    host.publish_plan("{}", {r: got.endpoint for (role, r), got in admitted.items() if role == "inference"})
    return members


def watch(host, until, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not until() and time.monotonic() < deadline:
        host.check_ranks()
        time.sleep(0.02)
    assert until()


def test_the_ranks_beyond_the_running_pods_are_parked_not_waited_for_and_not_sent_to(host, said):
    members = started(host)
    assert [s.state for s in host.seats.values()] == [SERVING, SERVING, PARKED]
    assert members[("trainer", 0)].peers(0, timeout=5) == {0: Peer("127.0.0.1:1090", 1), 1: Peer("127.0.0.1:1091", 1)}
    assert host.start_round(0).receivers == (0, 1)
    host.holding(0, [0, 1])
    assert host.behind(0) == [] and host.needed == 2  # minAvailable unset: every running rank
    assert not host.there(2)
    record = Receivers(host, lambda r: None).record()
    assert (record["total"], record["ready"], [r["rank"] for r in record["ranks"]]) == (2, "2/2", [0, 1])


def test_a_rank_whose_pod_is_scaled_up_to_joins_when_it_starts_and_takes_the_next_round_in_full(host, said):
    members = started(host)
    host.start_round(0)
    host.holding(0, [0, 1])
    host.wanted = 3  # the controller read spec.inference.replicas 3
    new = member(host, "inference", 2)
    joined = []
    t = threading.Thread(target=lambda: joined.append(join(new, "127.0.0.1:1092")))  # waits for its challenge
    t.start()
    watch(host, lambda: host.seats[2].state == WAITING)
    t.join(5)
    assert joined == [1]  # its first start
    assert host.seats[2].rejoins == 0 and host.rejoins() == 0  # a new pod, not one that came back
    assert any("inference rank 2 joined the running job (start 1, pod inference-2" in line for line in said), said
    assert "the job runs 3 inference ranks now (spec.inference.replicas changed; it ran 2)" in said
    assert host.behind(0) == [2]
    rnd = host.start_round(1, bases=lambda holds: {r: 0 for r, v in holds.items() if v == 0})
    assert rnd.receivers == (0, 1, 2) and 2 not in rnd.bases  # the new rank gets the version whole
    assert new.welcome() == rnd and host.seats[2].state == SERVING
    assert members[("trainer", 0)].peers(rnd.epoch, timeout=5)[2] == Peer("127.0.0.1:1092", 1)


def test_the_ranks_of_pods_scaled_away_leave_the_round_on_its_way_without_failing_it(host, said):
    members = started(host)
    rnd = host.start_round(0)
    host.wanted = 1
    host.check_ranks()
    assert [s.state for s in host.seats.values()] == [SERVING, PARKED, PARKED]
    assert members[("trainer", 0)].get_json(Keys.cut(0, 0)) == [1]  # the trainers stop sending to it
    assert any("inference rank 1 leaves the job: its pod was scaled away" in line for line in said), said
    host.set(Keys.applied(0, 0, 1), Applied("d"))
    assert host.collect_applied(rnd, timeout=5) == {0: Applied("d")}  # not waited for
    assert host.start_round(1).receivers == (0,)
    assert host.needed == 1 and host.behind(1) == [0]
    time.sleep(1.6)  # past the silence limit: a parked rank's silence counts for nothing
    host.last_watch = 0.0
    host.check_ranks()
    assert host.seats[1].state == PARKED


def test_a_rank_scaled_away_then_back_before_its_pod_went_is_taken_back_while_it_beats(host, said):
    started(host)
    host.start_round(0)
    host.holding(0, [0, 1])
    host.wanted = 1
    host.check_ranks()
    assert host.seats[1].state == PARKED and host.seats[1].holds is None  # it gets the next version whole
    host.store.add(Keys.beat("inference", 1), 1)  # its process still beats
    host.last_watch = 0.0
    host.wanted = 2
    host.check_ranks()
    assert host.seats[1].state == WAITING
    assert host.start_round(1).receivers == (0, 1)


def test_a_scale_down_while_the_ranks_join_stops_the_wait_for_the_pods_scaled_away(host, said):
    for role, rank in (("trainer", 0), ("inference", 0)):
        join(member(host, role, rank), f"127.0.0.1:{1000 + rank}")
    got = []
    t = threading.Thread(target=lambda: got.append(host.admit(timeout=20, every=0.2)))
    t.start()
    until("the join saying inference rank 1 is missing",
          lambda: any("inference rank 1 missing" in line for line in said), 20)
    assert not got  # inference rank 1 is waited for
    host.wanted = 1
    t.join(10)
    assert set(got[0]) == {("trainer", 0), ("inference", 0)}
    assert any("waiting for the ranks to join: every trainer rank joined; inference rank 0 joined, inference rank 1 "
               "missing" in line for line in said), said
    host.publish_plan("{}", {0: got[0][("inference", 0)].endpoint})
    assert [s.state for s in host.seats.values()] == [SERVING, PARKED, PARKED]


def test_a_parked_rank_that_does_not_prove_the_token_in_time_is_dropped_or_fails_the_job(said):
    host = make_host(THREE, JOB, said, silent_limit=1.5, away_limit=0.3, running=2)
    try:
        started(host)
        host.wanted = 3
        member(host, "inference", 2).arrive()  # its process started, and never proves the token
        watch(host, lambda: host.seats[2].state == JOINING)
        with pytest.raises(RankFailed, match="inference rank 2 did not come back within 0s .* needs 3 inference ranks"):
            watch(host, lambda: False, seconds=5)
    finally:
        host.store.close()


def test_the_watch_reads_the_pods_count_into_the_roster_and_says_once_when_it_cannot():
    said, counts = [], iter([2, RuntimeError("403 Forbidden"), RuntimeError("403 Forbidden"), 3])

    class Roster:
        """The part of the controller's Host that ScaleWatch tells."""

        wanted = None

        def scaled_to(self, ranks: int) -> None:
            self.wanted = ranks

    def read():
        got = next(counts)
        if isinstance(got, Exception):
            raise got
        return got

    roster = Roster()
    scale = ScaleWatch(roster, read, lambda pods: 2 * pods, said.append)
    scale.look()
    assert roster.wanted == 4
    scale.look()
    scale.look()
    assert roster.wanted == 4 and said == ["cannot read spec.inference.replicas (tried again every 2s): 403 Forbidden"]
    scale.look()
    assert roster.wanted == 6


def test_a_round_to_the_running_ranks_is_what_the_trainers_read(host):
    members = started(host)
    rnd = host.start_round(0)
    assert members[("trainer", 0)].round(0) == rnd == Round(0, 0, (0, 1), 0)
