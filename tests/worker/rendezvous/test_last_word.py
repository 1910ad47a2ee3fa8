"""A receiver a trainer lost mid-round is heard out before it is counted away (rendezvous/last_word.py),
in one process: the trainer's report of a lost connection comes first, the receiver's own reason
a little later, as when the receiver hung up on bytes whose checksum did not match. (With a real
vLLM server and a corrupted version: tests/worker/vllm_backend/test_vllm_engine.py.)"""
import threading
import time

import pytest
from support import roster
from support.roster import join, make_host

from weightsync.job import Layout, reasons
from weightsync.rendezvous import last_word
from weightsync.rendezvous.messages import SentReport
from weightsync.rendezvous.protocol import Keys
from weightsync.rendezvous.roster import AWAY, SERVING, RankFailed
from weightsync.transport.base import ChecksumMismatch

JOB = "default/last-word"
LAYOUT = Layout(trainers=1, trainer_procs=1, inferences=2, inference_procs=1)
LOST = "inference rank 1: connection lost while sending version 0: [Errno 32] Broken pipe"


@pytest.fixture()
def said():
    return []


@pytest.fixture()
def job(said):
    """The host with every rank joined and version 0's round started, and the ranks' members."""
    host = make_host(LAYOUT, JOB, said, silent_limit=8.0, away_limit=60.0)
    members = {(role, r): roster.member(host, role, r, job=JOB)
               for role, count in (("trainer", 1), ("inference", 2)) for r in range(count)}
    for (role, r), m in members.items():
        join(m, f"127.0.0.1:{2000 + 10 * len(role) + r}")
    admitted = host.admit(timeout=10)
    host.publish_plan("{}", {r: admitted[("inference", r)].endpoint for r in range(2)})
    yield host, members
    host.store.close()


def test_a_receiver_that_refused_corrupted_bytes_fails_the_job_with_its_reason_though_its_trainer_said_first(job, said):
    """The trainer's word (connection lost) is in the store before the controller looks; the
    receiver's ChecksumMismatch comes later. The job fails with the receiver's reason, naming it,
    and counts a failed verification; the receiver is never counted away (a rank cut off, which
    the round would go on without)."""
    host, members = job
    rnd = host.start_round(0)
    assert rnd.receivers == (0, 1)
    members[("trainer", 0)].set(Keys.sent(0, 0, 0), SentReport(0, 0.0, lost={1: LOST}))
    mismatch = ChecksumMismatch("trainer rank 0", "checksum mismatch for bytes [0, 1048576) of version 0: "
                                                  "sent 6dee5613f5cfc0ad, received d51c13e05b1e2a16")
    later = threading.Timer(0.2, members[("inference", 1)].rank_failed, ("inference", 1, mismatch))
    later.start()
    try:
        with pytest.raises(RankFailed) as failed:
            host.collect_sent(rnd, timeout=10)
    finally:
        later.join()
    assert failed.value.reason == reasons.CHECKSUM_MISMATCH
    assert str(failed.value).startswith("inference rank 1 failed: ChecksumMismatch: trainer rank 0: checksum mismatch")
    assert "of version 0" in str(failed.value)
    assert host.verification_failures() == 1
    assert host.seats[1].state == SERVING and not host.has(Keys.cut(0, 0)), "counted away on the trainer's word"
    assert not [line for line in said if "is away" in line], said


def test_a_lost_receiver_that_says_nothing_is_counted_away_once_its_grace_ran_out(job, said, monkeypatch):
    """A receiver whose pod died says nothing: counted away after the grace, not before, nor much
    after, and the trainers are told it is cut off."""
    monkeypatch.setattr(last_word, "LOST_GRACE", 0.5)
    host, members = job
    rnd = host.start_round(0)
    members[("trainer", 0)].set(Keys.sent(0, 0, 0), SentReport(0, 0.0, lost={1: LOST}))
    began = time.monotonic()
    assert len(host.collect_sent(rnd, timeout=10)) == 1
    assert 0.5 <= time.monotonic() - began < 5.0
    assert host.seats[1].state == AWAY and host.seats[0].state == SERVING
    assert host.has(Keys.cut(0, 0))
    assert [line for line in said if line.startswith("inference rank 1 is away: trainer rank 0 lost it")], said


def test_a_receiver_no_trainer_lost_costs_the_round_no_grace(job):
    host, members = job
    rnd = host.start_round(0)
    members[("trainer", 0)].set(Keys.sent(0, 0, 0), SentReport(0, 0.0))
    began = time.monotonic()
    host.collect_sent(rnd, timeout=10)
    assert time.monotonic() - began < 0.5
    assert all(seat.state == SERVING for seat in host.seats.values())
