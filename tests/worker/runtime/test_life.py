"""One rank's life (runtime/life.py), against a real controller's store on loopback, the test
playing the controller: a failure reaches the controller as a typed record (its reason classified,
or the rank's own words), once, whoever reports it first; the goodbye is said however the rank's
work ends, once; a failed rank's wait for the end and a pod's linger both end at their deadline."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from support.jobs import make_job
from support.roster import TOKEN, make_host

from weightsync.job import INFERENCE, TRAINER, WorkerContext, reasons, states
from weightsync.rendezvous.channel import Channel, connect_store
from weightsync.rendezvous.messages import End, RankFailure
from weightsync.rendezvous.protocol import JobEnded, Keys
from weightsync.runtime.life import Farewell, RankLife
from weightsync.runtime.rank import Expected, linger

JOB = make_job("life")


@pytest.fixture()
def host():
    host = make_host(JOB.layout, JOB.identity, [], silent_limit=60.0, away_limit=60.0)
    yield host
    host.store.close()


def context(host, cluster: bool = False) -> WorkerContext:
    return WorkerContext(JOB, 1, INFERENCE, "127.0.0.1", "127.0.0.1", host.store.port, 0, "tcp", TOKEN, cluster)


@pytest.fixture()
def controller(host):
    """The test's side of the store, as the controller's."""
    channel = Channel(connect_store("127.0.0.1", host.store.port, TOKEN, JOB.identity, 10))
    yield channel
    channel.store.close()


def end_on_failure(controller: Channel, role: str, rank: int) -> threading.Thread:
    """As the controller: once (role, rank) reported its failure, end the job Failed."""
    def end():
        controller.wait([Keys.failed(role, rank)], "the failure", 30)
        controller.set(Keys.END, End(states.FAILED, f"{role} rank {rank} failed"))

    thread = threading.Thread(target=end, daemon=True)
    thread.start()
    return thread


def failure_of(controller: Channel, role: str, rank: int) -> RankFailure:
    return RankFailure.from_json(controller.get(Keys.failed(role, rank)))


def test_a_failure_is_reported_as_its_typed_record_and_the_rank_says_goodbye(host, controller):
    life = RankLife(context(host), INFERENCE, 0)
    ender = end_on_failure(controller, INFERENCE, 0)

    def body() -> str:
        life.heartbeat()
        raise TimeoutError("the plan did not come")

    assert life.run(body) == 1
    ender.join(10)
    assert failure_of(controller, INFERENCE, 0) == RankFailure(reasons.TIMED_OUT, "TimeoutError: the plan did not come")
    assert controller.has(Keys.bye(INFERENCE, 0)) and life.said_bye
    assert life.member.attempt == 1  # its start counted, once


def test_a_failure_the_rank_reported_itself_is_reported_once_in_its_own_words(host, controller):
    life = RankLife(context(host), INFERENCE, 0)
    ender = end_on_failure(controller, INFERENCE, 0)
    failures = controller.store.add(Keys.FAILURES, 0)

    def body() -> str:
        error = Expected("the model does not fit")
        record = life.fail(error, said="the model does not fit on this pod's GPU")
        assert record == RankFailure(reasons.RANK_FAILED, "the model does not fit on this pod's GPU")
        raise error

    assert life.run(body) == 1
    ender.join(10)
    assert failure_of(controller, INFERENCE, 0).message == "the model does not fit on this pod's GPU"
    assert controller.store.add(Keys.FAILURES, 0) == failures + 1  # the run did not report it again
    assert life.report(RuntimeError("later")) is None  # the job has ended: nothing more to tell
    assert controller.has(Keys.bye(INFERENCE, 0))


@pytest.mark.parametrize("ending", ["succeeded", "ended", "failed elsewhere"])
def test_the_goodbye_is_said_however_the_work_ends(host, controller, ending):
    life = RankLife(context(host), TRAINER, 0)

    def body() -> str:
        life.heartbeat()
        if ending == "ended":
            raise JobEnded(states.FAILED, "the job failed")
        return states.SUCCEEDED if ending == "succeeded" else states.FAILED

    assert life.run(body) == (0 if ending == "succeeded" else 1)
    assert controller.has(Keys.bye(TRAINER, 0))
    assert not controller.has(Keys.failed(TRAINER, 0))  # no failure of its own
    assert life.bye()  # said once: again is nothing


def test_a_failed_ranks_wait_for_the_end_has_its_deadline(host, controller):
    life = RankLife(context(host), INFERENCE, 0)
    life.arrive()
    started = time.monotonic()
    record = life.fail(Expected("the staging buffer is gone"), trace=False, wait=False)
    assert record == RankFailure(reasons.RANK_FAILED, "Expected: the staging buffer is gone")
    assert life.wait_for_end(timeout=0.5) is None  # the controller never ended the job
    assert time.monotonic() - started < 5
    controller.set(Keys.END, End(states.FAILED, "inference rank 0 failed"))
    assert life.wait_for_end(timeout=5) == End(states.FAILED, "inference rank 0 failed")
    life.bye()


def test_a_pod_speaking_for_its_ranks_reports_each_and_says_goodbye_for_all(host, controller):
    pod = Farewell(context(host), TRAINER, (0,), "trainer pod life-trainer-0", controller)
    assert pod.report("the trainer command exited 1 before this rank closed", 0) == \
        RankFailure(reasons.RANK_FAILED, "the trainer command exited 1 before this rank closed")
    assert pod.report("again", 0) is None  # the rank's first words stand
    pod.bye()
    assert controller.has(Keys.bye(TRAINER, 0))


def test_linger_ends_at_its_deadline_when_nobody_removes_the_pod(host, capfd):
    assert threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM)
    try:
        started = time.monotonic()
        linger(context(host, cluster=True), "inference rank 0", deadline=0.5)
        took = time.monotonic() - started
    finally:
        signal.signal(signal.SIGTERM, before)
    assert 0.4 < took < 3, took
    err = capfd.readouterr().err
    assert "[inference rank 0] the operator did not remove this pod within 0.5s of the job's end; exiting" in err, err
