"""The ranks' join, in one process, when a rank's process dies and starts again before every rank
joined (a pod OOM-killed while it loads its model, or preempted at start): the controller admits
an inference rank's latest start, and the first round takes it back; a trainer that starts again
fails the job at once, naming it; a rank that went silent while joining has its deadline; and
while they wait, the controller says which ranks joined and which are missing, a rank what it
waits for. (The same with real processes: tests/worker/local/test_join_faults.py.)"""
import re
import threading
from functools import partial

import pytest
from support import roster
from support.roster import join, make_host

from weightsync.job import Layout, reasons
from weightsync.rendezvous import channel
from weightsync.rendezvous.messages import Peer, Round
from weightsync.rendezvous.protocol import Keys, Restarted
from weightsync.rendezvous.roster import SERVING, WAITING, Deadline, RankFailed

JOB = "default/joining"
TWO = Layout(trainers=2, trainer_procs=1, inferences=2, inference_procs=1)


@pytest.fixture()
def said():
    return []


@pytest.fixture()
def host(said, request):
    limits = getattr(request, "param", {})
    host = make_host(TWO, JOB, said, silent_limit=limits.get("silent", 8.0), away_limit=limits.get("away", 60.0))
    yield host
    host.store.close()


member = partial(roster.member, job=JOB)


def test_an_inference_rank_that_starts_again_while_the_ranks_join_joins_with_its_new_start(host, said):
    for role, rank in (("trainer", 0), ("trainer", 1), ("inference", 0)):
        join(member(host, role, rank), f"127.0.0.1:{1000 + rank}")
    assert join(member(host, "inference", 1), "127.0.0.1:2001") == 1  # joined, then its process died
    again = member(host, "inference", 1)
    assert again.arrive() == 2
    joined = []
    t = threading.Thread(target=lambda: joined.append(join(again, "127.0.0.1:2002")))  # waits for its challenge
    t.start()
    admitted = host.admit(timeout=30)
    t.join(10)
    assert joined == [2]
    assert admitted[("inference", 1)].endpoint == "127.0.0.1:2002"  # not the dead start's
    assert "inference rank 1 started again (start 2) while the ranks joined: it joins with that start" in said
    assert "inference rank 1 joined (start 2, at 127.0.0.1:2002)" in said
    host.publish_plan("{}", {r: admitted[("inference", r)].endpoint for r in range(2)})
    assert (host.seats[1].attempt, host.seats[1].state, host.seats[1].rejoins) == (2, WAITING, 1)
    assert member(host, "trainer", 0).peers(0, timeout=5) == {0: Peer("127.0.0.1:1000", 1),
                                                              1: Peer("127.0.0.1:2002", 2)}
    rnd = host.start_round(0)
    assert rnd == Round(0, 0, (0, 1), 0)
    assert again.welcome() == rnd and host.seats[1].state == SERVING  # as a rejoined rank is taken back


def test_a_trainer_that_starts_again_while_the_ranks_join_fails_the_job_naming_it(host):
    join(member(host, "trainer", 0), "127.0.0.1:1000")
    assert member(host, "trainer", 1).arrive() == 1  # then its process died
    with pytest.raises(Restarted):
        member(host, "trainer", 1).arrive()
    with pytest.raises(RankFailed, match=r"^trainer rank 1 restarted \(its process started again, start 2\)") as failed:
        host.admit(timeout=30)
    assert failed.value.reason == reasons.TRAINER_STOPPED


def test_the_controller_says_which_ranks_joined_and_which_are_missing_then_names_those_that_never_came(host, said):
    join(member(host, "trainer", 0), "127.0.0.1:1000")
    join(member(host, "inference", 0), "127.0.0.1:2000")
    with pytest.raises(TimeoutError, match=r"^2 ranks did not join within 1s: trainer rank 1, inference rank 1$"):
        host.admit(timeout=1, every=0.2)
    lines = [m for m in said if m.startswith("waiting for the ranks to join")]
    assert lines and re.fullmatch(r"waiting for the ranks to join: trainer rank 0 joined, trainer rank 1 missing "
                                  r"\(\d+s left\); inference rank 0 joined, inference rank 1 missing \(\d+s left\)",
                                  lines[-1]), lines


@pytest.mark.parametrize("host", [{"silent": 0.5, "away": 2.0}], indirect=True)
def test_an_inference_rank_silent_while_joining_has_the_away_limit_to_start_again(host, said):
    for role, rank in (("trainer", 0), ("trainer", 1), ("inference", 0)):
        join(member(host, role, rank), f"127.0.0.1:{1000 + rank}")
    dead = member(host, "inference", 1)
    dead.arrive()
    dead.start_heartbeat()
    dead.stop_heartbeat()  # it died while it loaded its model
    with pytest.raises(RankFailed, match=r"^inference rank 1 did not start again within 2s after it went silent "
                                         r"while joining$") as failed:
        host.admit(timeout=60, every=0.2)
    assert failed.value.reason == reasons.RANK_LOST
    assert any("inference rank 1 is silent: no heartbeat for" in m for m in said), said


@pytest.mark.parametrize("host", [{"silent": 0.5}], indirect=True)
def test_a_trainer_silent_while_joining_fails_the_job_naming_it(host):
    join(member(host, "inference", 0), "127.0.0.1:2000")
    dead = member(host, "trainer", 1)
    dead.arrive()
    dead.start_heartbeat()
    dead.stop_heartbeat()
    with pytest.raises(RankFailed, match=r"^trainer rank 1 is silent: no heartbeat for \d+s while joining") as failed:
        host.admit(timeout=60)
    assert failed.value.reason == reasons.TRAINER_STOPPED


@pytest.mark.parametrize("host", [{"silent": 0.5}], indirect=True)
def test_a_trainer_that_joined_then_went_silent_while_the_others_join_fails_the_job_naming_it(host):
    """Not the rank still joining, at the join's deadline: the trainer, within its silence limit."""
    dead = member(host, "trainer", 1)
    dead.arrive()
    dead.start_heartbeat()
    join(dead, "127.0.0.1:1001")
    dead.stop_heartbeat()  # killed once it joined: an external trainer's process is not started again
    join(member(host, "trainer", 0), "127.0.0.1:1000")
    join(member(host, "inference", 0), "127.0.0.1:2000")  # inference rank 1 still loads its model
    with pytest.raises(RankFailed, match=r"^trainer rank 1 is silent: no heartbeat for \d+s after it joined, while the "
                                         r"others join \(its process died") as failed:
        host.admit(timeout=30)
    assert failed.value.reason == reasons.TRAINER_STOPPED


def test_external_ranks_that_never_come_fail_the_job_by_name_at_their_deadline(host):
    join(member(host, "trainer", 0), "127.0.0.1:1000")
    deadline = Deadline(0.5, "spec.trainer.attachTimeoutSeconds", "RANK 0..1, WORLD_SIZE=2")
    with pytest.raises(RankFailed) as failed:
        host.admit(timeout=30, external={"trainer": deadline})
    assert str(failed.value) == ("trainer rank 1 did not join within 0s (spec.trainer.attachTimeoutSeconds): start it with "
                                 "the join variables (RANK 0..1, WORLD_SIZE=2)")
    assert failed.value.reason == reasons.TIMED_OUT


def test_a_joining_rank_says_what_it_waits_for_from_the_controller(host, monkeypatch):
    monkeypatch.setattr(channel, "SAY_EVERY", 0.2)
    m = member(host, "inference", 0)
    lines = []
    m.say = lines.append
    join(m, "127.0.0.1:2000")  # the controller's challenge for start 1 is there from the start: no wait
    with pytest.raises(TimeoutError, match="waited 1s for the transfer plan"):
        m.plan(timeout=1)
    assert lines and all(re.fullmatch(r"still waiting for the transfer plan \(the controller publishes it once every "
                                      r"rank joined\) \(\d+s, \d+s left\)", line) for line in lines), lines
    assert not m.has(Keys.PLAN)
