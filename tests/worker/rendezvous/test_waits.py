"""A rank's waits ask little of the controller's store, and still end at once: a wait with stops
(the keys on which its check raises: the job's end, its round dropped, its start counted away)
blocks in the store until its keys or a stop are set, and looks at the rest about once a second,
where every rank used to ask the store four or more times a second; at a thousand ranks those
looks were most of what the store served. The store answers each step of the wait with what the
check looks at, and its end with the value waited for: one request a second, and none after."""
import threading
import time

import pytest
from support.roster import make_host, one_of_each

from weightsync.job import Layout
from weightsync.rendezvous.channel import STOPPED_CHECK_EVERY
from weightsync.rendezvous.following import Dropped, FellBehind
from weightsync.rendezvous.messages import Number, Text
from weightsync.rendezvous.protocol import JobEnded, Keys

JOB = "default/waits"
ONE = Layout(trainers=1, trainer_procs=1, inferences=1, inference_procs=1)


@pytest.fixture()
def joined():
    with one_of_each(JOB) as got:
        yield got


def test_a_store_wait_with_stops_ends_when_its_keys_or_a_stop_are_set():
    host = make_host(ONE, JOB, [], silent_limit=60.0, away_limit=60.0)
    store = host.store
    try:
        threading.Timer(0.2, lambda: store.set("stop", b"1")).start()
        started = time.monotonic()
        assert store.wait_get(["never"], ["stop", "other"], [], 10.0) == [b"\x00", b"\x011", b"\x00"]
        assert time.monotonic() - started < 5.0  # ended by the stop, not by its timeout
        store.set("k", b"1")
        assert store.wait_get(["k"], ["stop"], [], 10.0) == [b"\x011", b"\x011"]  # every key set, stops or not
        assert store.waits == 0
    finally:
        store.close()


def test_a_store_wait_get_answers_the_values_of_its_keys_stops_and_looks_past_its_timeout_too():
    host = make_host(ONE, JOB, [], silent_limit=60.0, away_limit=60.0)
    store = host.store
    try:
        store.set("look", b"L")
        threading.Timer(0.2, lambda: store.set("k", b"v")).start()
        assert store.wait_get(["k"], ["stop"], ["look", "none"], 10.0) == [b"\x01v", b"\x00", b"\x01L", b"\x00"]
        started = time.monotonic()
        assert store.wait_get(["never"], ["stop"], ["look"], 0.2) == [b"\x00", b"\x00", b"\x01L"]  # no error
        assert time.monotonic() - started >= 0.15
        store.set("stop", b"S")
        assert store.wait_get(["never"], ["stop"], [], 10.0) == [b"\x00", b"\x01S"]
        assert store.waits == 0
    finally:
        store.close()


@pytest.mark.parametrize("stop,raised", [
    ("end", JobEnded), ("dropped", Dropped), ("away", FellBehind)])
def test_an_inference_rank_waiting_for_its_go_asks_the_store_once_a_second_and_sees_a_stop_at_once(
        joined, stop, raised):
    host, members = joined
    inference = members["inference"]
    caught = []

    def wait_for_go() -> None:
        try:
            inference.round(1)
        except Exception as e:  # noqa: BLE001 - what ended the wait, checked below
            caught.append((e, time.monotonic()))

    thread = threading.Thread(target=wait_for_go, daemon=True)
    before = host.store.requests
    thread.start()
    time.sleep(2.0)
    asked = host.store.requests - before
    # one wait that answers with what its look reads, about every STOPPED_CHECK_EVERY: 2 in 2 s,
    # where a wait and a peek asked 4, and the look every 0.25 s of five reads 48; a slow machine
    # asks fewer, never more
    assert asked <= 2.0 / STOPPED_CHECK_EVERY + 2, asked
    assert thread.is_alive() and not caught
    set_at = time.monotonic()
    if stop == "end":
        host.end("Failed", "ended by the test", "RankFailed")
    elif stop == "dropped":
        host.set(Keys.dropped(1), Text("a trainer rank stopped"))
    else:
        host.set(Keys.away(0, inference.attempt), Text("silent for the test"))
    thread.join(10.0)
    assert caught and isinstance(caught[0][0], raised), caught
    assert caught[0][1] - set_at < STOPPED_CHECK_EVERY, "the stop did not end the wait before its next look"


def test_a_go_comes_with_the_wait_that_ends_and_nothing_is_read_after(joined):
    host, members = joined
    rnd = host.start_round(0)
    for role, m in members.items():
        before = host.store.requests
        assert m.round(0) == rnd, role
        assert host.store.requests - before == 1, role  # the wait, answered with the go


def test_an_inference_rank_left_behind_learns_it_from_what_its_wait_answers(joined):
    host, members = joined
    inference = members["inference"]
    host.set(Keys.LATEST, Number(2))  # the controller went on to version 2; go/1 is gone
    started = time.monotonic()
    with pytest.raises(FellBehind, match="went on to version 2"):
        inference.round(1)
    assert time.monotonic() - started < 2 * STOPPED_CHECK_EVERY + 1.0
