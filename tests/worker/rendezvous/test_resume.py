"""Trainers that resume from their checkpoint, in one process through the controller's store
(rendezvous/resume.py): a trainer rank that starts again stops the versions (TrainersRestart where
the trainers resume, RankFailed where they do not), every trainer rank must start again and prove
the token over a fresh challenge, a process of an earlier start that still waits on weightsync is
told to end, and the controller says where they resume. A trainer rank that stops before a round
is sent drops the round (its receivers leave it); one that stops once it is sent is seen between
two versions. (With real processes and the example script's checkpoint:
tests/worker/publisher/test_trainer_resume.py.)"""
import threading
from functools import partial

import pytest
from support import roster
from support.roster import make_host

from weightsync.job import Layout, reasons
from weightsync.rendezvous.following import Dropped
from weightsync.rendezvous.join_phase import TrainersRestart
from weightsync.rendezvous.messages import Applied, RankInfo, Ready, SentReport, Text
from weightsync.rendezvous.protocol import Keys, Resuming
from weightsync.rendezvous.resume import resume
from weightsync.rendezvous.roster import RankFailed

JOB = "default/resume"
TWO = Layout(trainers=2, trainer_procs=1, inferences=1, inference_procs=1)


@pytest.fixture()
def said():
    return []


@pytest.fixture()
def host(said):
    host = make_host(TWO, JOB, said, silent_limit=8.0, away_limit=60.0)
    yield host
    host.store.close()


@pytest.fixture()
def resuming(said):
    """A Host whose trainers resume (spec.trainer.resumes)."""
    host = make_host(TWO, JOB, said, silent_limit=8.0, away_limit=60.0, resumable=True)
    yield host
    host.store.close()


member = partial(roster.member, job=JOB)


def join(m, resumes=True):
    m.arrive(resumes=resumes)
    roster.join(m, f"127.0.0.1:{1000 + m.rank}")
    if m.role == "trainer":
        m.watch_resumes()
    return m


def started(host):
    members = {(role, rank): join(member(host, role, rank)) for role, rank in (("trainer", 0), ("trainer", 1),
                                                                                ("inference", 0))}
    admitted = host.admit(timeout=10)
    host.publish_plan("{}", {0: admitted[("inference", 0)].endpoint})
    return members


def test_a_trainer_that_starts_again_stops_the_versions_and_every_trainer_rank_resumes(resuming, said):
    host = resuming
    old = started(host)
    old[("trainer", 0)].set(Keys.ready(2, 0), Ready(20))  # ready with version 2 when its peer went
    again = member(host, "trainer", 1)
    assert again.arrive(resumes=True) == 2
    host.last_watch = 0.0
    with pytest.raises(TrainersRestart, match="trainer rank 1 started again .start 2."):
        host.check_ranks()

    got = []
    t = threading.Thread(target=lambda: got.append(resume(host, 30, 2, 1, 10, lambda rank, admission: None,
                                                          every=0.2)))
    t.start()
    # the process of rank 0's earlier start learns that it must end
    with pytest.raises(Resuming, match="trainer rank 0: the job's trainers resume from their checkpoint"):
        old[("trainer", 0)].wait_for(Keys.END, "the end", timeout=10)
    again.join("127.0.0.1:2001", '{"layout": 1}', RankInfo("tcp", pod="trainer-1"), timeout=10)
    again.watch_resumes()
    zero = join(member(host, "trainer", 0))
    t.join(20)
    assert got == [{0: 2, 1: 2}]
    assert not host.has(Keys.ready(2, 0)), "a ready of an earlier start would let the version go too soon"
    where = zero.resumed(timeout=5)
    assert (where.version, where.delivered, where.step, where.resumes) == (2, 1, 10, 1)
    assert again.resumed(timeout=5).attempts == {0: 2, 1: 2}
    assert host.resumes == 1 and host.trainers_running() == {0: 2, 1: 2}
    assert "trainer rank 1 is back (start 2, at 127.0.0.1:2001)" in said
    assert any(line.startswith("the trainers resume: ") and "to start again (" in line
               for line in said), said
    again.check_end()  # the processes of the new starts wait on


def test_trainers_that_do_not_start_again_fail_the_job_naming_them(resuming):
    host = resuming
    started(host)
    member(host, "trainer", 1).arrive(resumes=True)
    host.last_watch = 0.0
    with pytest.raises(TrainersRestart):
        host.check_ranks()
    with pytest.raises(RankFailed, match=r"trainer ranks 0-1 did not start again within 1s .*attachTimeoutSeconds") as e:
        resume(host, 1, 2, 1, 10, lambda rank, admission: None)
    assert e.value.reason == reasons.TRAINER_STOPPED


def test_a_trainer_that_starts_again_fails_the_job_where_the_trainers_do_not_resume(host):
    started(host)
    again = member(host, "trainer", 1)
    with pytest.raises(Exception, match="trainer rank 1 restarted after it had joined the job"):
        again.arrive()
    host.last_watch = 0.0
    with pytest.raises(RankFailed, match="trainer rank 1 restarted .its process started again, start 2.") as e:
        host.check_ranks()
    assert not isinstance(e.value, TrainersRestart) and e.value.reason == reasons.TRAINER_STOPPED


def test_trainer_ranks_ready_at_different_steps_fail_the_job_naming_them(host):
    members = started(host)
    members[("trainer", 0)].set(Keys.ready(0, 0), Ready(30))
    members[("trainer", 1)].set(Keys.ready(0, 1), Ready(20))
    with pytest.raises(RankFailed, match="trainer rank 0 at step 30, trainer rank 1 at step 20") as e:
        host.next_version(0)
    assert e.value.reason == reasons.TRAINERS_DISAGREE


def ready_round(host, members, version: int):
    """Every trainer rank ready with `version`, and its round said."""
    for t in (0, 1):
        members[("trainer", t)].set(Keys.ready(version, t), Ready(version * 10))
    assert host.next_version(version)
    return host.start_round(version)


def test_a_trainer_that_stops_before_the_round_is_sent_stops_it_and_its_receivers_leave_it(resuming):
    host = resuming
    members = started(host)
    rnd = ready_round(host, members, 1)
    members[("trainer", 0)].set(Keys.sent(1, 0, 0), SentReport(bytes=8, seconds=0.1))
    member(host, "trainer", 1).arrive(resumes=True)  # its share not sent: it started again
    host.last_watch = 0.0
    with pytest.raises(TrainersRestart, match="trainer rank 1 started again"):
        host.collect_sent(rnd, timeout=10)

    receiver = members[("inference", 0)]
    receiver.verdict(rnd, 0.3)  # nothing said yet: the caller's error stands
    host.set(Keys.dropped(1), Text("trainer rank 1 started again (start 2)"))
    with pytest.raises(Dropped, match=r"version 1 was dropped on its way: trainer rank 1 started again \(start 2\)"):
        receiver.verdict(rnd, 5)
    with pytest.raises(Dropped):  # a rank that waits for the version's reference digest leaves it too
        receiver.wait([Keys.ref(1)], "the reference digest", 5, receiver.behind(1, Keys.ref(1)))
    host.forget(1)
    assert not host.has(Keys.dropped(1))


def test_a_trainer_that_stops_once_the_round_is_sent_is_seen_at_the_next_version(resuming):
    host = resuming
    members = started(host)
    rnd = ready_round(host, members, 1)
    for t in (0, 1):
        members[("trainer", t)].set(Keys.sent(1, 0, t), SentReport(bytes=8, seconds=0.1))
    assert len(host.collect_sent(rnd, timeout=10)) == 2
    members[("trainer", 0)].fail("its collective lost a peer")  # trainer rank 1 died: it starts again
    member(host, "trainer", 1).arrive(resumes=True)
    members[("inference", 0)].set(Keys.applied(1, 0, 1), Applied("d"))
    host.last_watch = 0.0
    assert host.collect_applied(rnd, timeout=10) == {0: Applied("d")}  # the round ends as sent
    with pytest.raises(TrainersRestart, match="trainer rank 1 stopped .its process started again., and trainer rank 0 "
                                              "failed with it"):
        host.next_version(2)


def test_without_resuming_trainers_a_trainer_that_stops_once_the_round_is_sent_fails_it(host):
    members = started(host)
    rnd = ready_round(host, members, 1)
    for t in (0, 1):
        members[("trainer", t)].set(Keys.sent(1, 0, t), SentReport(bytes=8, seconds=0.1))
    host.collect_sent(rnd, timeout=10)
    members[("trainer", 1)].fail("out of memory")
    with pytest.raises(RankFailed, match="trainer rank 1 failed: out of memory"):
        host.collect_applied(rnd, timeout=10)
